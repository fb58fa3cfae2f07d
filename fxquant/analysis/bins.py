"""Fixed logarithmic bins over float32 bit patterns: the streaming sketch behind every histogram and quantile.

A value's bin comes from its float32 bits alone (no log, no division), so bins are exact and mergeable
by addition across tensors, processes and runs:

* **magnitude bins** ``j`` in ``0..4096``: ``j = ((bits & 0x7FFFFFFF) - 1) >> 19) + 1``. Bin 0 holds
  exact zeros; bin ``j >= 1`` holds magnitudes in ``(U(j-1), U(j)]`` where ``U(j)`` is the float32 whose
  bits are ``j << 19``: 16 bins per binade (the exponent and the top 4 mantissa bits). Every power of
  two and every value with at most 4 mantissa bits (448, 57344, 6, 7.5, 28, 40960...) is a bin edge, so
  counts of ``|x| > max_normal`` and ``|x| <= threshold`` read off the histogram are exact. Bins from
  4081 up hold NaNs; bin 4080 holds Inf only; bin 4079 ends at float32's largest value instead of at
  ``1.9375 * 2**127`` (``U(4079)`` is 2**128 - 2**104): the finite values whose bits would put them in bin 4080
  beside Inf are counted there (``fold_top_finite``), so they count as finite, saturated and in quantiles.
* **signed bins** ``0..8193``: magnitude bin, plus 4097 for a set sign bit (so -0.0 is bin 4097).
* **binade histogram**: the exponent field (``bits >> 23``, 0..255) of every element.
* **block-relative bins**: an element's magnitude bin minus ``16 * E_b``, ``E_b`` the exponent field
  of its 32-element block's amax (all-zero blocks use 255). Shifting it by ``16 * (127 + emax)`` gives
  the element-domain bins of any MX format under the OCP ``floor`` scale rule, because the shared scale
  is a power of two (FORMATS.md, "MX block formats"). Zeros sit in a bin of their own (``REL_ZERO``); every
  element of a block holding a NaN or an Inf, which MX quantizes to NaN, in another (``REL_NONFINITE``).

The binning itself is one pass per tensor in fxquant.kernels.host (``f32_counts``; bfloat16 tensors are
counted per 16-bit pattern by ``bf16_counts`` and folded onto the same bins here, their low 16 float32
bits being zero). Quantiles interpolate linearly inside one bin: exact in rank, and within one bin in value,
i.e. a relative error of at most 1/16 = 6.25 % for normal float32 magnitudes (zero exact). Float32 subnormals
(< 2**-126) are binned linearly, 16 bins of width 2**-130: there a quantile is within 2**-130 in absolute value,
whatever its relative error.
"""
from __future__ import annotations

import math

import numpy as np

from fxquant.kernels.host import (  # noqa: F401  (re-exported)
    NBINADE, NMAG, NREL, NSIGNED, REL_NONFINITE, REL_OFFSET, REL_ZERO, SUB)

NAN_FIRST = 4081  # magnitude bins >= this are NaN
INF_BIN = 4080  # Inf
TOP_BIN = INF_BIN - 1  # the last finite bin: (U(4078), float32 max]
FLT_MAX = float(np.finfo(np.float32).max)
BLOCK = 32  # MX block size (every MX format in fxquant.formats uses 32)


def upper_edges() -> np.ndarray:
    """U(j) for magnitude bins j = 0..4096 (float64; U(0) = 0, U(TOP_BIN) = float32 max)."""
    bits = (np.arange(NMAG, dtype=np.int64) << 19).clip(max=0x7F800000).astype(np.uint32)
    edges = bits.view(np.float32).astype(np.float64)
    edges[TOP_BIN] = FLT_MAX
    return edges


_UPPER = upper_edges()


def mag_bin_of(value: float) -> int:
    """The magnitude bin holding ``|value|`` (a float32 value)."""
    a = int(np.array([abs(value)], dtype=np.float32).view(np.int32)[0])
    j = 0 if a == 0 else ((a - 1) >> 19) + 1
    return TOP_BIN if j == INF_BIN and a < 0x7F800000 else j


def fold_top_finite(signed: np.ndarray, top_finite_pos: int, top_finite_neg: int) -> np.ndarray:
    """A signed histogram binned by bits alone (finite values above U(4079) = 1.9375 * 2**127 in bin 4080, beside
    Inf) with those values moved into the last finite bin, as the module docstring defines the bins."""
    for base, n in ((0, top_finite_pos), (NMAG, top_finite_neg)):
        if n:
            signed[base + INF_BIN] -= n
            signed[base + TOP_BIN] += n
    return signed


def edge_index(value: float) -> int | None:
    """j with U(j) == value exactly, or None when value is not a bin edge."""
    j = mag_bin_of(value)
    return j if _UPPER[j] == abs(value) else None


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
    """(count of finite |x| > threshold, exact?) from magnitude bins. A threshold that is no bin edge (MXINT8's
    127/64, fp16's 65504) gives an upper bound: its own bin, which holds values on both sides, counts whole."""
    j = mag_bin_of(threshold)
    exact = _UPPER[j] == threshold
    start = j + 1 if exact else j
    return int(mag[start:INF_BIN].sum()), bool(exact)


def count_at_most(mag: np.ndarray, threshold: float) -> tuple[int, bool]:
    """(count of non-zero |x| <= threshold, exact?) from magnitude bins; an upper bound (the threshold's own
    bin counted whole) when the threshold is no bin edge."""
    j = mag_bin_of(threshold)
    exact = _UPPER[j] == threshold
    return int(mag[1:j + 1].sum()), bool(exact)


def element_domain(rel: np.ndarray, emax: int) -> np.ndarray:
    """Magnitude bins of the MX element values (floor scale, element exponent of max normal ``emax``).

    Element bin = relative bin + 16 * (127 + emax); bins falling off either end are clamped into the
    first non-zero / last finite bin. Zeros go to bin 0. The elements of blocks holding a NaN or an Inf
    (``rel[REL_NONFINITE]``) are left out.
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
    """Quantiles from a signed histogram (NaN bins excluded), linear inside a bin; a rank in the bin of +Inf or
    -Inf gives that infinity (written "inf" / "-inf" in JSON)."""
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
        if math.isinf(hi[i]) or math.isinf(lo[i]):  # the bin of +Inf (or -Inf): the quantile is that infinity
            v = hi[i] if hi[i] > 0 else lo[i]
        else:
            v = hi[i] if frac >= 1.0 else lo[i] + frac * (hi[i] - lo[i])
        out[f"q{q:g}"] = float(v)
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
