"""Fused one-pass reductions over tensors in host memory, for the analysis workers and CPU capture statistics.

The analysis report and the capture statistics reduce every element of every tensor to a few histograms
and sums. Written as torch ops that is eight or more passes over memory per tensor (bit views, masks,
shifts, several ``bincount``s); here each reduction is one loop compiled by numba, reading every element
once. Every function has a pure-torch twin (``*_torch``) that defines the result; numba's version equals it
(counts and extrema exactly, float64 sums to rounding), tested in tests/test_host_kernels.py.

* ``bf16_counts(x, block)``: the 65536-bin histogram of a bfloat16 tensor's bit patterns (from which
  fxquant.analysis derives exact moments, signed/binade histograms and quantiles) and its block-relative
  histogram (fxquant.analysis.bins) with ``block``-element blocks along the last dim.
* ``f32_counts(x, block)``: for float32, the signed, binade and block-relative histograms and the moment sums.
* ``pair_sums(q, x)``: the sums behind SQNR, MSE, cosine, max error and flushed counts of a quantized copy ``q``
  against its high-precision source ``x``.
* ``tensor_stats(x)``: the capture statistics vector (fxquant.capture.stats layout).

numba is optional: without it (or with ``FXQUANT_HOST_KERNELS=torch``) every function runs its torch twin.
Kernels are compiled on first use and cached on disk (numba ``cache=True``).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)

# -- bins shared with fxquant.analysis.bins (which documents them); repeated here as plain ints for numba ----
SUB = 16
NMAG = 4097
NSIGNED = 2 * NMAG
NBINADE = 256
REL_OFFSET = 255 * SUB
NREL = REL_OFFSET + NMAG + 2
REL_ZERO = REL_OFFSET + NMAG  # exact zeros of blocks without NaN/Inf
REL_NONFINITE = REL_ZERO + 1  # every element of a block holding a NaN or an Inf (MX makes that block NaN)
EXP_MIN, EXP_MAX = -149, 127  # capture statistics: binary exponents of finite non-zero float32 values
N_EXP = EXP_MAX - EXP_MIN + 1


def _numba():
    """The numba module, or None when it is not installed or switched off (FXQUANT_HOST_KERNELS=torch)."""
    choice = os.environ.get("FXQUANT_HOST_KERNELS", "numba")
    if choice not in ("numba", "torch"):
        raise ValueError(f"FXQUANT_HOST_KERNELS={choice!r}: must be 'numba' or 'torch'")
    if choice == "torch":
        return None
    try:
        import numba
    except ImportError:
        return None
    return numba


def backend() -> str:
    """'numba' when the compiled kernels run, else 'torch'."""
    return "numba" if _numba() is not None else "torch"


# -- the compiled kernels (built once per process, loaded from numba's on-disk cache when present) ---------
_KERNELS: dict | None = None


def _kernels() -> dict | None:
    global _KERNELS
    if _numba() is None:
        return None
    if _KERNELS is None:
        from fxquant.kernels import _host_numba as nb

        _KERNELS = {"bf16": nb.bf16_counts_nb, "f32": nb.f32_counts_nb, "pair": nb.pair_nb, "stats": nb.stats_nb}
    return _KERNELS


_NO_LUT = np.zeros(0, dtype=np.float32)
_BF16_LUT: np.ndarray | None = None


def _bf16_lut() -> np.ndarray:
    """float32 value of every bf16 bit pattern (index: the pattern as uint16)."""
    global _BF16_LUT
    if _BF16_LUT is None:
        _BF16_LUT = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    return _BF16_LUT


def _flat_np(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(numpy view of x's elements, lut): bf16 as uint16 patterns with the decode table, float32 as is,
    anything else converted to float32."""
    x = x.detach().reshape(-1)
    if x.dtype == torch.bfloat16:
        return x.contiguous().view(torch.int16).numpy().view(np.uint16), _bf16_lut()
    if x.dtype != torch.float32:
        x = x.float()
    return x.contiguous().numpy(), _NO_LUT


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x as a contiguous [rows, length] (length = the last dim; a 0-d tensor is one row of one)."""
    length = x.shape[-1] if x.dim() else 1
    return x.detach().contiguous().reshape(-1, max(length, 1)), max(length, 1)


# -- bf16 pattern counts ----------------------------------------------------------------------------------------
@dataclass
class Bf16Counts:
    patterns: np.ndarray  # int64 [65536]: count of each bit pattern (index = pattern as uint16)
    rel: np.ndarray  # int64 [NREL]: block-relative histogram


def _counts_kernels(x: torch.Tensor, dtype: torch.dtype, block: int, name: str) -> dict | None:
    """Check a counts call's arguments; the compiled kernels when they apply to ``x`` (else None: the twin)."""
    if x.dtype != dtype:
        raise TypeError(f"{name} takes a {dtype} tensor, not {x.dtype}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r}: must be an int >= 1")
    return _kernels() if x.device.type == "cpu" else None


