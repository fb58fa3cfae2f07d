"""The ``fxquant::capture`` op and the capture session it reports to (issue 4, deliverables 2-3).

``fxquant::capture(Tensor x, str tap, Tensor? reference=None) -> ()`` is registered at import and
made *effectful* (ORDERED), so AOT autograd and Inductor keep it although it returns nothing
(ARCHITECTURE.md trap 3). ``tap`` carries every tap of ``x`` (tap.encode_taps): one call per tapped
tensor, and taps that would store the same thing share one stored copy and get one record each.
The window (iteration, micro-batch, rank) is checked at run time inside the op, so a spec outside its
window costs one dispatcher call per tapped tensor and never causes a recompile.

Inside its window the op copies ``x`` before returning (trap 4: Inductor may reuse the buffer right
after). On CUDA it queues the tensor work (re-quantization, sampling, statistics: prepare.py) on the
device and non-blocking copies into pinned host memory followed by one event: no device sync. On CPU it
copies ``x`` into a pooled host buffer (hostpool.py) and leaves the tensor work to the writer thread, so
the training thread pays for one memcpy per tensor.

``capture_grad(x, taps)`` is the identity in forward whose backward captures the incoming gradient:
the tap-insertion pass wraps a node with it to capture that node's gradient in the backward graph.

One ``CaptureSession`` is active per process (``start`` / ``stop`` or ``with session:``). The
training loop advances its counters: ``set_iteration``, ``set_micro_batch`` / ``next_micro_batch``.
"""
from __future__ import annotations

import atexit
import contextlib
import enum
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fxquant._fileio import fsync_dir
from fxquant.capture import layout
from fxquant.capture.hostpool import HostPool
from fxquant.capture.layout import RankDirBusy
from fxquant.capture.prepare import Work
from fxquant.capture.spec import CaptureSpec, Component, Copy, ErrorPolicy
from fxquant.capture.tap import Tap, decode_tap, decode_taps, encode_taps
from fxquant.capture.writer import Item, ShardWriter
from fxquant.kernels import host

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


