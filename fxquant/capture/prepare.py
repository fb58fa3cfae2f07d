"""What one capture turns a tensor into: the stored payload and the packed statistics (issue 4, deliverables 3-4).

A ``Work`` is decided on the training thread from a tap and the sections that selected it: whether to
re-quantize the tensor as its GEMM did (a quantized copy), which rows to store (sampling), whether to
store it at all and whether to compute statistics. ``Work.run(x, reference)`` does the tensor work and
returns a ``Prepared`` (payload, statistics vector, sampling record).

Where it runs is the session's choice (runtime.py): on CUDA at once, so the kernels are queued on the
device and the host copies follow them without a sync; on CPU in the writer thread, on a private copy of
the tensor, so the training thread only pays for that copy (the statistics kernels release the GIL).
Re-quantizing a copy gives the same bits as re-quantizing the original: the roundings the tap pass asks
for are deterministic.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from fxquant.capture.spec import Sampling, SamplingMode
from fxquant.capture.stats import pack_quantized_stats, pack_tensor_stats
from fxquant.ops import parse_qspec


@functools.lru_cache(maxsize=64)
def _sample_rows(rows: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(rows, generator=g)[:n].sort().values


def _matrix(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, last dim], rows = the product of the other dims (explicit: ``reshape(-1, 0)`` of an
    empty tensor is ambiguous and refused)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """Rows = every dim but the last (a 0-d or 1-d tensor is one row)."""
    return x.reshape(1, -1) if x.dim() < 2 else _matrix(x)


@dataclass(frozen=True)
class Prepared:
    payload: torch.Tensor | None  # what is stored (None: statistics only)
    stats: torch.Tensor | None  # packed float64 statistics vector (stats.py layout), on x's device
    quantized: bool = False  # ``stats`` holds the quantized-copy part too


@dataclass(frozen=True)
class Work:
    """The tensor work of one capture; equal ``Work``s on one tensor are done once and stored once."""

    store: bool
    stats: bool
    sampling: Sampling | None = None  # rows stored (with store only)
    qspec: str | None = None  # a quantized copy: the GEMM operand's format (TensorQuant.spec())
    dim: int | None = None  # a quantized copy: its blocked dim, in the GEMM's view
    flatten: bool = False  # view as [M, K] first (linear operands, as the GEMMs see them)
    requantize: bool = False  # a quantized copy whose GEMM operand is not given: x is its source

    @property
    def quantized(self) -> bool:
        return self.qspec is not None

    def view(self, x: torch.Tensor) -> torch.Tensor:
        return _matrix(x) if self.flatten and x.dim() != 2 else x

    def shape(self, x: torch.Tensor) -> list[int]:
        """The captured tensor's shape (the GEMM's view for a re-quantized copy)."""
        return list(self.view(x).shape) if self.requantize else list(x.shape)

    def stored_shape(self, x: torch.Tensor) -> list[int] | None:
        if not self.store:
            return None
        shape = self.shape(x)
        if self.sampling is None:
            return shape
        rows = math.prod(shape[:-1]) if len(shape) >= 2 else 1
        return [min(self.sampling.rows, rows), shape[-1] if shape else 1]

    def sample_info(self, x: torch.Tensor) -> dict | None:
        """The manifest's ``sample`` field (known before any tensor work)."""
        s = self.sampling
        if s is None or not self.store:
            return None
        shape = self.shape(x)
        rows = math.prod(shape[:-1]) if len(shape) >= 2 else 1
        info = {"mode": s.mode.value, "rows": min(s.rows, rows), "of_rows": rows}
        if s.mode is SamplingMode.RANDOM_ROWS:
            info["seed"] = s.seed
        return info

    def nbytes(self, x: torch.Tensor) -> int:
        """Bytes the payload will take (known before any tensor work: the budget is checked first)."""
        shape = self.stored_shape(x)
        return 0 if shape is None else math.prod(shape) * x.element_size()

    def run(self, x: torch.Tensor, reference: torch.Tensor | None = None) -> Prepared:
        x = x.detach()
        if self.requantize:
            reference = self.view(x)
            x = torch.ops.fxquant.quantize(reference, self.qspec, self.dim, None)
        quantized = self.quantized and reference is not None
        vec = None
        if self.stats:
            vec = pack_tensor_stats(x)
            if quantized:
                vec = torch.cat([vec, pack_quantized_stats(x, reference, parse_qspec(self.qspec), self.dim)])
        return Prepared(self.sample(x) if self.store else None, vec, quantized)

    def sample(self, x: torch.Tensor) -> torch.Tensor:
        """The stored rows of ``x`` (all of it without sampling; first rows are a view)."""
        s = self.sampling
        if s is None:
            return x
        x2 = _rows_view(x)
        if s.mode is SamplingMode.FIRST_ROWS:
            return x2[: s.rows]
        return x2.index_select(0, _sample_rows(x2.shape[0], s.rows, s.seed).to(x2.device))

    @property
    def needs_source(self) -> bool:
        """The whole tensor is needed later (not just the stored rows)."""
        return self.stats or self.requantize or self.sampling is None


__all__ = ["Prepared", "Work"]