def bf16_counts(x: torch.Tensor, block: int = 32) -> Bf16Counts:
    """Pattern and block-relative histograms of a bfloat16 tensor, blocks of ``block`` along its last dim."""
    k = _counts_kernels(x, torch.bfloat16, block, "bf16_counts")
    if k is None:
        return bf16_counts_torch(x, block)
    x2, length = _rows(x)
    hist, rel = np.zeros(1 << 16, np.int64), np.zeros(NREL, np.int64)
    if x2.numel():
        k["bf16"](x2.view(torch.int16).numpy().view(np.uint16).reshape(-1), length, block, hist, rel)
    return Bf16Counts(hist, rel)


def _rel_torch(a: torch.Tensor, length: int, block: int, mag_shift: int, exp_shift: int) -> np.ndarray:
    """Block-relative histogram from magnitude bits ``a`` ([rows, length], non-negative int16/int32): a block
    holding a NaN or an Inf (magnitude bits >= the Inf pattern) puts all its elements in ``REL_NONFINITE``."""
    rows = a.shape[0]
    pad = (-length) % block
    if pad:  # a short last block behaves as if padded with zeros; the pads are cut off before counting
        a = torch.nn.functional.pad(a, (0, pad))
    ab = a.reshape(rows, -1, block)
    m = ab.amax(dim=-1, keepdim=True).to(torch.int32)
    shift = REL_OFFSET - SUB * torch.where(m == 0, 255, m >> exp_shift)
    rel = (((ab.to(torch.int32) - 1) >> mag_shift) + 1 + shift).masked_fill_(ab == 0, REL_ZERO)
    rel = rel.masked_fill_(m >= (0xFF << exp_shift), REL_NONFINITE)
    return torch.bincount(rel.reshape(rows, -1)[:, :length].reshape(-1), minlength=NREL).numpy().astype(np.int64)


def bf16_counts_torch(x: torch.Tensor, block: int = 32) -> Bf16Counts:
    x2, length = _rows(x.cpu())
    b = x2.view(torch.int16)
    hist = torch.bincount((b.to(torch.int32) & 0xFFFF).reshape(-1), minlength=1 << 16).numpy().astype(np.int64)
    if not x2.numel():
        return Bf16Counts(hist, np.zeros(NREL, np.int64))
    return Bf16Counts(hist, _rel_torch(b & 0x7FFF, length, block, 3, 7))


# -- float32 counts ---------------------------------------------------------------------------------------------
@dataclass
class F32Counts:
    signed: np.ndarray  # int64 [NSIGNED]
    binade: np.ndarray  # int64 [NBINADE]: exponent fields
    rel: np.ndarray  # int64 [NREL]
    n_finite: int
    nan: int
    inf: int
    sum: float  # of the finite elements
    m2: float  # sum of squared deviations from their mean
    min: float
    max: float


def _f32_result(signed, binade, rel, nf, nan, inf, s1, s2, lo, hi, k) -> F32Counts:
    nf = int(nf)
    return F32Counts(signed, binade, rel, nf, int(nan), int(inf), k * nf + s1 if nf else 0.0,
                     max(s2 - s1 * s1 / nf, 0.0) if nf else 0.0, float(lo), float(hi))


def f32_counts(x: torch.Tensor, block: int = 32) -> F32Counts:
    """Histograms and moment sums of a float32 tensor (blocks of ``block`` along its last dim)."""
    k = _counts_kernels(x, torch.float32, block, "f32_counts")
    if k is None:
        return f32_counts_torch(x, block)
    x2, length = _rows(x)
    signed, binade, rel = np.zeros(NSIGNED, np.int64), np.zeros(NBINADE, np.int64), np.zeros(NREL, np.int64)
    sums = np.zeros(8, np.float64)
    vals = x2.reshape(-1).numpy()
    if vals.size:
        k["f32"](vals.view(np.int32), vals, length, block, signed, binade, rel, sums)
    else:
        sums[5:7] = (math.inf, -math.inf)
    return _f32_result(signed, binade, rel, *sums)


