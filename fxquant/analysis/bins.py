"""Fixed logarithmic bins over float32 bit patterns: the streaming sketch behind every histogram and quantile.

A value's bin comes from its float32 bits alone (no log, no division), so bins are exact and mergeable
by addition across tensors, processes and runs:

* **magnitude bins** ``j`` in ``0..4096``: ``j = ((bits & 0x7FFFFFFF) - 1) >> 19) + 1``. Bin 0 holds
  exact zeros; bin ``j >= 1`` holds magnitudes in ``(U(j-1), U(j)]`` where ``U(j)`` is the float32 whose
  bits are ``j << 19``: 16 bins per binade (the exponent and the top 4 mantissa bits). Every power of
  two and every value with at most 4 mantissa bits (448, 57344, 6, 7.5, 28, 40960...) is a bin edge, so
  counts of ``|x| > max_normal`` and ``|x| <= threshold`` read off the histogram are exact. Bins from
  4081 up hold NaNs; bin 4080 holds Inf and finite values above ``1.9375 * 2**127``.
* **signed bins** ``0..8193``: magnitude bin, plus 4097 for a set sign bit (so -0.0 is bin 4097).
* **binade histogram**: the exponent field (``bits >> 23``, 0..255) of every element.
* **block-relative bins**: an element's magnitude bin minus ``16 * E_b``, ``E_b`` the exponent field
  of its 32-element block's amax (all-zero blocks use 255). Shifting it by ``16 * (127 + emax)`` gives
  the element-domain bins of any MX format under the OCP ``floor`` scale rule, because the shared scale
  is a power of two (FORMATS.md, "MX block formats"). Zeros sit in a bin of their own.

bfloat16 tensors are binned from their 16-bit patterns with the same bins (their low 16 float32 bits
are zero). Quantiles interpolate linearly inside one bin: exact in rank, and within one bin in value,
i.e. a relative error of at most 1/16 = 6.25 % (zero exact). Float32 subnormals (< 2**-126) are binned
linearly, which only matters for formats whose thresholds lie that low (bf16).
"""
from __future__ import annotations

import math

import numpy as np
import torch

SUB = 16  # bins per binade
NMAG = 4097  # magnitude bins 0..4096
NSIGNED = 2 * NMAG
NAN_FIRST = 4081  # magnitude bins >= this are NaN
INF_BIN = 4080  # Inf (and finite values above 1.9375 * 2**127)
NBINADE = 256  # float32 exponent fields
REL_OFFSET = 255 * SUB  # block-relative bin r is stored at r + REL_OFFSET (r >= -4080 + 1 for non-zeros)
NREL = REL_OFFSET + NMAG + 1  # index NREL - 1 is the zero bin
REL_ZERO = NREL - 1
BLOCK = 32  # MX block size (every MX format in fxquant.formats uses 32)


def upper_edges() -> np.ndarray:
    """U(j) for magnitude bins j = 0..4096 (float64; U(0) = 0)."""
    bits = (np.arange(NMAG, dtype=np.int64) << 19).clip(max=0x7F800000).astype(np.uint32)
    return bits.view(np.float32).astype(np.float64)


_UPPER = upper_edges()


def mag_bin_of(value: float) -> int:
    """The magnitude bin holding ``|value|`` (a float32 value)."""
    a = int(np.array([abs(value)], dtype=np.float32).view(np.int32)[0])
    return 0 if a == 0 else ((a - 1) >> 19) + 1


def edge_index(value: float) -> int | None:
    """j with U(j) == value exactly, or None when value is not a bin edge."""
    j = mag_bin_of(value)
    return j if _UPPER[j] == abs(value) else None


# -- binning a tensor (float32 or bfloat16) ---------------------------------------------------------------
def _int_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(integer bit view, shift to magnitude bins, shift to the exponent field)."""
    if x.dtype == torch.bfloat16:
        return x.contiguous().view(torch.int16), 3, 7
    if x.dtype != torch.float32:
        x = x.float()
    return x.contiguous().view(torch.int32), 19, 23


def magnitude_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(signed bit view, magnitude bits, mag shift, exponent shift) of a float32/bf16 view of ``x``."""
    b, sh, esh = _int_view(x.reshape(-1))
    mask = 0x7FFF if b.dtype == torch.int16 else 0x7FFFFFFF
    return b, b & mask, sh, esh


def mag_bins(a: torch.Tensor, sh: int) -> torch.Tensor:
    """Magnitude bin of every element from its magnitude bits (a new tensor)."""
    j = a - 1
    j.bitwise_right_shift_(sh).add_(1)
    return j


def signed_hist(b: torch.Tensor, j: torch.Tensor) -> np.ndarray:
    """Signed histogram (NSIGNED bins) from the signed bit view and the magnitude bins."""
    sign = b.bitwise_right_shift(15 if b.dtype == torch.int16 else 31).bitwise_and_(NMAG)
    sign.add_(j)
    return torch.bincount(sign.reshape(-1), minlength=NSIGNED).numpy().astype(np.int64)


def binade_hist(a: torch.Tensor, esh: int) -> np.ndarray:
    return torch.bincount(a.bitwise_right_shift(esh).reshape(-1), minlength=NBINADE).numpy().astype(np.int64)


