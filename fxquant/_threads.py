"""Background threads that run torch ops without slowing the training thread's parallel ops.

libgomp (the OpenMP runtime of torch's CPU builds) gives every OS thread that enters a parallel region its own
team of workers. Once a background thread has run one multi-threaded torch op, the process holds more OpenMP
workers than CPUs, and libgomp then shortens the spin-wait of *every* team's idle workers to almost nothing:
the training thread's workers go to sleep between parallel regions and each small parallel op pays a futex
wake-up. On the 2-core CPU box that makes a loop of three small parallel ops about 4x slower in the training
thread once the capture writer thread has computed statistics with the default thread count
(``tests/test_threads.py`` checks the mechanism).

``start_daemon`` runs its target with one intra-op thread (``torch.set_num_threads(1)`` in that thread: an
OpenMP setting of the calling thread), then restores the process-wide default that call also changed, so
threads started later still get the usual count. Background work is meant to use the idle core, not both.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def _openmp() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def start_daemon(target: Callable[[], None], *, name: str) -> threading.Thread:
    """Start ``target`` in a daemon thread whose torch ops use one intra-op thread; returns the started thread."""
    if not _openmp():  # the native backend shares one pool (and refuses set_num_threads once it has run)
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread
    default = torch.get_num_threads()
    configured = threading.Event()

    def run() -> None:
        try:
            torch.get_num_threads()  # the thread's lazy OpenMP set-up first: it would later re-apply the default
            torch.set_num_threads(1)
        finally:
            configured.set()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    configured.wait()
    torch.set_num_threads(default)  # the process default, which the thread's call also set
    return thread


__all__ = ["start_daemon"]
