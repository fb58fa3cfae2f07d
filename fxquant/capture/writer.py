"""The asynchronous capture writer: a bounded queue drained by one background thread per rank.

The capture op (training thread) hands over ``Item``s holding private host copies: on CUDA pinned
buffers filled by non-blocking copies plus an event recorded after them (the thread waits on the
event), on CPU a pooled copy of the captured tensor plus the ``Work`` (prepare.py) that the thread runs
on it: re-quantization, sampling, statistics. Either way the training thread never waits for the device
or for the statistics. The thread groups tensors into safetensors shards of about ``shard_bytes``,
hashing each tensor as it writes it (layout.py) and, after each shard is durable, appends the records
to the manifest. A shard is also committed when ``flush_seconds`` have passed, and at close. The queue
is bounded in items and in bytes held: a full queue blocks the producer (back-pressure) rather than
growing host memory without limit; tensors waiting for their shard add at most ``shard_bytes``.

An I/O error (disk full...) is never swallowed: the writer stops, removes its temporary file, keeps the
exception and the reason, and counts the records it could not write as dropped; the session then stops
capturing (policy ``stop``) or re-raises it in the training thread (policy ``abort``). Any other failure in
the writer thread (an item's deferred work, a tensor the shard format cannot hold, a defect) is handled the
same way, and nothing waits on a writer thread that has ended. When an item's deferred work fails, the items
prepared before it are written first (their shard and manifest lines), and only the failing item and what
follows it are dropped.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fxquant._threads import start_daemon
from fxquant.capture import layout, stats
from fxquant.capture.hostpool import Lease
from fxquant.capture.prepare import Work

log = logging.getLogger(__name__)


@dataclass
class Item:
    """One captured tensor: its manifest records (several when one tensor serves several taps; they share
    one stored copy) and either what to store, ready, or the work to derive it in the writer thread."""

    records: list[dict] | dict  # manifest fields known at capture time (a dict: one record)
    tensor: torch.Tensor | None = None  # host copy to store (None: statistics only, or ``work`` derives it)
    stats: torch.Tensor | None = None  # packed statistics vector (host, maybe pinned)
    quantized: bool = False
    event: object | None = None  # torch.cuda.Event recorded after the device->host copies
    nbytes: int = 0  # host bytes this item holds while queued (back-pressure)
    work: Work | None = None  # CPU captures: run here on ``source`` (a private copy) for tensor and stats
    source: Lease | None = None  # each released once by the writer when done with it
    reference: Lease | None = None

    @property
    def record_count(self) -> int:
        return 1 if isinstance(self.records, dict) else len(self.records)


@dataclass
class _Buffered:
    """An item waiting for its shard: records (statistics filled in), the tensor, the lease holding it."""

    records: list[dict]
    tensor: torch.Tensor | None
    lease: Lease | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()


@dataclass
class WriterState:
    shards: int = 0
    records: int = 0
    bytes: int = 0
    error: BaseException | None = None
    error_reason: str | None = None
    budget_reason: str | None = None  # a clean stop (budget.files reached), not an error
    dropped: int = 0


class ShardWriter:
    """Owns one rank directory: shards, manifest; ``put`` from the training thread, ``close`` at the end."""

    def __init__(self, directory: Path, *, shard_bytes: int = 256 << 20, queue_items: int = 256,
                 queue_bytes: int = 2 << 30, flush_seconds: float = 30.0, max_files: int | None = None,
                 shard_metadata: dict[str, str] | None = None, first_shard: int = 0):
        self.dir = Path(directory)
        self.first_shard = first_shard  # shards already in the directory (an earlier session's): named after them
        (self.dir / layout.SHARDS).mkdir(parents=True, exist_ok=True)
        self.shard_bytes = shard_bytes
        self.flush_seconds = flush_seconds
        self.max_files = max_files
        self.metadata = dict(shard_metadata or {})
        self.state = WriterState()
        self._q: queue.Queue = queue.Queue(maxsize=queue_items)
        self._queue_bytes = queue_bytes
        self._held = 0
        self._cv = threading.Condition()
        self._closed = False
        self._thread = start_daemon(self._run, name=f"fxquant-capture-writer:{self.dir.name}")

    # -- training thread -----------------------------------------------------------------------------
    @property
    def failed(self) -> bool:
        return self.state.error is not None

    @property
    def stopped(self) -> bool:
        return self.state.error is not None or self.state.budget_reason is not None

    def put(self, item: Item) -> None:
        """Queue one item; blocks while the queue is full (by count or by bytes)."""
        if self._closed:
            raise RuntimeError("capture writer is closed")
        with self._cv:
            while self._held and self._held + item.nbytes > self._queue_bytes and not self.stopped:
                self._cv.wait(timeout=1.0)
            self._held += item.nbytes
        if not self._enqueue(item):  # the thread has ended (its error is in state): counted, not waited for
            with self._cv:
                self._held -= item.nbytes
            for lease in (item.source, item.reference):
                if lease is not None:
                    lease.release()
            self.state.dropped += item.record_count

    def _enqueue(self, obj: object) -> bool:
        """Put ``obj`` on the queue, waiting while it is full, unless the writer thread has ended."""
        while self._thread.is_alive():
            try:
                self._q.put(obj, timeout=1.0)
                return True
            except queue.Full:
                continue
        return False

    def wait_idle(self) -> None:
        """Block until every queued item has been processed (buffered for its shard or written); commits nothing."""
        self._q.join()

    def flush(self) -> None:
        """Commit everything queued so far (blocks until done, or until the writer thread has ended)."""
        done = threading.Event()
        if self._enqueue(("flush", done)):
            while not done.wait(timeout=1.0) and self._thread.is_alive():
                pass

    def close(self) -> WriterState:
        if not self._closed:
            self._closed = True
            if self._enqueue(None):
                self._thread.join()
        return self.state

    # -- writer thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - a defect in the loop itself: recorded, never silent
            self._fail(exc, f"capture writer thread ended: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        buf: list[_Buffered] = []
        buf_bytes = 0
        first_at: float | None = None
        while True:
            timeout = None if first_at is None else max(0.0, first_at + self.flush_seconds - time.monotonic())
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:  # flush_seconds passed since the oldest buffered item: commit
                buf, buf_bytes, first_at = self._commit(buf), 0, None
                continue
            if item is None or isinstance(item, tuple):  # close, or flush(): commit
                buf, buf_bytes, first_at = self._commit(buf), 0, None
                if item is not None:
                    item[1].set()
                self._q.task_done()
                if item is None:
                    return
                continue
            try:
                try:
                    entry = self._prepare(item)
                except Exception as exc:  # noqa: BLE001 - any failure stops capture (the session applies on_error)
                    # the items prepared before this one are good: their shard is written before the stop
                    buf, buf_bytes, first_at = self._commit(buf), 0, None
                    if self.state.error is None:  # also after a budget stop that commit reached: never lost
                        self._fail(exc, "capture preparation failed in the writer thread: "
                                        f"{type(exc).__name__}: {exc}")
                    self.state.dropped += item.record_count
                    entry = None
                if entry is None:  # stopped (before, or by a failed preparation): dropped
                    continue
                buf.append(entry)
                buf_bytes += entry.nbytes
                first_at = first_at if first_at is not None else time.monotonic()
                if buf_bytes >= self.shard_bytes:
                    buf, buf_bytes, first_at = self._commit(buf), 0, None
            finally:
                with self._cv:
                    self._held -= item.nbytes
                    self._cv.notify_all()
                self._q.task_done()

    def _prepare(self, item: Item) -> _Buffered | None:
        """The item's records with their statistics, and the tensor to store: the host copies it came with (after
        waiting for their event), or what its work derives from its source. None when it is dropped."""
        records = [item.records] if isinstance(item.records, dict) else item.records
        leases = [x for x in (item.source, item.reference) if x is not None]
        if self.stopped:  # drain: after an error or the files budget nothing more is written
            self.state.dropped += len(records)
            for lease in leases:
                lease.release()
            return None
        keep = None  # the lease the stored tensor lives in, released after its shard is written
        if item.work is None:
            if item.event is not None:
                item.event.synchronize()
            tensor, vec, quantized = item.tensor, item.stats, item.quantized
        else:
            source = item.source.tensor
            try:
                prep = item.work.run(source, None if item.reference is None else item.reference.tensor)
            except BaseException:  # the caller commits what is buffered, then stops capture
                for lease in leases:
                    lease.release()
                raise
            tensor, vec, quantized = prep.payload, prep.stats, prep.quantized
            if tensor is not None and tensor.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
                if tensor.numel() == source.numel():
                    keep = item.source  # stored as it is: no copy
                else:
                    tensor = tensor.clone()  # sampled rows of the source: keep only them
        for lease in leases:
            if lease is not keep:
                lease.release()
        records = [dict(r) for r in records]
        if vec is not None:
            st = stats.unpack(vec.tolist(), quantized)
            for rec in records:
                rec["stats"] = st
        return _Buffered(records, tensor, keep)

    def _commit(self, buf: list[_Buffered]) -> list:
        """Write one shard (if any tensors) and append the records; returns the new (empty) buffer."""
        if not buf:
            return []
        try:
            self._write(buf)
        finally:
            for entry in buf:
                if entry.lease is not None:
                    entry.lease.release()
        return []

    def _write(self, buf: list[_Buffered]) -> None:
        records = [rec for entry in buf for rec in entry.records]
        if self.stopped:
            self.state.dropped += len(records)
            return
        stored = [entry for entry in buf if entry.tensor is not None]
        try:
            if stored:
                if self.max_files is not None and self.state.shards >= self.max_files:
                    self.state.budget_reason = f"budget.files={self.max_files} reached"
                    self.state.dropped += len(records)
                    log.warning("capture stopped: %s", self.state.budget_reason)
                    return
                index = self.state.shards + 1
                name = layout.shard_name(self.first_shard + index)
                path = self.dir / layout.SHARDS / name
                n, sums = layout.write_safetensors(path, [(e.records[0]["key"], e.tensor) for e in stored],
                                                   {"format": "fxquant-capture", **self.metadata})
                for entry, checksum in zip(stored, sums):
                    for rec in entry.records:
                        rec["file"], rec["checksum"] = f"{layout.SHARDS}/{name}", checksum
            layout.append_lines(self.dir / layout.MANIFEST, records)
            if stored:  # counted once the manifest references it (a failed append leaves it unreferenced)
                self.state.shards = index
                self.state.bytes += n
            self.state.records += len(records)
        except OSError as exc:
            self._fail(exc, f"I/O error while writing {self.dir}: {exc.strerror or exc} (errno {exc.errno})")
            self.state.dropped += len(records)
        except Exception as exc:  # noqa: BLE001 - e.g. a tensor safetensors cannot hold: stops capture, never silent
            self._fail(exc, f"capture writer failed writing {self.dir}: {type(exc).__name__}: {exc}")
            self.state.dropped += len(records)

    def _fail(self, exc: BaseException, reason: str) -> None:
        log.error("capture writer stopped: %s", reason)
        self.state.error = exc
        self.state.error_reason = reason
        with self._cv:
            self._cv.notify_all()