def block_relative_hist(a: torch.Tensor, j: torch.Tensor, esh: int, shape: tuple[int, ...], dim: int,
                        has_zeros: bool) -> np.ndarray:
    """Block-relative histogram (NREL bins) with 32-element blocks along ``dim`` of ``shape``."""
    length = shape[dim] if shape else 1
    if len(shape) > 1 and dim != len(shape) - 1:
        a = a.reshape(shape).movedim(dim, -1)
        j = j.reshape(shape).movedim(dim, -1)
    a2, j2 = a.reshape(-1, length), j.reshape(-1, length)
    pad = (-length) % BLOCK
    if pad:  # a short last block behaves as if padded with zeros (FORMATS.md); pads are removed below
        a2 = torch.nn.functional.pad(a2, (0, pad))
        j2 = torch.nn.functional.pad(j2, (0, pad))
    rows = a2.shape[0]
    nb = a2.shape[1] // BLOCK
    amax = a2.reshape(rows, nb, BLOCK).amax(dim=-1)
    eb = amax.bitwise_right_shift(esh).to(torch.int32)
    eb = torch.where(amax == 0, 255, eb)
    shift = (REL_OFFSET - SUB * eb).to(j2.dtype)  # fits int16: 0..4080
    rel = j2.reshape(rows, nb, BLOCK) + shift.unsqueeze(-1)  # < 4097 + 4080 + 1: fits int16
    if has_zeros or pad:
        rel = rel.masked_fill_(j2.reshape(rows, nb, BLOCK) == 0, REL_ZERO)
    h = torch.bincount(rel.reshape(-1), minlength=NREL).numpy().astype(np.int64)
    h[REL_ZERO] -= pad * rows
    return h


def bf16_magnitude_table() -> tuple[np.ndarray, np.ndarray]:
    """(float64 value, exponent field) of every bf16 magnitude pattern 0..32767."""
    pat = np.arange(1 << 15, dtype=np.uint32)
    with np.errstate(invalid="ignore"):  # NaN patterns
        vals = (pat << 16).view(np.float32).astype(np.float64)
    return vals, (pat >> 7).astype(np.int64)


# -- reading histograms ---------------------------------------------------------------------------------
def magnitude(signed: np.ndarray) -> np.ndarray:
    """Fold a signed histogram onto magnitude bins."""
    return signed[:NMAG] + signed[NMAG:]


def count_above(mag: np.ndarray, threshold: float) -> tuple[int, bool]:
    """(count of finite |x| > threshold, exact?) from magnitude bins."""
    j = mag_bin_of(threshold)
    exact = _UPPER[j] == threshold
    start = j + 1 if exact else j + 1  # bins wholly above; a non-edge threshold ignores its own bin
    return int(mag[start:INF_BIN].sum()), bool(exact)


def count_at_most(mag: np.ndarray, threshold: float) -> tuple[int, bool]:
    """(count of non-zero |x| <= threshold, exact?) from magnitude bins."""
    j = mag_bin_of(threshold)
    exact = _UPPER[j] == threshold
    stop = j + 1 if exact else j  # a non-edge threshold leaves out its own bin
    return int(mag[1:stop].sum()), bool(exact)


def element_domain(rel: np.ndarray, emax: int) -> np.ndarray:
    """Magnitude bins of the MX element values (floor scale, element exponent of max normal ``emax``).

    Element bin = relative bin + 16 * (127 + emax); bins falling off either end are clamped into the
    first non-zero / last finite bin. Zeros go to bin 0.
    """
    out = np.zeros(NMAG, dtype=np.int64)
    shift = SUB * (127 + emax) - REL_OFFSET
    lo = min(max(0, 1 - shift), REL_ZERO)  # relative bins landing in element bins [1, INF_BIN]
    hi = max(min(REL_ZERO, INF_BIN + 1 - shift), lo)
    out[lo + shift:hi + shift] = rel[lo:hi]
    out[1] += rel[:lo].sum()
    out[INF_BIN] += rel[hi:REL_ZERO].sum()
    out[0] += rel[REL_ZERO]
    return out


def quantiles(signed: np.ndarray, qs: tuple[float, ...]) -> dict[str, float | None]:
    """Quantiles from a signed histogram (NaN bins excluded), linear inside a bin."""
    neg_j = np.arange(NAN_FIRST - 1, 0, -1)
    pos_j = np.arange(1, NAN_FIRST)
    counts = np.concatenate([signed[NMAG + neg_j], [signed[0] + signed[NMAG]], signed[pos_j]]).astype(np.float64)
    lo = np.concatenate([-_UPPER[neg_j], [0.0], _UPPER[pos_j - 1]])
    hi = np.concatenate([-_UPPER[neg_j - 1], [0.0], _UPPER[pos_j]])
    total = counts.sum()
    if total == 0:
        return {f"q{q:g}": None for q in qs}
    cum = np.cumsum(counts)
    out: dict[str, float | None] = {}
    for q in qs:
        target = q * total
        i = min(int(np.searchsorted(cum, max(target, 0.5), side="left")), len(counts) - 1)
        before = cum[i] - counts[i]
        frac = min(max((target - before) / counts[i], 0.0), 1.0) if counts[i] else 0.0
        with np.errstate(invalid="ignore"):
            v = hi[i] if frac >= 1.0 else lo[i] + frac * (hi[i] - lo[i])
        out[f"q{q:g}"] = float(v) if math.isfinite(v) else None
    return out


def binade_of_value(v: float) -> float:
    """log2 of a magnitude bin's upper edge, for plotting."""
    return math.log2(v) if v > 0 else float("-inf")


def mag_bin_centres_log2() -> np.ndarray:
    """log2 of the geometric centre of each magnitude bin 1..4079 (bin 0 and non-finite bins excluded)."""
    lo = _UPPER[0:INF_BIN - 1].copy()
    hi = _UPPER[1:INF_BIN]
    lo[0] = hi[0] / 2
    return np.log2(np.sqrt(lo * hi))
