"""Streaming map/reduce over a plan: workers summarise tensors, the parent merges summaries in plan order.

``run(plan, config, workers)`` with ``workers == 1`` works in this process; with ``workers > 1`` it
starts that many worker processes (``forkserver``: a clean interpreter, safe however much torch the
parent has run), each with one intra-op thread; until the first is up (the forkserver imports torch), the
parent summarises tasks from the back of the plan itself. At most ``2 * workers`` tasks are in the pool, and a
finished task's summaries are merged as soon as every earlier task has been merged, so results do not
depend on the number of workers and memory stays bounded (summaries are small sparse histograms). Each worker opens a
capture directory once (manifests only) and reads tensors through ``fxquant.capture``'s reader, which
memory-maps safetensors shards and never unpickles anything.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from fxquant.analysis.plan import Plan, Task, sources
from fxquant.analysis.summary import AnalysisConfig, RecordSummary, summarize
from fxquant.capture.reader import CaptureReadError, CaptureSet, Record, open_capture

log = logging.getLogger(__name__)


@dataclass
class TaskResult:
    number: int
    pid: int
    summaries: list[RecordSummary]
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    nbytes: int = 0


class _Sets:
    """Capture sets opened by this process, one per directory."""

    def __init__(self) -> None:
        self.sets: dict[str, CaptureSet] = {}

    def get(self, root: str) -> CaptureSet:
        cs = self.sets.get(root)
        if cs is None:
            cs = self.sets[root] = open_capture(root)
        return cs


_WORKER_SETS = _Sets()


def _init_worker(started) -> None:
    """One intra-op thread per worker; tell the parent (``started``), which works on tasks itself until then."""
    torch.set_num_threads(1)
    started.set()


def run_task(task: Task, config: AnalysisConfig, sets: _Sets | None = None) -> TaskResult:
    """Summarise every record of ``task`` (called in a worker process, or in-process for one worker)."""
    sets = sets or _WORKER_SETS
    t0 = time.perf_counter()
    out = TaskResult(task.number, os.getpid(), [])
    opened: set[str] = set()
    for unit in task.units:
        tensors: dict[int, torch.Tensor | None] = {}
        for item in unit:
            if item.fields.get("key") is None:
                tensors[item.index] = None
                continue
            try:
                cs = sets.get(item.root)
                opened.add(item.root)
                rec = Record(item.fields, Path(item.rank_dir))  # rec.path refuses files outside the rank dir
                tensors[item.index] = cs.load(rec)
                out.nbytes += item.nbytes
            except (CaptureReadError, OSError, ValueError) as exc:
                out.problems.append(f"{item.rank_dir}: record seq={item.fields.get('seq')}: {exc}")
                tensors[item.index] = False  # unreadable: skipped, not summarised
        source = sources(unit)  # quantized record -> its own call's high-precision record
        done: dict[int, RecordSummary] = {}
        for item in sorted(unit, key=lambda i: i.fields.get("copy", "hp") == "quantized"):  # hp first
            t = tensors[item.index]
            if t is False:
                continue
            src = source.get(item.index)
            partner = tensors.get(src.index) if src is not None else None
            partner = partner if isinstance(partner, torch.Tensor) else None
            try:
                s = summarize(item.index, item.fields, t, config, partner=partner, seed=item.seed,
                              partner_summary=done.get(src.index) if partner is not None else None)
                if t is not None:
                    done[item.index] = s
                if not item.partner:  # a source kept only for its quantized copy is not among the selected
                    out.summaries.append(s)
            except (ValueError, TypeError, RuntimeError, AttributeError, KeyError) as exc:  # a malformed record
                out.problems.append(f"{item.rank_dir}: record seq={item.fields.get('seq')}: cannot summarise: {exc}")
        tensors.clear()
    for root in opened:
        sets.get(root).close()  # drop the shard memory maps between tasks
    out.seconds = time.perf_counter() - t0
    return out


def worker_pool(workers: int) -> cf.ProcessPoolExecutor | None:
    """The report's process pool (None for one worker): ``workers`` processes forked from a forkserver that
    has imported torch and the host kernels, each with one intra-op thread. The same pool
    summarises tensors (``run``) and then runs the report jobs that draw the figures (``outputs.run_jobs``)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r}: must be an int >= 1")
    if workers == 1:
        return None
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "fxquant.analysis._worker_preload"])
    started = ctx.Event()
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                                  initargs=(started,))
    pool.fxquant_started = started  # set once the workers are up (see _stream)
    # The executor starts a worker per submit while none is idle, and the first one blocks until the forkserver
    # has imported everything: submit one short task per worker from a thread, so that every worker starts
    # and this process can work meanwhile (_stream).
    threading.Thread(target=lambda: [pool.submit(time.sleep, 0.01) for _ in range(workers)],
                     name="fxquant-pool-start", daemon=True).start()
    return pool