class CaptureSession:
    """Counters, window checks, budget, and the writer of one process's capture."""

    def __init__(self, spec: CaptureSpec, config: SessionConfig):
        if not isinstance(spec, CaptureSpec):
            raise TypeError(f"spec must be a CaptureSpec (fxquant.capture.load_spec), got {type(spec).__name__}")
        self.spec, self.config = spec, config
        self.dir = layout.rank_dir(config.root, config.rank.rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._dir_lock = layout.lock_rank_dir(self.dir)  # held until close: one session per rank directory
        try:
            self._open(spec, config)
        except BaseException:
            self._dir_lock.release()
            raise

    def _open(self, spec: CaptureSpec, config: SessionConfig) -> None:
        shards_before, seq_before = layout.resume_point(self.dir)  # an earlier session's shards and keys stay
        if (self.dir / layout.COMMITTED).exists():  # an earlier session's: this one appends, uncommitted until close
            log.info("capture: %s holds an earlier session's records; appending (uncommitted until close)", self.dir)
            (self.dir / layout.COMMITTED).unlink()
            fsync_dir(self.dir)
        info = {"format_version": layout.FORMAT_VERSION, "run_id": config.run_id, "scheme": config.scheme,
                "spec_name": spec.name, "spec_source": spec.source, "spec_text": spec.text,
                "started": time.time(), **config.rank.coords(), "layer_offset": config.rank.layer_offset}
        layout.write_json_atomic(self.dir / layout.RUN_INFO, info)
        self.writer = ShardWriter(self.dir, shard_bytes=config.shard_bytes, queue_items=config.queue_items,
                                  queue_bytes=config.queue_bytes, flush_seconds=config.flush_seconds,
                                  max_files=spec.budget.files,
                                  shard_metadata={"run_id": config.run_id, "rank": str(config.rank.rank)},
                                  first_shard=shards_before)
        self.pool = HostPool(max_free_bytes=min(config.queue_bytes + config.shard_bytes, 4 << 30))
        self._lock = threading.Lock()  # backward taps may run on autograd's device threads
        self._base = {"run_id": config.run_id, "scheme": config.scheme, **config.rank.coords()}
        self.iteration, self.micro_batch = config.start_iteration, 0
        self.seq, self.reserved_bytes = seq_before, 0
        self._first_seq = seq_before  # budget.tensors counts the records from this seq on
        self._placement = spec.placement_digest()  # what the taps of graphs compiled with this spec carry
        self.stop_reason: str | None = None
        self._error: str | None = None  # the first failure of the op's own tensor work or the writer (``_failed``)
        self._warned: set[tuple[str, str]] = set()
        self._raised = False
        self._closed = False
        self._sigterm: _SigtermExit | None = None  # installed by start() where SIGTERM had no handler
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
        active = frozenset(
            i for i, s in enumerate(self.spec.sections) if s.when.contains(self.iteration, self.micro_batch, r)
        )
        if active != getattr(self, "_active", None):
            self._active, self._plans = active, {}
            if not active and hasattr(self, "pool"):  # out of the window: give the copies' memory back
                self.pool.clear()

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
        key = (tap_text, reference is None)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(decode_taps(tap_text), reference is None)
        x = x.detach()
        try:
            with _shared_copies() as shared:  # one private copy of x (and of reference) for every work of this call
                tp = self.config.rank.tp_size
                for work, taps in plan:
                    ndim = len(work.shape(x))  # the recorded shape's (a re-quantized copy's: the GEMM's 2-D view)
                    if not self._emit(work, [(_tap_fields(tap, ndim, tp), section) for tap, section in taps], x,
                                      reference, shared):
                        return
        except Exception as exc:  # noqa: BLE001 - the op's own tensor work: stops capture per on_error, as the writer's
            self._op_failed(exc, tap_text)

    def _emit(self, work: Work, taps: list[tuple[dict, str]], x: torch.Tensor, reference: torch.Tensor | None,
              shared: dict) -> bool:
        """Reserve budget for ``work`` and hand it to the writer with one record per (tap fields, section);
        False when the budget stopped capture."""
        nbytes = work.nbytes(x)
        with self._lock:
            n = self._reserve(nbytes, len(taps))
            if not n:
                return False
            seq = self.seq
            self.seq += n
        records = [self._record(fields, work, x, seq + k, seq, section) for k, (fields, section) in enumerate(taps[:n])]
        if x.is_cuda:  # queue the kernels and the copies to pinned memory now; nothing waits for the device
            prep = work.run(x, reference)
            host, host_stats, event = self._to_host(prep.payload, prep.stats)
            self.writer.put(Item(records, host, host_stats, prep.quantized, event, nbytes))
        elif work.needs_source:  # CPU: a private copy now (trap 4), the tensor work in the writer thread
            held = 0
            source = shared.get("source")
            if source is None:  # held by this item and by the capture call until its loop ends
                source = shared["source"] = self.pool.copy(x).hold()
                held = x.numel() * x.element_size()
            else:
                source.hold()
            item_ref = None
            if reference is not None and work.stats:
                ref = shared.get("ref")
                if ref is None:
                    ref = shared["ref"] = self.pool.copy(reference.detach()).hold()
                    held += reference.numel() * reference.element_size()
                else:
                    ref.hold()
                item_ref = ref
            self.writer.put(Item(records, nbytes=held, work=work, source=source, reference=item_ref))
        else:  # CPU, sampled rows only: copy just those
            payload = work.sample(x)
            payload = payload.clone() if payload._base is not None or payload is x else payload
            self.writer.put(Item(records, payload, None, False, None, nbytes))
        return True

    def save(self, x: torch.Tensor, name: str, *, module: str = "user", layer: int | None = None,
             component: str = "user", direction: str = "forward", phase: str = "post") -> bool:
        """Store ``x`` (full tensor and statistics) as one record named ``name`` (its ``role``), with the
        session's iteration, micro-batch and rank coordinates, whatever the spec's windows; the budget
        applies. False when capture has stopped. ``fxquant.capture.save`` calls this on the active session."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype not in layout.ST_DTYPES:
            storable = [str(d).replace("torch.", "") for d in layout.ST_DTYPES if d.is_floating_point]
            raise TypeError(f"save: x must be a floating torch.Tensor of a dtype capture sets store ({storable}), got "
                            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        for arg, v in (("name", name), ("module", module), ("component", component)):
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"save: {arg} must be a non-empty string, got {v!r}")
        if direction not in ("forward", "backward") or phase not in ("pre", "post"):
            raise ValueError(f"save: direction={direction!r} / phase={phase!r}; allowed: forward|backward, pre|post")
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
            raise TypeError(f"save: layer must be an int or None, got {layer!r}")
        if self.writer.stopped:
            self._writer_stopped()
        if self.stop_reason is not None or self._closed:
            return False
        fields = {"format": None, "qspec": None, "component": component, "module": module, "kind": None,
                  "layer": layer, "role": name, "copy": "hp", "gemm": None, "phase": phase, "direction": direction,
                  "shard_dim": None, "blocked_dim": None}
        work = Work(store=True, stats=True, sampling=None, qspec=None, dim=None, flatten=False, requantize=False)
        with _shared_copies() as shared:
            return self._emit(work, [(fields, "user")], x.detach(), None, shared)

    def _plan(self, taps: tuple[Tap, ...], requantize: bool) -> list[tuple[Work, list[tuple[Tap, str]]]]:
        """The distinct tensor work for the live taps of one call, each with the (tap, section name)s it serves:
        taps that store the same thing (one tensor tapped at several sites) share one payload."""
        groups: dict[Work, list[tuple[Tap, str]]] = {}
        for tap in taps:
            if tap.placement is not None and tap.placement != self._placement:
                raise CaptureError(
                    f"the capture tap at {tap.module!r} ({tap.component.value}.{tap.role.value}) was compiled for another "
                    f"capture spec (placement {tap.placement}) than the one capture.start was given, "
                    f"{self.spec.name!r} ({self._placement}): its section indices would name other sections. "
                    f"Start the capture with the spec the model was compiled with, or compile the model with this one "
                    f"(fxquant.compile(..., capture=spec)); sections may differ in when/what/sampling only")
            sections = [self.spec.sections[i] for i in tap.sections if i in self._active]
            if not sections:
                continue
            store = self._storing_section(sections)
            quantized = tap.copy is Copy.QUANTIZED
            work = Work(store=store is not None, stats=any(s.what.stats for s in sections),
                        sampling=None if store is None else store.sampling,
                        qspec=tap.qspec if quantized else None, dim=tap.dim if quantized else None,
                        flatten=quantized and tap.component is Component.LINEAR, requantize=quantized and requantize)
            groups.setdefault(work, []).append((tap, (store or sections[0]).name))
        return list(groups.items())

    def _storing_section(self, sections: list) -> object | None:
        """The section whose stored tensor a tap selected by ``sections`` gets (None: statistics only): one asking
        for the whole tensor wins over sampled ones (its rows hold theirs); between different samplings, the first
        listed, with a warning naming both."""
        storing = [s for s in sections if s.what.tensors]
        if not storing:
            return None
        full = next((s for s in storing if s.sampling is None), None)
        if full is not None:
            return full
        for other in storing[1:]:
            if other.sampling != storing[0].sampling and (storing[0].name, other.name) not in self._warned:
                self._warned.add((storing[0].name, other.name))
                log.warning("capture: sections %r and %r both store a tensor, sampled differently; it is stored once, "
                            "sampled as %r asks", storing[0].name, other.name, storing[0].name)
        return storing[0]

    def _reserve(self, nbytes: int, records: int) -> int:
        """How many of ``records`` records (sharing one ``nbytes`` payload) the budget admits; 0 stops capture."""
        b = self.spec.budget
        if b.bytes is not None and self.reserved_bytes + nbytes > b.bytes:
            self._stop(f"budget.bytes={b.bytes} reached ({self.reserved_bytes} bytes captured)")
            return 0
        if b.tensors is not None:
            records = min(records, b.tensors - (self.seq - self._first_seq))
            if records <= 0:
                self._stop(f"budget.tensors={b.tensors} reached")
                return 0
        self.reserved_bytes += nbytes
        return records

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

    def _record(self, tap_fields: dict, work: Work, x: torch.Tensor, seq: int, key_seq: int, section: str) -> dict:
        return {
            **self._base, **tap_fields, "iteration": self.iteration, "micro_batch": self.micro_batch, "seq": seq,
            "section": section, "shape": work.shape(x), "dtype": str(x.dtype).replace("torch.", ""),
            "stored_shape": work.stored_shape(x), "sample": work.sample_info(x),
            "key": layout.tensor_key(key_seq) if work.store else None, "file": None, "checksum": None,
            "stats": None, "time": time.time(),
        }

    # -- stopping ------------------------------------------------------------------------------------
    def _stop(self, reason: str, *, aborting: bool = False) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            log.warning("capture stopped on rank %d: %s; %s", self.config.rank.rank, reason,
                        "raising CaptureError (on_error: abort)" if aborting else "training goes on")

    def _op_failed(self, exc: Exception, tap_text: str) -> None:
        """A capture call's own tensor work failed (sampling, or on CUDA the queued re-quantization and statistics):
        handled as a writer failure (``_failed``)."""
        taps = ", ".join(sorted({f"{t.module} {t.role.value}" for t in decode_taps(tap_text)}))
        self._failed(f"capture failed on {taps}: {type(exc).__name__}: {exc}", exc)

    def _writer_stopped(self) -> None:
        st = self.writer.state
        if st.error is None:
            self._stop(st.budget_reason or "writer stopped")
            return
        self._failed(st.error_reason or str(st.error), st.error)

    def _failed(self, reason: str, exc: BaseException) -> None:
        """Capture stops; under ``on_error: abort`` (once) the session closes and the training thread gets a
        CaptureError."""
        abort = self.spec.on_error is ErrorPolicy.ABORT and not self._raised
        if self._error is None:
            self._error = reason
        self._stop(reason, aborting=abort)
        if abort:
            self._raised = True
            self.close()  # the session ends here: its writer drained, the marker records the error, none active
            raise CaptureError(f"capture failed (on_error: abort): {reason}") from exc

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> dict:
        """Drain the writer and write the commit marker; returns the summary. Idempotent."""
        if _STATE.session is self:
            _STATE.session = None
        if self._closed:
            return self.summary
        self._closed = True
        atexit.unregister(self.close)
        if self._sigterm is not None:
            self._sigterm.state = _SigtermExit.State.CLOSING  # a SIGTERM now cannot cut the drain short
        try:
            st = self.writer.close()
            self.pool.clear()
            if st.error is not None or st.budget_reason is not None:
                self._stop(st.error_reason or st.budget_reason)
            self.summary = {"run_id": self.config.run_id, "records": st.records, "shards": st.shards,
                            "bytes": st.bytes, "dropped": st.dropped, "stop_reason": self.stop_reason,
                            "error": st.error_reason or self._error, "closed": time.time(),
                            "clean": st.error is None and self._error is None}
            if not self.summary["clean"]:  # kept apart from the marker, which a later appending session replaces
                try:
                    layout.append_error(self.dir, {"run_id": self.config.run_id, "error": self.summary["error"],
                                                   "dropped": st.dropped, "closed": self.summary["closed"]})
                except OSError as exc:
                    log.error("could not record the capture error in %s: %s", self.dir / layout.ERRORS, exc)
            try:  # every session's records in this rank's manifest, for verify to compare with later
                self.summary["manifest_records"] = layout.count_records(self.dir / layout.MANIFEST)
            except OSError as exc:
                log.error("could not count the records of %s: %s", self.dir / layout.MANIFEST, exc)
            try:
                layout.write_json_atomic(self.dir / layout.COMMITTED, self.summary)
            except OSError as exc:
                log.error("could not write the commit marker in %s: %s", self.dir, exc)
            self._dir_lock.release()
        finally:  # a close cut short (Ctrl-C in the drain) must not leave SIGTERM ignored
            if self._sigterm is not None:
                self._sigterm.restore()
        if st.error is not None and self.spec.on_error is ErrorPolicy.ABORT and not self._raised:
            self._raised = True
            raise CaptureError(f"capture failed (on_error: abort): {st.error_reason}") from st.error
        return self.summary

    def __enter__(self) -> "CaptureSession":
        activate(self)
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def _shared_copies() -> Iterator[dict]:
    """The private copies (``Lease``s) one capture call shares between its works, held by the call itself until
    it has queued them all: the writer may be done with the first work's item before the next is queued."""
    shared: dict = {}
    try:
        yield shared
    finally:
        for lease in shared.values():
            lease.release()


def _tap_fields(tap: Tap, ndim: int = 0, tp_size: int = 1) -> dict:
    """The manifest fields a tap determines (the rest come from the session and the tensor): ``shard_dim`` only
    under tensor parallelism (``tp_size`` > 1), counted from the front of the ``ndim``-dim tensor."""
    shard = tap.shard_dim if tp_size > 1 and tap.shard_dim is not None and -ndim <= tap.shard_dim < ndim else None
    return {
        "format": None if tap.qspec is None else tap.qspec.split(":", 1)[0], "qspec": tap.qspec,
        "component": tap.component.value, "module": tap.module, "kind": None if tap.kind is None else tap.kind.value,
        "layer": tap.layer, "role": tap.role.value, "copy": tap.copy.value,
        "gemm": None if tap.gemm is None else tap.gemm.value, "phase": tap.phase.value,
        "direction": tap.direction.value, "shard_dim": None if shard is None else shard % ndim, "blocked_dim": tap.dim,
    }


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
    """Create a session writing under ``root`` and make it the active one. It is closed (drained and committed)
    at interpreter exit if the caller has not closed it, and, called on the main thread of a process whose SIGTERM
    has no handler, on SIGTERM too (``_SigtermExit``: a job scheduler's preemption or time limit); a handler the
    process has is left alone. Refused, touching nothing under ``root``, while another session is active."""
    if _STATE.session is not None:
        raise RuntimeError("another capture session is active; close it first")
    session = CaptureSession(spec, SessionConfig(Path(root), **config))
    activate(session)
    # numba (the writer's statistics kernels) imported first, so that its exit handlers run after this close
    host.backend()
    atexit.register(session.close)
    session._sigterm = _SigtermExit.install()
    return session


class _SigtermExit:
    """SIGTERM's handler while a session is open, installed where SIGTERM had none (SIG_DFL ends the process at
    once: no atexit, so every tensor still queued or buffered for its shard is lost). The first SIGTERM raises
    ``SystemExit(143)`` in the main thread, so the interpreter exits normally and runs the session's ``close``
    (drained and committed); later ones, and any while the session closes, are ignored so they cannot cut that
    close short (the pattern of ``fxquant.megatron_glue.launch._terminate``, which installs its own handler first
    and is then left alone). ``restore()``, at the end of close, puts SIG_DFL back; where close runs off the main
    thread, where signal handlers cannot be set, the handler stays but does what SIG_DFL does."""

    class State(enum.Enum):
        OPEN = "open"  # the first SIGTERM exits through close
        CLOSING = "closing"  # SIGTERMs are ignored
        CLOSED = "closed"  # the session has closed: SIG_DFL's action

    def __init__(self) -> None:
        self.state = self.State.OPEN

    @classmethod
    def install(cls) -> "_SigtermExit | None":
        if threading.current_thread() is not threading.main_thread():
            return None
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return None
        handler = cls()
        signal.signal(signal.SIGTERM, handler)
        return handler

    def __call__(self, signum: int, frame: object) -> None:
        if self.state is self.State.CLOSED:  # what SIG_DFL does
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.state is self.State.CLOSING:
            return
        self.state = self.State.CLOSING  # stays SIGTERM's handler: restore() finds it, also if SystemExit is caught
        raise SystemExit(128 + signum)

    def restore(self) -> None:
        """SIG_DFL again, where this handler is still SIGTERM's (not replaced since) and the caller is the main
        thread; close calls it however the close ends."""
        self.state = self.State.CLOSED
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is self:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


# -- the op ------------------------------------------------------------------------------------------
# Defined with torch.library.Library rather than torch.library.custom_op: the call is a plain dispatcher call
# into a Python kernel, several times cheaper than custom_op's wrapper, which matters because every tap in a
# compiled graph makes one call per step, in its window or not (cost per call outside the window on the
# 2-core CPU box: docs/capture.md, "What the figures say").
_LIB = torch.library.Library("fxquant", "FRAGMENT")
_LIB.define("capture(Tensor x, str tap, Tensor? reference=None) -> ()")


def _capture_impl(x: torch.Tensor, tap: str, reference: torch.Tensor | None = None) -> None:
    session = _STATE.session
    if session is not None:
        session.capture(x, tap, reference)


_LIB.impl("capture", _capture_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("fxquant::capture", lib=_LIB)
def _capture_fake(x: torch.Tensor, tap: str, reference: torch.Tensor | None = None) -> None:
    return None


def capture(x: torch.Tensor, tap: str, reference: torch.Tensor | None = None) -> None:
    """``torch.ops.fxquant.capture``: report ``x`` under the tap string ``tap`` (tap.encode_taps) to the session."""
    torch.ops.fxquant.capture(x, tap, reference)


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
    def forward(ctx, x: torch.Tensor, taps: str, copy: bool) -> torch.Tensor:
        ctx.taps = taps
        return x.clone() if copy else x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        torch.ops.fxquant.capture(grad, ctx.taps)
        return grad, None, None


def capture_grad(x: torch.Tensor, taps: str | tuple, copy: bool = False) -> torch.Tensor:
    """Identity whose backward captures the gradient arriving at ``x``, in one op call for all its taps:
    ``taps`` is a tap string (tap.encode_taps) or a tuple of single-tap strings (a module-level wrapper the
    tap pass inserts, ARCHITECTURE.md trap 1). The result is a view of ``x``; ``copy=True`` returns a copy
    instead, for a result that a later op changes in place (autograd forbids that on a custom Function's view:
    Megatron's RowParallelLinear all-reduces its output in place at TP > 1)."""
    if not isinstance(taps, str):
        taps = encode_taps([decode_tap(t) for t in taps])
    return _GradTap.apply(x, taps, copy)


def save(x: torch.Tensor, name: str, **fields) -> bool:
    """Store ``x`` in the active capture session as a record named ``name`` (CaptureSession.save: same manifest
    fields as a tap's; ``module``, ``layer``, ``component``, ``direction``, ``phase`` optional). False, and
    nothing stored, when no session is active or capture has stopped. Eager code: inside a compiled region
    the call is a graph break."""
    session = _STATE.session
    if session is None:
        return False
    return session.save(x, name, **fields)


def capture_operand(q: torch.Tensor, hp: torch.Tensor, tap: str) -> None:
    """For quantized-GEMM functions: capture operand ``q`` as the GEMM consumed it, with ``hp`` its source."""
    torch.ops.fxquant.capture(q, tap, hp)



__all__ = ["CaptureError", "CaptureSession", "RankDirBusy", "RankInfo", "SessionConfig", "activate", "active_session",
           "capture", "capture_grad", "capture_operand", "save", "start"]
