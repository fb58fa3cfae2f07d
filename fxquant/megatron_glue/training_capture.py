"""Tensor capture during training: one `fxquant.capture` session per rank, driven by the schedule.

`TrainingCapture.open(run, info, model, start_iteration)` loads the run's spec (`CaptureConfig`; the
predecessor's `--control-iter` window applied through `fxquant.capture.compat`), and starts the rank's
session under the capture root with the run's scheme, a run id shared by all ranks (rank 0's, broadcast)
and the rank's Megatron coordinates (`RankInfo`: TP/PP/DP ranks and sizes, the pipeline stage's layer
offset). The training loop then calls:

- `begin_iteration(i)` before each iteration's schedule (0-based, the numbering of spec windows);
- `forward(run_forward)` inside `forward_step_func`: the session's micro-batch is set to the index of this
  forward (forwards run in micro-batch order in every schedule used here), and a gradient hook on the
  model's output sets it back to that index when the output's gradient arrives, i.e. before anything of
  the model's backward for that micro-batch runs (the output depends on all of it; the hook also fires
  when the output is the root of `backward_step`'s `torch.autograd.backward` on a non-last pipeline
  stage). The backward of micro-batch i therefore writes under micro-batch i whatever order the schedule
  runs backwards in (GPipe on the host schedule: all forwards, then backwards in reverse order; Megatron's
  1F1B: warm-up forwards, then alternating; no pipelining: forward then backward each). The output
  tensor itself is untouched (no view, so Megatron's `deallocate_output_tensor` still applies);
- `paused()` around validation: the session sits at iteration -1, outside every window (spec iterations
  are >= 0), so evaluation forwards capture nothing;
- `close()` at the end and on error or interrupt: drains the writer (every shard is written to a temporary
  name, fsync'ed and renamed, so no half-written shard sits under a final name; manifest lines are appended
  and fsync'ed, and the reader skips a torn last line) and writes the rank's commit marker; returns the
  summary (records, bytes, stop reason), logged.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from fxquant.megatron_glue.parallel import ParallelInfo
from fxquant.megatron_glue.run_config import CaptureConfig, RunConfig

log = logging.getLogger(__name__)

PAUSED_ITERATION = -1  # outside every spec window (iterations are validated >= 0)


def resolve_spec(config: CaptureConfig, start_iteration: int):
    """The CaptureSpec a run uses: `config.spec` loaded, with the predecessor's iteration window when
    `config.iterations` is set (every micro-batch of iterations [start, start + N); N = 0: all; only
    micro-batches [0, M) with `config.micro_batches`)."""
    from fxquant.capture import compat, load_spec
    from fxquant.capture.spec import Span

    spec = load_spec(config.spec)
    if config.iterations is None:
        return spec
    spec, _ = compat.from_predecessor(True, None, config.iterations, start_iteration=start_iteration, spec=spec,
                                      env={})
    if config.micro_batches is None:
        return spec
    first = Span(0, config.micro_batches)
    return dataclasses.replace(spec, sections=tuple(
        dataclasses.replace(s, when=dataclasses.replace(s.when, micro_batches=first)) for s in spec.sections))


def shared_run_id(info: ParallelInfo) -> str:
    """One run id for every rank of the job: rank 0's `fxquant.capture.runtime.default_run_id()`."""
    from fxquant.capture.runtime import default_run_id

    box = [default_run_id() if info.rank == 0 else None]
    if info.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def rank_info(info: ParallelInfo, layer_offset: int):
    from fxquant.capture import RankInfo

    return RankInfo(rank=info.rank, world_size=info.world_size, tp_rank=info.tp_rank, tp_size=info.tp_size,
                    pp_rank=info.pp_rank, pp_size=info.pp_size, dp_rank=info.dp_rank, dp_size=info.dp_size,
                    layer_offset=layer_offset)


def stale_rank_dirs(root: Path, info: ParallelInfo) -> list[Path]:
    """The rank directories under ``root`` that this process removes when a run starts at iteration 0: its own,
    and on rank 0 those of ranks this run does not have (an earlier run with more processes), which no process of
    this run writes."""
    from fxquant.capture import layout

    own = [layout.rank_dir(root, info.rank)]
    if info.rank == 0 and root.is_dir():
        own += [d for d in sorted(root.glob("rank-*")) if d.is_dir() and d.name[5:].isdigit()
                and int(d.name[5:]) >= info.world_size]
    return [d for d in own if d.exists()]


