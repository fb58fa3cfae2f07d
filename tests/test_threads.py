"""fxquant._threads.start_daemon: background torch work must not add an OpenMP team next to the training thread's
(libgomp then throttles every team's spin-wait: the main command's steps outside the capture window ran at about
1.6-2x their time, 2-core box)."""
from __future__ import annotations

import os
import queue
import sys
import threading

import pytest
import torch

from fxquant._threads import _openmp, start_daemon

pytestmark = pytest.mark.skipif(not _openmp(), reason="the mechanism is libgomp's; this torch uses another backend")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _tasks() -> set[str]:
    """The process's OS thread ids. Tests count the ids that appear, not the change in their number: a thread's
    OpenMP worker exits asynchronously after the thread is joined, and may do so while the next count runs."""
    return set(os.listdir("/proc/self/task"))


def _run_in(start, work) -> tuple[list[int], int]:
    """Start a thread with ``start``, let it run ``work``, keep it alive; the thread's get_num_threads() and how many
    OS threads appeared while it ran."""
    seen: list[int] = []
    release: queue.Queue = queue.Queue()
    done = threading.Event()

    def target() -> None:
        work()
        seen.append(torch.get_num_threads())
        done.set()
        release.get()

    torch.floor(torch.randn(1 << 20))  # the main thread's own team exists before counting
    n0 = _tasks()
    thread = start(target)
    assert done.wait(60)
    gained = len(_tasks() - n0)
    release.put(None)
    thread.join(60)
    return seen, gained


def _plain(target) -> threading.Thread:
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")
def test_plain_thread_adds_an_openmp_team_start_daemon_does_not(two_threads):
    big = lambda: torch.floor(torch.randn(1 << 21))  # noqa: E731  (well over the grain size: a parallel region)
    seen, gained = _run_in(_plain, big)
    assert seen == [2] and gained == 2  # the thread and its own OpenMP worker: what start_daemon avoids
    seen, gained = _run_in(lambda t: start_daemon(t, name="fxquant-test"), big)
    assert seen == [1] and gained == 1


def test_defaults_are_kept_for_the_caller_and_later_threads(two_threads):
    seen, _ = _run_in(lambda t: start_daemon(t, name="fxquant-test"), lambda: None)
    assert seen == [1]
    assert torch.get_num_threads() == 2
    later: list[int] = []
    t = _plain(lambda: later.append(torch.get_num_threads()))
    t.join(60)
    assert later == [2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")
def test_capture_writer_adds_no_openmp_team(tmp_path, two_threads, monkeypatch):
    """A session's writer computes statistics of a large CPU tensor in its thread, here with torch ops (the host
    kernels' torch twins, as without numba): the process gains the writer thread and nothing else (with a plain
    thread it also gained an OpenMP worker, first test)."""
    monkeypatch.setenv("FXQUANT_HOST_KERNELS", "torch")
    from fxquant import capture

    from tests.capture_helpers import spec_text, tap

    torch.floor(torch.randn(1 << 20))
    n0 = _tasks()
    x = torch.randn(1024, 2048)
    with capture.start(spec_text(), tmp_path) as s:
        torch.ops.fxquant.capture(x, tap())
        s.writer.wait_idle()
        gained = len(_tasks() - n0)
    assert gained == 1
    (rec,) = list(capture.open(tmp_path))
    assert rec.stats["max"] == x.max().item()
