"""The ``fxquant::capture`` op and the capture session it reports to (issue 4, deliverables 2-3).

``fxquant::capture(Tensor x, str tap, Tensor? reference=None) -> ()`` is registered at import and
made *effectful* (ORDERED), so AOT autograd and Inductor keep it although it returns nothing
(ARCHITECTURE.md trap 3). Inside its window it copies ``x`` before returning (trap 4: Inductor may
reuse the buffer right after): on CUDA into pinned host memory with a non-blocking copy and an event,
on CPU with a clone. The window (iteration, micro-batch, rank) is checked at run time inside the op,
so a spec outside its window costs a dictionary lookup per tap and never causes a recompile.

``capture_grad(x, tap)`` is the identity in forward whose backward captures the incoming gradient:
the tap-insertion pass wraps a node with it to capture that node's gradient in the backward graph.

One ``CaptureSession`` is active per process (``start`` / ``stop`` or ``with session:``). The
training loop advances its counters: ``set_iteration``, ``set_micro_batch`` / ``next_micro_batch``.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fxquant.capture import layout
from fxquant.capture.spec import CaptureSpec, Component, Copy, ErrorPolicy, SamplingMode, Section, What
from fxquant.capture.stats import pack_quantized_stats, pack_tensor_stats
from fxquant.capture.tap import Tap, decode_tap
from fxquant.capture.writer import Item, ShardWriter
from fxquant.ops import parse_qspec

log = logging.getLogger(__name__)


class CaptureError(RuntimeError):
    """Capture failed under ``on_error: abort`` (the original OSError is the ``__cause__``)."""


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job; dp defaults to the global rank/world when not given."""

    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int | None = None
    dp_size: int | None = None
    layer_offset: int = 0  # this stage's first global layer, recorded in run info (taps carry global layers)

    @classmethod
    def detect(cls) -> "RankInfo":
        """From torch.distributed when initialised, else RANK / WORLD_SIZE, else a single process."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return cls(torch.distributed.get_rank(), torch.distributed.get_world_size())
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))

    def coords(self) -> dict:
        return {
            "rank": self.rank, "world_size": self.world_size, "tp_rank": self.tp_rank, "tp_size": self.tp_size,
            "pp_rank": self.pp_rank, "pp_size": self.pp_size,
            "dp_rank": self.rank if self.dp_rank is None else self.dp_rank,
            "dp_size": self.world_size if self.dp_size is None else self.dp_size,
        }


def default_run_id() -> str:
    """Shared by all ranks of a torchrun job (TORCHELASTIC_RUN_ID), else time + random."""
    return os.environ.get("FXQUANT_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or (
        time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    )


@dataclass(frozen=True)
class SessionConfig:
    root: Path
    run_id: str = field(default_factory=default_run_id)
    scheme: str = "unknown"
    rank: RankInfo = field(default_factory=RankInfo.detect)
    start_iteration: int = 0
    shard_bytes: int = 256 << 20
    queue_items: int = 256
    queue_bytes: int = 2 << 30
    flush_seconds: float = 30.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        for name in ("shard_bytes", "queue_items", "queue_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}={v!r}: must be a positive integer")


@functools.lru_cache(maxsize=64)
def _sample_rows(rows: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(rows, generator=g)[:n].sort().values


def _sample(x: torch.Tensor, section: Section) -> tuple[torch.Tensor, dict | None]:
    s = section.sampling
    if s is None:
        return x, None
    x2 = x.reshape(1, -1) if x.dim() < 2 else x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    info = {"mode": s.mode.value, "rows": min(s.rows, rows), "of_rows": rows}
    if s.mode is SamplingMode.FIRST_ROWS:
        return x2[: s.rows], info
    info["seed"] = s.seed
    idx = _sample_rows(rows, s.rows, s.seed).to(x2.device)
    return x2.index_select(0, idx), info


def _requantize(x: torch.Tensor, tap: Tap) -> tuple[torch.Tensor, torch.Tensor]:
    """(the operand as the GEMM consumed it, its high-precision source): fxquant::quantize with the GEMM's
    format and blocked dim, linear operands in the [M, K] view the GEMMs use. Deterministic roundings
    reproduce the GEMM's bits exactly (the tap pass never asks for stochastic ones)."""
    x = x.detach()
    if tap.component is Component.LINEAR:
        x = x.reshape(-1, x.shape[-1])
    return torch.ops.fxquant.quantize(x, tap.qspec, tap.dim, None), x


