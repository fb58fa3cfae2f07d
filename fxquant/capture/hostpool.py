"""Recycled host buffers for the private copies CPU captures make on the training thread (issue 4, deliverable 3).

A capture must copy its tensor before the op returns (ARCHITECTURE.md trap 4). A fresh multi-MiB
allocation is served by ``mmap`` and page-faulted in on first write: on the 2-core CPU box a 12 MiB clone
ran at ~1 GB/s where a copy into an already-touched buffer ran at 5-10 GB/s. The tensors a training step
captures have the same sizes every step, so the pool hands back buffers of the exact byte size that the
writer has finished with.

``HostPool.copy(x)`` returns a ``Lease`` on a contiguous copy of ``x``; each holder of the lease calls
``release()`` once when it no longer reads the copy, and the buffer returns to the pool when the last one
has. At most ``max_free_bytes`` of free buffers are kept; ``clear()`` drops them (the capture window closed, the
session closed), and buffers returned after it (the writer finishing the window's last copies) are dropped too
until the next ``copy()``: outside the window the pool holds nothing.
"""
from __future__ import annotations

import threading

import torch


class Lease:
    """A pooled copy (``tensor``) shared by ``holders`` users, each releasing it once."""

    __slots__ = ("tensor", "_buffer", "_pool", "_holders", "_lock")

    def __init__(self, tensor: torch.Tensor, buffer: torch.Tensor, pool: "HostPool", holders: int = 1):
        self.tensor, self._buffer, self._pool, self._holders = tensor, buffer, pool, holders
        self._lock = threading.Lock()

    def hold(self) -> "Lease":
        """One more holder (who must ``release`` too)."""
        with self._lock:
            if self._holders <= 0:
                raise RuntimeError("lease already returned to its pool")
            self._holders += 1
        return self

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            done = self._holders == 0
        if done:
            self._pool._give(self._buffer)
            self.tensor = self._buffer = None


class HostPool:
    """Free host buffers by byte size, for copies whose sizes recur (every training step captures the same)."""

    def __init__(self, max_free_bytes: int = 1 << 30):
        if max_free_bytes < 0:
            raise ValueError(f"max_free_bytes={max_free_bytes!r}: must be >= 0")
        self.max_free_bytes = max_free_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._keep = True  # False from clear() to the next copy(): returned buffers are dropped, not kept
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def free_bytes(self) -> int:
        """Bytes of the free buffers the pool keeps for reuse."""
        return self._free_bytes

    def copy(self, x: torch.Tensor) -> Lease:
        """A contiguous CPU copy of ``x`` (same shape and dtype) in a pooled buffer, with one holder."""
        nbytes = x.numel() * x.element_size()
        with self._lock:
            self._keep = True
            free = self._free.get(nbytes)
            buf = free.pop() if free else None
            if buf is not None:
                self._free_bytes -= nbytes
                self.hits += 1
            else:
                self.misses += 1
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        out = buf.view(x.dtype).view(x.shape) if nbytes else torch.empty(x.shape, dtype=x.dtype)
        out.copy_(x)
        return Lease(out, buf, self)

    def _give(self, buf: torch.Tensor) -> None:
        n = buf.numel()
        with self._lock:
            if self._keep and self._free_bytes + n <= self.max_free_bytes:
                self._free.setdefault(n, []).append(buf)
                self._free_bytes += n

    def clear(self) -> None:
        """Drop the free buffers, and those returned from now until the next ``copy()``."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0
            self._keep = False


__all__ = ["HostPool", "Lease"]
