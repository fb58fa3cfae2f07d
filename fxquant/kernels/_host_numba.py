"""The numba kernels behind fxquant.kernels.host (imported only when numba is there; host.py documents them
and holds their pure-torch twins). Module-level functions, so that numba's on-disk cache (``cache=True``)
finds them again in the next process instead of compiling them anew."""
from __future__ import annotations

import math

import numba
import numpy as np
from numba.core import types
from numba.extending import overload

from fxquant.kernels.host import EXP_MIN, N_EXP, NMAG, REL_NONFINITE, REL_OFFSET, REL_ZERO, SUB


jit = numba.njit(cache=True, nogil=True, boundscheck=False)


def load(a, i, lut):  # element i of ``a`` as float64: bf16 patterns (uint16) through ``lut``
    raise NotImplementedError  # only its numba overload below runs


@overload(load, inline="always")
def _load(a, i, lut):
    if a.dtype == types.uint16:
        return lambda a, i, lut: np.float64(lut[a[i]])
    return lambda a, i, lut: np.float64(a[i])


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def moment(x, k, s1, s2, nf, lo, hi):
    """One finite value into the shifted sums (shift k), the count and the extrema."""
    d = x - k
    return s1 + d, s2 + d * d, nf + 1, min(lo, x), max(hi, x)


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def bf16_block(u, i0, i1, hist, rel):
    m = 0
    for i in range(i0, i1):
        v = u[i]
        hist[v] += 1
        m = max(m, v & 0x7FFF)
    if m >= 0x7F80:  # a NaN or an Inf in the block: MX makes the whole block NaN
        rel[REL_NONFINITE] += i1 - i0
        return
    sh = REL_OFFSET - SUB * ((m >> 7) if m else 255)
    for i in range(i0, i1):
        a = np.int32(u[i] & 0x7FFF)
        rel[((a - 1) >> 3) + 1 + sh if a else REL_ZERO] += 1


