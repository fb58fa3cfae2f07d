"""Exact float32 bit arithmetic shared by every format's reference (FORMATS.md, "Vocabulary").

Exponents come from the float32 bit pattern, never from ``log2``; powers of two are built from bits and
only ever in the normal float32 range, so no step depends on how a device treats subnormal operands.
The Triton kernels in ``fxquant.kernels`` mirror these functions line for line.
"""
from __future__ import annotations

import torch

F32_MIN_NORMAL = 2.0**-126
F32_MAX = (2 - 2.0**-23) * 2.0**127
MASK32 = 0xFFFFFFFF
_HASH_MUL = 0x45D9F3B  # 73244475 < 2**27: products of 32-bit values stay below 2**59, exact in int64


def frexp_bits(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For finite ``a >= 0`` (float32): ``(e, m)`` with ``a == m * 2**e``, ``m`` in [1, 2), e int32.

    float32 subnormals are first scaled by 2**24 so their exponent is right. For ``a == 0`` the result is
    ``(-151, 1.0)``: callers mask zero themselves.
    """
    sub = a < F32_MIN_NORMAL
    a_n = torch.where(sub, a * 16777216.0, a)  # 2**24
    bits = a_n.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 - torch.where(sub, 24, 0).to(torch.int32)
    m = ((bits & 0x007FFFFF) | 0x3F800000).view(torch.float32)
    return e.to(torch.int32), m


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as float32, exactly, for int32 ``k`` in [-126, 127] (normal range only)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def pow2_wide(k: torch.Tensor, *, subnormal: bool = True) -> torch.Tensor:
    """2**k as float32, exactly, for int32 ``k`` in [-127, 127]: 2**-127 is the float32 subnormal 0x00400000.

    ``subnormal=False`` promises k > -127 (one op less: ``pow2``).
    """
    p = pow2(k)
    return torch.where(k == -127, 2.0**-127, p) if subnormal else p


def ufp(a: torch.Tensor) -> torch.Tensor:
    """2**floor(log2 a), the unit in the first place of float32 ``a`` in [2**-126, 2**104), by arithmetic alone.

    Rump's algorithm (S. M. Rump, "Ultimately fast accurate summation", SIAM J. Sci. Comput. 31(5), 2009,
    Algorithm 3.5) for float32: q = a * (2**23 + 1) and ufp = q - q * (1 - 2**-24), each step rounded to
    nearest. Every product is spelled as a product with a power of two (exact), so contracting a product and
    a sum into an FMA gives the same values. Compilers vectorise it, where reading the exponent field needs a
    float/int reinterpretation (Inductor's C++ does those through memory). NaN gives NaN.
    ``tests/test_formats_steps.py`` checks every float32 of one binade and both ends of every binade of the range
    (float32 arithmetic is scale-invariant away from underflow and overflow).
    """
    q = a * 8388608.0 + a  # a * (2**23 + 1), one rounding
    return q - (q - q * 2.0**-24)


def round_to_step(a: torch.Tensor, step: torch.Tensor, rounding: str, u: torch.Tensor | None) -> torch.Tensor:
    """Round ``a >= 0`` (float32) to a multiple of ``step`` (a power of two with ``a < 2**22 * step``, step * 2**-24
    a normal float32) per the rounding mode, by arithmetic alone: the same as ``round_integer(a / step) * step``.

    big = 2**23 steps: the float32 numbers in [big, 2 big) are exactly the multiples of ``step``, so the
    float32 sum a + big rounds a to the nearest multiple, ties to even, and subtracting big is exact. The other
    modes correct that nearest multiple t, comparing exact differences (|a - t| <= step / 2): ``ta`` moves a
    tie up, ``rz`` moves t down where it lies above a, ``sr`` moves the value toward zero up where
    u * step < a - down, i.e. u < the fractional part. Inf stays Inf, NaN NaN.
    """
    big = step * 8388608.0  # 2**23
    t = (a + big) - big  # nearest, ties to even
    if rounding == "rne":
        return t
    if rounding == "ta":
        return t + torch.where(a - t == step * 0.5, step, 0.0)
    down = t - torch.where(t > a, step, 0.0)
    if rounding == "rz":
        return down
    if rounding == "sr":
        if u is None:
            raise ValueError("stochastic rounding needs uniforms")
        return down + torch.where(u * step < a - down, step, 0.0)
    raise ValueError(f"unknown rounding {rounding!r}")  # pragma: no cover - guarded by option validation


def veltkamp(a: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Veltkamp's splitting of ``a >= 0`` (float32) with ``scale`` = 2**s (a power of two, per element or not):
    ``c = a * 2**s + a`` (an exact product, one rounding) and ``c - (c - a)``, which is ``a`` rounded to nearest, ties
    to even, on 24 - s significant bits (``round_nearest_bits``)."""
    c = a * scale + a
    return c - (c - a)


def away_from_ties(a: torch.Tensor, q: torch.Tensor, finer: torch.Tensor) -> torch.Tensor:
    """Round to nearest with ties away from zero, from ``q`` (``a >= 0`` rounded to nearest, ties to even) and ``finer``
    (``a`` rounded to nearest on the grid one bit finer): ``a`` is a midpoint exactly when ``finer`` leaves it
    unchanged and ``q`` does not; where ``q`` lies below such an ``a``, the other neighbour ``2a - q`` (exact)."""
    return torch.where((finer == a) & (q < a), a * 2.0 - q, q)


def round_nearest_bits(a: torch.Tensor, mbits: int, emin: int, emax: int, *, bounded: bool = False,
                       ties_away: bool = False) -> torch.Tensor:
    """``a >= 0`` (float32) rounded to nearest, ties to even, on the grid of ``mbits`` mantissa bits whose binades
    below 2**emin use emin's step, by arithmetic alone: ``round_to_step(a, ufp(clamp(a, 2**emin, 2**(emax + 1))) *
    2**-mbits, "rne")`` wherever that is at most 2**(emax + 1), and at least 2**(emax + 1) wherever it is more.

    From 2**emin up, Veltkamp's splitting (T. J. Dekker, "A floating-point technique for extending the available
    precision", Numer. Math. 18, 1971): with s = 23 - mbits, c = a * (2**s + 1) and c - (c - a) is ``a`` rounded to
    nearest on 24 - s = mbits + 1 significant bits, ties to even, in every binade alike (the operations are
    scale-invariant away from underflow and overflow; tests/test_formats_steps.py checks every float32 of one
    binade and both ends of every binade of the range). The product is spelled a * 2**s + a (an exact product, one
    rounding), so an FMA contraction gives the same value. Below 2**emin, adding and subtracting 2**23 of emin's
    steps rounds to that step. NaN gives NaN.

    Above 2**(emax + 1) the result only has to be at least 2**(emax + 1), more than the format's largest value
    (callers saturate it or overflow it to Inf), so ``a`` is clamped there first, which keeps c finite;
    ``bounded=True`` promises a <= 2**100 and leaves the clamp out. Six float32 operations and a select, where
    ``ufp``, the step and ``round_to_step`` take nine operations and two clamps.

    ``ties_away=True`` rounds ties away from zero instead (``away_from_ties``, with the same two roundings on the
    grid one bit finer: one bit more, or half the fixed step).
    """
    if not bounded:
        top = 2.0 ** (emax + 1)
        a = torch.where(a > top, top, a)  # NaN stays NaN
    hi = veltkamp(a, 2.0 ** (23 - mbits))
    big = 2.0 ** (emin - mbits + 23)
    lo = (a + big) - big
    small = a < 2.0**emin
    q = torch.where(small, lo, hi)
    if not ties_away:
        return q
    half_big = big * 0.5
    return away_from_ties(a, q, torch.where(small, (a + half_big) - half_big, veltkamp(a, 2.0 ** (22 - mbits))))


def mul_pow2(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``x * 2**k`` for int32 ``k`` in [-252, 252], as two multiplications by normal powers of two.

    When the exact product is a normal float32 both steps are exact; otherwise the second step rounds
    once (round-to-nearest-even), the same as a single correctly rounded multiplication.
    """
    k1 = torch.div(k, 2, rounding_mode="floor")
    return (x * pow2(k1)) * pow2(k - k1)


def fdiv(a: float | torch.Tensor, b: float | torch.Tensor) -> torch.Tensor:
    """The IEEE float32 quotient ``a / b`` (correctly rounded) for float32 ``a`` and ``b`` (at least one a tensor),
    on every device and under every compiler.

    On CPU that is float32 ``/`` itself: eager CPU division is IEEE, and so is Inductor's C++ (it keeps a
    division by a constant a division on CPU, and compiles without -freciprocal-math). Elsewhere it is
    ``fdiv_wide``.
    """
    t = a if isinstance(a, torch.Tensor) else b
    if t.device.type == "cpu":
        return a / b
    return fdiv_wide(a, b)


def fdiv_wide(a: float | torch.Tensor, b: float | torch.Tensor) -> torch.Tensor:
    """``fdiv`` as a float64 division rounded to float32, for devices and compilers whose float32 ``/`` is not
    IEEE division.

    Double rounding is innocuous for division when the wide format has at least 2p + 2 bits
    (53 >= 2 * 24 + 2), so this equals the float32 division. It stays exact where a backend rewrites
    divisions: CUDA's default float32 ``/`` in Triton is approximate (``div.full.f32``), and Inductor on CUDA
    multiplies by the reciprocal of a constant divisor. For the constant divisors fxquant uses (element max
    normals 448, 57344, 28, 7.5, 6, 127/64 and NVFP4's 2688 and 6, each o * 2**j with an odd o <= 127), a
    float64 product with the rounded reciprocal lies within 2**-52 relative of the exact quotient, while a
    quotient that is not itself a float32 midpoint (it never is: A / o is dyadic only when o divides A) lies
    at least 2**-32 relative from one, so rounding to float32 gives the same value
    (``tests/test_formats_lowering.py`` checks both forms).
    """
    if isinstance(b, torch.Tensor):
        b = b.to(torch.float64)
    if isinstance(a, torch.Tensor):
        a = a.to(torch.float64)
    return (a / b).to(torch.float32)


def nonfinite(a: torch.Tensor) -> torch.Tensor:
    """NaN or Inf, for float32 ``a >= 0`` or NaN (an amax): one comparison, as NaN compares false."""
    return ~(a <= F32_MAX)


def round_integer(r: torch.Tensor, rounding: str, u: torch.Tensor | None) -> torch.Tensor:
    """Round ``r >= 0`` (float32, < 2**24) to an integer-valued float32 per the rounding mode.

    ``rne``: nearest, ties to even; ``ta``: nearest, ties away from zero; ``rz``: toward zero;
    ``sr``: up with probability equal to the fractional part, using uniforms ``u`` in (0, 1).
    """
    if rounding == "rne":
        return torch.round(r)  # round half to even, exact for float32
    fl = torch.floor(r)
    frac = r - fl  # exact
    if rounding == "ta":
        up = frac >= 0.5
    elif rounding == "rz":
        return fl
    elif rounding == "sr":
        if u is None:
            raise ValueError("stochastic rounding needs uniforms")
        up = u < frac
    else:  # pragma: no cover - guarded by option validation
        raise ValueError(f"unknown rounding {rounding!r}")
    return fl + up  # out of place: compilers trace this function (fxquant.lowering)


def _mix32(h):
    """A 32-bit integer hash (three xorshift-multiply rounds) on uint32 values held in Python ints or int64
    tensors (the same operators, so both give the same numbers)."""
    h = ((h >> 16) ^ h) * _HASH_MUL & MASK32
    h = ((h >> 16) ^ h) * _HASH_MUL & MASK32
    return (h >> 16) ^ h


def seed_key(seed: int | torch.Tensor) -> int | torch.Tensor:
    """The per-call hash key derived from a seed: a Python int (any; its low 64 bits count), or a 0-dim int64
    tensor (a seed drawn inside a compiled graph, or a SymInt seed passed into one; no host sync), whose 64 bits
    count alike, a negative one's as its two's complement. The low word is
    hashed before the high word joins it, so seeds that differ only by swapping or moving bits between the two
    words give different keys."""
    return _mix32(_mix32(seed & MASK32) ^ ((seed >> 32) & MASK32))


def uniforms(numel: int, seed: int | torch.Tensor, device: torch.device, offset: int = 0) -> torch.Tensor:
    """Counter-based uniforms in (0, 1) for element indices offset..offset+numel-1, reproducible from ``seed``.

    u_i = (2 * (h_i >> 9) + 1) * 2**-24 with h_i = mix(mix((i mod 2**32) ^ key) ^ (i >> 32)): 23 random
    bits, odd numerators, so u is never 0 or 1 and is exact in float32.
    """
    key = seed_key(seed)
    i = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    h = _mix32(_mix32((i & MASK32) ^ key) ^ (i >> 32))
    return ((h >> 9) * 2 + 1).to(torch.float32) * (2.0**-24)