def run(plan: Plan, config: AnalysisConfig, workers: int, merge: Callable[[TaskResult], None],
        progress: bool | str = True, pool: cf.ProcessPoolExecutor | None = None) -> list[int]:
    """Run every task, calling ``merge`` on results in task order; returns the PIDs that did the work.
    ``progress``: a tqdm bar on stderr (a string: its label, default "fxquant report"), or none.
    With ``workers > 1`` the tasks run in ``pool`` (``worker_pool(workers)``; one is made and shut down
    here when not given)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r}: must be an int >= 1")
    bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, desc=progress if isinstance(progress, str) else "fxquant report", disable=not progress,
               leave=False, dynamic_ncols=True)
    pids: list[int] = []

    def done(res: TaskResult) -> None:
        pids.append(res.pid)
        merge(res)
        bar.update(sum(i.nbytes for u in plan.tasks[res.number].units for i in u))

    try:
        if workers == 1 or len(plan.tasks) <= 1:
            sets = _Sets()
            for cs_root, cs in plan.sets.items():
                sets.sets[cs_root] = cs
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # bincount and int16 ops run several times slower with 2 threads here
            try:
                for task in plan.tasks:
                    done(run_task(task, config, sets))
            finally:
                torch.set_num_threads(threads)
            return pids
        own = pool is None
        pool = pool or worker_pool(workers)
        local = _Sets()
        for cs_root, cs in plan.sets.items():
            local.sets[cs_root] = cs
        try:
            _stream(plan, config, pool, 2 * workers, done, local)
        finally:
            if own:
                pool.shutdown()
        return pids
    finally:
        bar.close()


def _stream(plan: Plan, config: AnalysisConfig, pool: cf.ProcessPoolExecutor, in_flight: int,
            done: Callable[[TaskResult], None], local: _Sets) -> None:
    """Submit tasks from the front, keeping at most ``in_flight`` in the pool; merge results in task order.
    Until the pool's workers are up (seconds: a forkserver imports torch and loads the numba kernels), this
    process summarises tasks itself, from the back, so the start-up is not idle time."""
    tasks = plan.tasks
    started = getattr(pool, "fxquant_started", None)
    pending: dict[int, cf.Future] = {}
    ready: dict[int, TaskResult] = {}
    lo, hi = 0, len(tasks)  # tasks not yet claimed: [lo, hi)
    next_merge = 0
    while next_merge < len(tasks):
        up = started is None or started.is_set()
        while up and lo < hi and len(pending) < in_flight:
            pending[lo] = pool.submit(run_task, tasks[lo], config)
            lo += 1
        if lo < hi and not up:
            hi -= 1
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                ready[hi] = run_task(tasks[hi], config, local)
            finally:
                torch.set_num_threads(threads)
            log.debug("task %d summarised in this process while the workers start (%.2f s)", hi, ready[hi].seconds)
        elif pending:
            finished, _ = cf.wait(list(pending.values()), return_when=cf.FIRST_COMPLETED)
            for number in [n for n, f in pending.items() if f in finished]:
                ready[number] = pending.pop(number).result()
        while next_merge in ready:
            done(ready.pop(next_merge))
            next_merge += 1