class TrainingCapture:
    """The capture session of one training process and the schedule's hooks into it (module docstring)."""

    def __init__(self, session, spec, root: Path) -> None:
        self.session, self.spec, self.root = session, spec, root
        self.iteration = PAUSED_ITERATION
        self._next_micro_batch = 0
        self.summary: dict | None = None

    @classmethod
    def open(cls, run: RunConfig, info: ParallelInfo, layer_offset: int, start_iteration: int) -> "TrainingCapture":
        from fxquant import capture
        from fxquant.capture import layout

        config = run.capture
        spec = resolve_spec(config, start_iteration)
        root = config.root(run.output_dir)
        if start_iteration == 0:  # a fresh run replaces its captures, as it does its metrics
            for stale in stale_rank_dirs(root, info):
                log.warning("capture: run starts at iteration 0; removing the earlier run's captures in %s", stale)
                aside = stale.with_name(f".removing-{stale.name}-{os.getpid()}")  # not a rank-* name: no reader's
                with layout.lock_rank_dir(stale):  # refused (RankDirBusy) while another session writes it
                    stale.rename(aside)  # atomic: a session starting now makes a new directory and LOCK
                shutil.rmtree(aside)
        else:  # a resumed run trains (and captures) again the iterations after its checkpoint, as its metrics say
            own = layout.rank_dir(root, info.rank)
            if own.is_dir():
                with layout.lock_rank_dir(own):
                    moved = layout.supersede_from(own, start_iteration)
                if moved:
                    log.warning("capture: resumed at iteration %d; %d earlier record(s) of iterations from %d on "
                                "moved to %s (they are captured again)", start_iteration, moved, start_iteration,
                                own / layout.SUPERSEDED)
        session = capture.start(spec, root, scheme=run.scheme, run_id=shared_run_id(info),
                                rank=rank_info(info, layer_offset), start_iteration=start_iteration)
        log.info("capture: spec %r -> %s (rank %d, run id %s)", spec.name, session.dir, info.rank,
                 session.config.run_id)
        return cls(session, spec, root)

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self._next_micro_batch = 0
        self.session.set_iteration(iteration)

    def forward(self, run_forward):
        """`run_forward()` under the next micro-batch index; its output marked for the backward (see above)."""
        micro_batch = self._next_micro_batch
        self._next_micro_batch += 1
        self.session.set_micro_batch(micro_batch)
        output = run_forward()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            session = self.session

            def backward_starts(grad: torch.Tensor) -> None:
                session.set_micro_batch(micro_batch)

            output.register_hook(backward_starts)
        return output

    @contextlib.contextmanager
    def paused(self):
        """Nothing is captured inside (validation); the iteration and micro-batch counters are restored."""
        iteration, micro_batch, upcoming = self.iteration, self.session.micro_batch, self._next_micro_batch
        self.session.set_iteration(PAUSED_ITERATION)
        try:
            yield
        finally:
            self.session.set_iteration(iteration)
            self.session.set_micro_batch(micro_batch)
            self._next_micro_batch = upcoming

    def close(self, failing: bool = False) -> dict:
        """Drain and commit (idempotent); logs and returns the session summary. `failing`: the run is already
        raising, so a capture failure (`on_error: abort`) is logged instead of replacing that exception."""
        from fxquant.capture import CaptureError

        if self.summary is None:
            try:
                summary = self.session.close()
            except CaptureError as exc:
                if not failing:
                    raise
                log.error("capture failed while the run was failing: %s", exc)
                summary = self.session.summary
            self.summary = dict(summary, dir=str(self.session.dir), rank=self.session.config.rank.rank)
            log.info("%s", describe(self.summary))
        return self.summary


def describe(summary: dict) -> str:
    """One line per rank: records, bytes, shards, where, why capture stopped early if it did, and how many selected
    points the compiled graphs did not offer."""
    line = (f"capture rank {summary['rank']}: {summary['records']} records, {summary['bytes'] / 1e6:.2f} MB in "
            f"{summary['shards']} shard(s) -> {summary['dir']}")
    if summary.get("stop_reason"):
        line += f" (stopped: {summary['stop_reason']})"
    if summary.get("error"):
        line += f" (error: {summary['error']})"
    if summary.get("uncapturable"):
        line += (f"; {summary['uncapturable']} selected point(s) not in the compiled graphs (quantized copies of "
                 "operands kept in high precision, or what the log's 'cannot be captured' warnings name)")
    return line