def f32_counts_torch(x: torch.Tensor, block: int = 32) -> F32Counts:
    x2, length = _rows(x.cpu())
    b = x2.view(torch.int32)
    a = b & 0x7FFFFFFF
    j = ((a - 1) >> 19) + 1  # 0 for a == 0 (arithmetic shift of -1)
    signed = torch.bincount((j + ((b >> 31) & NMAG)).reshape(-1), minlength=NSIGNED).numpy().astype(np.int64)
    binade = torch.bincount((a >> 23).reshape(-1), minlength=NBINADE).numpy().astype(np.int64)
    rel = _rel_torch(a, length, block, 19, 23) if x2.numel() else np.zeros(NREL, np.int64)
    v = x2.reshape(-1).double()
    fin = torch.isfinite(v)
    nan, inf = int(torch.isnan(v).sum()), int(torch.isinf(v).sum())
    f = v[fin]
    if not f.numel():
        return _f32_result(signed, binade, rel, 0, nan, inf, 0.0, 0.0, math.inf, -math.inf, 0.0)
    k = float(f[0])
    d = f - k
    return _f32_result(signed, binade, rel, f.numel(), nan, inf, float(d.sum()), float(d.square().sum()),
                       float(f.min()), float(f.max()), k)


# -- pairs: a quantized copy against its source -----------------------------------------------------------------
@dataclass
class PairSums:
    n: int  # elements where both are finite
    err_sq: float
    ref_sq: float
    q_sq: float
    dot: float
    max_err: float
    nonzero_ref: int  # finite non-zero elements of x
    flushed: int  # of those, how many q made zero


def pair_sums(q: torch.Tensor, x: torch.Tensor) -> PairSums:
    """Sums over the elements of ``q`` (a quantized copy) and ``x`` (its source), in float64."""
    if q.numel() != x.numel():
        raise ValueError(f"pair_sums: q has {q.numel()} elements but x has {x.numel()}")
    k = _kernels()
    if k is None or q.device.type != "cpu" or x.device.type != "cpu":
        return pair_sums_torch(q, x)
    if q.dtype != x.dtype or q.dtype not in (torch.bfloat16, torch.float32):
        q, x = q.float(), x.float()
    qa, lut = _flat_np(q)
    xa, _ = _flat_np(x)
    out = np.zeros(8, np.float64)
    k["pair"](qa, xa, lut, out)
    return PairSums(int(out[0]), *map(float, out[1:6]), int(out[6]), int(out[7]))


def pair_sums_torch(q: torch.Tensor, x: torch.Tensor) -> PairSums:
    qd, xd = q.detach().reshape(-1).double().cpu(), x.detach().reshape(-1).double().cpu()
    xfin = torch.isfinite(xd)
    nonzero = xfin & (xd != 0)
    ok = xfin & torch.isfinite(qd)
    qd, xd = qd[ok], xd[ok]
    e = qd - xd
    return PairSums(int(ok.sum()), float(e.square().sum()), float(xd.square().sum()), float(qd.square().sum()),
                    float((qd * xd).sum()), float(e.abs().max()) if e.numel() else 0.0, int(nonzero.sum()),
                    int((nonzero & (q.detach().reshape(-1).cpu() == 0)).sum()))


# -- capture statistics -----------------------------------------------------------------------------------------
def tensor_stats(x: torch.Tensor) -> np.ndarray | None:
    """The capture statistics of a CPU tensor as float64 [numel, nan, inf, zeros, min, max, sum, centred sumsq,
    amax, exponent histogram (N_EXP)], fxquant.capture.stats's layout; None when the kernels are unavailable
    (the caller then uses its torch path, which defines these numbers)."""
    k = _kernels()
    if k is None or x.device.type != "cpu":
        return None
    vals, lut = _flat_np(x)
    out, hist = np.zeros(10, np.float64), np.zeros(N_EXP, np.int64)
    k["stats"](vals if lut.size else vals.view(np.int32), vals, lut, out, hist)
    return np.concatenate([out[:9], hist.astype(np.float64)])


def warm_up() -> str:
    """Compile (or load from numba's cache) every kernel now; returns the backend in use."""
    k = _kernels()
    if k is not None:
        bf16_counts(torch.zeros(2, 3, dtype=torch.bfloat16))
        f32_counts(torch.zeros(2, 3))
        pair_sums(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16))
        pair_sums(torch.zeros(3), torch.zeros(3))
        tensor_stats(torch.zeros(3))
        tensor_stats(torch.zeros(3, dtype=torch.bfloat16))
    return backend()