class CaptureSession:
    """Counters, window checks, budget, and the writer of one process's capture."""

    def __init__(self, spec: CaptureSpec, config: SessionConfig):
        if not isinstance(spec, CaptureSpec):
            raise TypeError(f"spec must be a CaptureSpec (fxquant.capture.load_spec), got {type(spec).__name__}")
        self.spec, self.config = spec, config
        self.dir = layout.rank_dir(config.root, config.rank.rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        info = {"format_version": layout.FORMAT_VERSION, "run_id": config.run_id, "scheme": config.scheme,
                "spec_name": spec.name, "spec_source": spec.source, "spec_text": spec.text,
                "started": time.time(), **config.rank.coords(), "layer_offset": config.rank.layer_offset}
        layout.write_json_atomic(self.dir / layout.RUN_INFO, info)
        self.writer = ShardWriter(self.dir, shard_bytes=config.shard_bytes, queue_items=config.queue_items,
                                  queue_bytes=config.queue_bytes, flush_seconds=config.flush_seconds,
                                  max_files=spec.budget.files,
                                  shard_metadata={"run_id": config.run_id, "rank": str(config.rank.rank)})
        self._lock = threading.Lock()  # backward taps may run on autograd's device threads
        self._base = {"run_id": config.run_id, "scheme": config.scheme, **config.rank.coords()}
        self.iteration, self.micro_batch = config.start_iteration, 0
        self.seq = self.reserved_bytes = 0
        self.stop_reason: str | None = None
        self._raised = False
        self._closed = False
        self._refresh()

    # -- counters ------------------------------------------------------------------------------------
    def set_iteration(self, iteration: int) -> None:
        self.iteration, self.micro_batch = int(iteration), 0
        self._refresh()

    def next_iteration(self) -> None:
        self.set_iteration(self.iteration + 1)

    def set_micro_batch(self, micro_batch: int) -> None:
        self.micro_batch = int(micro_batch)
        self._refresh()

    def next_micro_batch(self) -> None:
        self.set_micro_batch(self.micro_batch + 1)

    def _refresh(self) -> None:
        r = self.config.rank.rank
        self._active = frozenset(
            i for i, s in enumerate(self.spec.sections) if s.when.contains(self.iteration, self.micro_batch, r)
        )

    @property
    def active(self) -> bool:
        """True when some section's window contains the current iteration / micro-batch / rank."""
        return bool(self._active) and self.stop_reason is None

    # -- the op's body -------------------------------------------------------------------------------
    def capture(self, x: torch.Tensor, tap_text: str, reference: torch.Tensor | None = None) -> None:
        if self.writer.stopped:
            self._writer_stopped()
        if not self._active or self.stop_reason is not None:
            return
        tap = decode_tap(tap_text)
        live = [i for i in tap.sections if i in self._active]
        if not live:
            return
        if tap.copy is Copy.QUANTIZED and reference is None:
            x, reference = _requantize(x, tap)
        sections = [self.spec.sections[i] for i in live]
        store = next((s for s in sections if s.what.tensors), None)
        want_stats = any(s.what.stats for s in sections)
        payload, sample = _sample(x.detach(), store) if store is not None else (None, None)
        nbytes = 0 if payload is None else payload.numel() * payload.element_size()
        with self._lock:
            if not self._reserve(nbytes):
                return
            seq = self.seq
            self.seq += 1
        vec = None
        quantized = tap.copy is Copy.QUANTIZED and reference is not None
        if want_stats:
            vec = pack_tensor_stats(x)
            if quantized:
                vec = torch.cat([vec, pack_quantized_stats(x, reference, parse_qspec(tap.qspec), tap.dim)])
        host, host_stats, event = self._to_host(payload, vec)
        record = self._record(tap, x, payload, seq, sample, sections[0].name)
        self.writer.put(Item(record, host, host_stats, quantized, event, nbytes))

    def _reserve(self, nbytes: int) -> bool:
        b = self.spec.budget
        if b.bytes is not None and self.reserved_bytes + nbytes > b.bytes:
            self._stop(f"budget.bytes={b.bytes} reached ({self.reserved_bytes} bytes captured)")
            return False
        if b.tensors is not None and self.seq >= b.tensors:
            self._stop(f"budget.tensors={b.tensors} reached")
            return False
        self.reserved_bytes += nbytes
        return True

    @staticmethod
    def _to_host(payload: torch.Tensor | None, vec: torch.Tensor | None):
        """Private host copies; on CUDA non-blocking into pinned memory, with one event after both."""
        cuda = (payload is not None and payload.is_cuda) or (vec is not None and vec.is_cuda)
        if not cuda:  # a private copy: the caller's buffer may be reused as soon as the op returns
            host = None if payload is None else payload.clone(memory_format=torch.contiguous_format)
            return host, vec, None
        out = []
        for t in (payload, vec):
            if t is None:
                out.append(None)
                continue
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            out.append(h)
        event = torch.cuda.Event()
        event.record()
        return out[0], out[1], event

    def _record(self, tap: Tap, x: torch.Tensor, payload, seq: int, sample: dict | None, section: str) -> dict:
        fmt = None if tap.qspec is None else tap.qspec.split(":", 1)[0]
        return {
            **self._base, "format": fmt, "qspec": tap.qspec, "component": tap.component.value,
            "module": tap.module, "kind": None if tap.kind is None else tap.kind.value, "layer": tap.layer,
            "role": tap.role.value, "copy": tap.copy.value, "gemm": None if tap.gemm is None else tap.gemm.value,
            "phase": tap.phase.value, "direction": tap.direction.value, "iteration": self.iteration,
            "micro_batch": self.micro_batch, "seq": seq, "section": section, "shard_dim": tap.shard_dim,
            "blocked_dim": tap.dim, "shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", ""),
            "stored_shape": None if payload is None else list(payload.shape), "sample": sample,
            "key": None if payload is None else layout.tensor_key(seq), "file": None, "checksum": None,
            "time": time.time(),
        }

    # -- stopping ------------------------------------------------------------------------------------
    def _stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            log.warning("capture stopped on rank %d: %s; training goes on", self.config.rank.rank, reason)

    def _writer_stopped(self) -> None:
        st = self.writer.state
        if st.error is None:
            self._stop(st.budget_reason or "writer stopped")
            return
        self._stop(st.error_reason or str(st.error))
        if self.spec.on_error is ErrorPolicy.ABORT and not self._raised:
            self._raised = True
            raise CaptureError(f"capture failed (on_error: abort): {st.error_reason}") from st.error

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> dict:
        """Drain the writer and write the commit marker; returns the summary. Idempotent."""
        if _STATE.session is self:
            _STATE.session = None
        if self._closed:
            return self.summary
        self._closed = True
        st = self.writer.close()
        if st.error is not None or st.budget_reason is not None:
            self._stop(st.error_reason or st.budget_reason)
        self.summary = {"run_id": self.config.run_id, "records": st.records, "shards": st.shards, "bytes": st.bytes,
                        "dropped": st.dropped, "stop_reason": self.stop_reason, "error": st.error_reason,
                        "closed": time.time(), "clean": st.error is None}
        try:
            layout.write_json_atomic(self.dir / layout.COMMITTED, self.summary)
        except OSError as exc:
            log.error("could not write the commit marker in %s: %s", self.dir, exc)
        if st.error is not None and self.spec.on_error is ErrorPolicy.ABORT and not self._raised:
            self._raised = True
            raise CaptureError(f"capture failed (on_error: abort): {st.error_reason}") from st.error
        return self.summary

    def __enter__(self) -> "CaptureSession":
        activate(self)
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _State:
    session: CaptureSession | None = None