@jit
def bf16_counts_nb(u, length, block, hist, rel):  # u: uint16 [rows * length]
    if block == 32 and length % 32 == 0:  # whole MX blocks: one flat loop, fixed trip counts
        for b in range(u.shape[0] // 32):
            bf16_block(u, b * 32, b * 32 + 32, hist, rel)
        return
    for base in range(0, u.shape[0], length):
        for b0 in range(base, base + length, block):
            bf16_block(u, b0, min(b0 + block, base + length), hist, rel)


inl = numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")


@inl
def f32_block(bits, vals, i0, i1, signed, binade, rel, acc, k):
    # acc = (n_finite, nan, inf, shifted sum, shifted sum of squares, min, max), returned updated
    nf, nan, inf, s1, s2, lo, hi = acc
    m = 0
    for i in range(i0, i1):
        w = np.int64(bits[i]) & 0xFFFFFFFF
        a = w & 0x7FFFFFFF
        signed[(((a - 1) >> 19) + 1 if a else 0) + (NMAG if w >> 31 else 0)] += 1
        binade[a >> 23] += 1
        m = max(m, a)
    sh = REL_OFFSET - SUB * ((m >> 23) if m else 255)
    nonfinite_block = m >= 0x7F800000  # a NaN or an Inf in the block: MX makes the whole block NaN
    for i in range(i0, i1):
        a = np.int64(bits[i]) & 0x7FFFFFFF
        rel[REL_NONFINITE if nonfinite_block else (((a - 1) >> 19) + 1 + sh if a else REL_ZERO)] += 1
        if a < 0x7F800000:
            s1, s2, nf, lo, hi = moment(np.float64(vals[i]), k, s1, s2, nf, lo, hi)
        elif a == 0x7F800000:
            inf += 1
        else:
            nan += 1
    return nf, nan, inf, s1, s2, lo, hi


@jit
def f32_counts_nb(bits, vals, length, block, signed, binade, rel, sums):
    # sums <- [n_finite, nan, inf, shifted sum, shifted sum of squares, min, max, shift]
    k = 0.0  # the shift: the first finite value (keeps the one-pass variance stable)
    for i in range(vals.shape[0]):
        if math.isfinite(vals[i]):
            k = np.float64(vals[i])
            break
    acc = (0, 0, 0, 0.0, 0.0, np.inf, -np.inf)
    if block == 32 and length % 32 == 0:  # whole MX blocks: one flat loop, fixed trip counts
        for b in range(vals.shape[0] // 32):
            acc = f32_block(bits, vals, b * 32, b * 32 + 32, signed, binade, rel, acc, k)
    else:
        for base in range(0, vals.shape[0], length):
            for b0 in range(base, base + length, block):
                acc = f32_block(bits, vals, b0, min(b0 + block, base + length), signed, binade, rel, acc, k)
    nf, nan, inf, s1, s2, lo, hi = acc
    sums[0], sums[1], sums[2], sums[3], sums[4], sums[5], sums[6], sums[7] = nf, nan, inf, s1, s2, lo, hi, k


@jit
def pair_nb(q, x, lut, out):
    # out: [n_ok, err_sq, ref_sq, q_sq, dot, max_err, nonzero_ref, flushed]; lut decodes uint16 (bf16) inputs
    n = 0
    e2 = 0.0
    r2 = 0.0
    q2 = 0.0
    dot = 0.0
    mx = 0.0
    nz = 0
    fl = 0
    for i in range(x.shape[0]):
        qv = load(q, i, lut)
        xv = load(x, i, lut)
        xfin = math.isfinite(xv)
        if xfin and xv != 0.0:
            nz += 1
            if qv == 0.0:
                fl += 1
        if xfin and math.isfinite(qv):
            n += 1
            e = qv - xv
            e2 += e * e
            r2 += xv * xv
            q2 += qv * qv
            dot += qv * xv
            if abs(e) > mx:
                mx = abs(e)
    out[0] = n
    out[1] = e2
    out[2] = r2
    out[3] = q2
    out[4] = dot
    out[5] = mx
    out[6] = nz
    out[7] = fl


def exponent(b):  # floor(log2|x|) of a finite non-zero element from its bit pattern (bf16 or float32)
    raise NotImplementedError  # only its numba overload below runs


@overload(exponent, inline="always")
def _exponent(b):
    mbits = 7 if b == types.uint16 else 23

    def impl(b):
        w = np.int64(b) & ((1 << (mbits + 9)) - 1)
        field = (w >> mbits) & 0xFF
        if field:
            return field - 127
        mant = w & ((1 << mbits) - 1)
        e = -126 - mbits  # subnormal: the weight of mantissa bit 0, then up to the leading bit
        while mant > 1:
            mant >>= 1
            e += 1
        return e
    return impl


@jit
def stats_nb(bits, vals, lut, out, hist):
    # out <- [numel, nan, inf, zeros, min, max, sum, centred sumsq, amax, n_finite]; hist: N_EXP exponents
    n = bits.shape[0]
    k = 0.0
    for i in range(n):
        x = load(vals, i, lut)
        if math.isfinite(x):
            k = x
            break
    nan = inf = zeros = nf = 0
    lo, hi, s1, s2, amax = np.inf, -np.inf, 0.0, 0.0, 0.0
    for i in range(n):
        x = load(vals, i, lut)
        if not math.isfinite(x):
            if math.isnan(x):
                nan += 1
            else:
                inf += 1
            continue
        if x == 0.0:
            zeros += 1
        else:
            hist[min(max(exponent(bits[i]) - EXP_MIN, 0), N_EXP - 1)] += 1
        s1, s2, nf, lo, hi = moment(x, k, s1, s2, nf, lo, hi)
        amax = max(amax, abs(x))
    out[0] = n
    out[1] = nan
    out[2] = inf
    out[3] = zeros
    out[4] = lo if nf else 0.0
    out[5] = hi if nf else 0.0
    out[6] = k * nf + s1
    out[7] = s2 - s1 * s1 / nf if nf else 0.0
    out[8] = amax
    out[9] = nf
