"""The asynchronous capture writer: a bounded queue drained by one background thread per rank.

The capture op (training thread) hands over ``Item``s whose tensors are already private host copies
(on CUDA: pinned buffers filled by non-blocking copies, plus an event recorded after them), so it never
waits for the device. The thread waits on each item's event, computes its checksum, groups tensors
into safetensors shards of about ``shard_bytes`` and, after each shard is durable, appends its records
to the manifest (layout.py). A shard is also committed when ``flush_seconds`` have passed, and at close.
The queue is bounded both in items and in bytes held: a full queue blocks the producer (back-pressure)
rather than growing host memory without limit.

An I/O error (disk full...) is never swallowed: the writer stops, removes its temporary file, keeps the
exception and the reason; the session then stops capturing (policy ``stop``) or re-raises it in the
training thread (policy ``abort``).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fxquant.capture import layout, stats

log = logging.getLogger(__name__)


@dataclass
class Item:
    record: dict  # manifest fields known at capture time
    tensor: torch.Tensor | None  # host copy to store (None: statistics only)
    stats: torch.Tensor | None  # packed statistics vector (host, maybe pinned)
    quantized: bool = False
    event: object | None = None  # torch.cuda.Event recorded after the device->host copies
    nbytes: int = 0


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
                 shard_metadata: dict[str, str] | None = None):
        self.dir = Path(directory)
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
        self._thread = threading.Thread(target=self._run, name=f"fxquant-capture-writer:{self.dir.name}", daemon=True)
        self._thread.start()

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
        self._q.put(item)

    def flush(self) -> None:
        """Commit everything queued so far (blocks until done)."""
        done = threading.Event()
        self._q.put(("flush", done))
        done.wait()

    def close(self) -> WriterState:
        if not self._closed:
            self._closed = True
            self._q.put(None)
            self._thread.join()
        return self.state

    # -- writer thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        buf: list[tuple[dict, torch.Tensor | None]] = []
        buf_bytes = 0
        first_at: float | None = None
        while True:
            timeout = None if first_at is None else max(0.0, first_at + self.flush_seconds - time.monotonic())
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                item = ("flush", None)
            if item is None or isinstance(item, tuple):
                buf, buf_bytes, first_at = self._commit(buf), 0, None
                if isinstance(item, tuple) and item[1] is not None:
                    item[1].set()
                if item is None:
                    return
                continue
            try:
                if self.stopped:
                    self.state.dropped += 1
                    continue  # drain: after an error or the files budget nothing more is written
                if item.event is not None:
                    item.event.synchronize()
                rec = dict(item.record)
                if item.stats is not None:
                    rec["stats"] = stats.unpack(item.stats.tolist(), item.quantized)
                if item.tensor is not None:
                    rec["checksum"] = layout.checksum(item.tensor)
                    buf_bytes += item.tensor.numel() * item.tensor.element_size()
                buf.append((rec, item.tensor))
                first_at = first_at if first_at is not None else time.monotonic()
                if buf_bytes >= self.shard_bytes:
                    buf, buf_bytes, first_at = self._commit(buf), 0, None
            finally:
                with self._cv:
                    self._held -= item.nbytes
                    self._cv.notify_all()

    def _commit(self, buf: list) -> list:
        """Write one shard (if any tensors) and append the records; returns the new (empty) buffer."""
        if not buf:
            return []
        if self.stopped:
            self.state.dropped += len(buf)
            return []
        tensors = [(rec["key"], t) for rec, t in buf if t is not None]
        records = [rec for rec, _ in buf]
        try:
            if tensors:
                if self.max_files is not None and self.state.shards >= self.max_files:
                    self.state.budget_reason = f"budget.files={self.max_files} reached"
                    self.state.dropped += len(records)
                    log.warning("capture stopped: %s", self.state.budget_reason)
                    return []
                index = self.state.shards + 1
                name = layout.shard_name(index)
                path = self.dir / layout.SHARDS / name
                n = layout.write_safetensors(path, tensors, {"format": "fxquant-capture", **self.metadata})
                self.state.shards = index
                self.state.bytes += n
                for rec in records:
                    if rec.get("key") is not None:
                        rec["file"] = f"{layout.SHARDS}/{name}"
            layout.append_lines(self.dir / layout.MANIFEST, records)
            self.state.records += len(records)
        except OSError as exc:
            self._fail(exc, f"I/O error while writing {self.dir}: {exc.strerror or exc} (errno {exc.errno})")
        return []

    def _fail(self, exc: BaseException, reason: str) -> None:
        log.error("capture writer stopped: %s", reason)
        self.state.error = exc
        self.state.error_reason = reason
        with self._cv:
            self._cv.notify_all()