_STATE = _State()


def activate(session: CaptureSession) -> None:
    if _STATE.session is not None and _STATE.session is not session:
        raise RuntimeError("another capture session is active; close it first")
    _STATE.session = session


def active_session() -> CaptureSession | None:
    return _STATE.session


def start(spec: CaptureSpec, root: str | Path, **config) -> CaptureSession:
    """Create a session writing under ``root`` and make it the active one."""
    session = CaptureSession(spec, SessionConfig(Path(root), **config))
    activate(session)
    return session


# -- the op ------------------------------------------------------------------------------------------
@torch.library.custom_op("fxquant::capture", mutates_args=())
def capture(x: torch.Tensor, tap: str, reference: torch.Tensor | None = None) -> None:
    session = _STATE.session
    if session is not None:
        session.capture(x, tap, reference)


@capture.register_fake
def _capture_fake(x: torch.Tensor, tap: str, reference: torch.Tensor | None = None) -> None:
    return None


def _register_effect() -> None:
    try:
        from torch._library.effects import EffectType

        torch.library._register_effectful_op("fxquant::capture", EffectType.ORDERED)
    except (ImportError, AttributeError):  # older torch: the private helper in effects.py
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        _register_effectful_op(torch.ops.fxquant.capture.default, _EffectType.ORDERED)


_register_effect()


class _GradTap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, taps: tuple) -> torch.Tensor:
        ctx.taps = taps
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        for tap in ctx.taps:
            torch.ops.fxquant.capture(grad, tap)
        return grad, None


def capture_grad(x: torch.Tensor, taps: tuple) -> torch.Tensor:
    """Identity whose backward captures the gradient arriving at ``x`` once per tap string in ``taps``
    (a module-level wrapper the tap pass inserts, ARCHITECTURE.md trap 1)."""
    return _GradTap.apply(x, tuple(taps))


def capture_operand(q: torch.Tensor, hp: torch.Tensor, tap: str) -> None:
    """For quantized-GEMM functions: capture operand ``q`` as the GEMM consumed it, with ``hp`` its source."""
    torch.ops.fxquant.capture(q, tap, hp)



__all__ = ["CaptureError", "CaptureSession", "RankInfo", "SessionConfig", "activate", "active_session",
           "capture", "capture_grad", "capture_operand", "start"]
