"""Triton device functions that mirror the float32 bit arithmetic of the reference, operation for operation.

Each function here has a twin in ``fxquant.formats`` and must compute the same float32 values:
``frexp_bits``/``pow2``/``mul_pow2``/``round_integer``/``uniforms`` mirror ``formats/_bits.py``;
``round_element`` mirrors ``ElementSpec.quantize`` (``formats/element.py``), generic over the element's
data passed as constexprs (``EMIN``, ``MBITS``, ``MAX_NORMAL``, ...). Rounding is arithmetic from the
bits: Triton's fp8 casts are never used (ARCHITECTURE.md trap 8), and the fp32 -> bf16 store rounds
from the bits too because the interpreter's cast truncates.

NaN and Inf are built from bit patterns; divisions that the reference performs go through
``tl.math.div_rn`` (IEEE round-to-nearest) so that the GPU does not substitute an approximate divide.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bits_to_f32(bits):
    """Reinterpret uint32 ``bits`` as float32."""
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def nan_like(y):
    """A float32 quiet NaN (0x7FC00000) of ``y``'s shape."""
    return bits_to_f32(tl.zeros_like(y).to(tl.uint32, bitcast=True) | 0x7FC00000)


@triton.jit
def load_f32(ptrs, mask):
    """Load fp32/bf16/fp16 values as float32, exactly (bf16 widened from its bits); 0 where masked."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if x.dtype == tl.bfloat16:
        out = bits_to_f32(x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)
    else:
        out = x.to(tl.float32)
    return out


@triton.jit
def store_from_f32(ptrs, y, mask):
    """Store float32 ``y`` in the pointer's dtype, rounding to nearest even like ``Tensor.to``.

    bf16: the round-to-nearest-even of c10::BFloat16 computed on the bits (NaN -> 0x7FC0); fp16: the
    IEEE cast (``cvt.rn`` on the GPU, numpy's correctly rounded cast in the interpreter).
    """
    if ptrs.dtype.element_ty == tl.bfloat16:
        yb = y.to(tl.uint32, bitcast=True)
        rounded = (yb + 0x7FFF + ((yb >> 16) & 1)) >> 16
        rounded = tl.where(y != y, 0x7FC0, rounded)
        tl.store(ptrs, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    elif ptrs.dtype.element_ty == tl.float16:
        tl.store(ptrs, y.to(tl.float16), mask=mask)
    else:
        tl.store(ptrs, y, mask=mask)


@triton.jit
def frexp_bits(a):
    """(e, m) with ``a == m * 2**e``, m in [1, 2), for finite ``a >= 0``; ``a == 0`` gives (-151, 1.0)."""
    sub = a < 1.1754943508222875e-38  # 2**-126: scale float32 subnormals into the normal range first
    a_n = tl.where(sub, a * 16777216.0, a)  # 2**24
    bits = a_n.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - tl.where(sub, 24, 0)
    m = ((bits & 0x007FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    return e, m


@triton.jit
def pow2(k):
    """2**k as float32, exactly, for int32 ``k`` in [-126, 127]."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def mul_pow2(x, k):
    """``x * 2**k`` for int32 ``k`` in [-252, 252] as two multiplications by normal powers of two."""
    k1 = k >> 1  # floor(k / 2): arithmetic shift of a signed int
    return (x * pow2(k1)) * pow2(k - k1)


@triton.jit
def round_integer(r, u, ROUNDING: tl.constexpr):
    """Round ``r >= 0`` (< 2**24) to an integer-valued float32: rne / ta / rz / sr (up when u < frac)."""
    fl = tl.floor(r)
    frac = r - fl  # exact
    if ROUNDING == "rne":
        half = fl * 0.5
        odd = tl.floor(half) != half
        up = (frac > 0.5) | ((frac == 0.5) & odd)
    elif ROUNDING == "ta":
        up = frac >= 0.5
    elif ROUNDING == "sr":
        up = u < frac
    else:  # rz: never up
        up = frac < 0.0
    return fl + up.to(tl.float32)


@triton.jit
def _mix32(h):
    """The reference's 32-bit hash round (uint32 arithmetic wraps exactly like ``* mul & 0xFFFFFFFF``)."""
    h = ((h >> 16) ^ h) * 0x45D9F3B
    h = ((h >> 16) ^ h) * 0x45D9F3B
    return (h >> 16) ^ h


@triton.jit
def uniforms(offs, seed_key):
    """Counter-based uniforms in (0, 1) for int64 flat indices ``offs`` (``_bits.uniforms``)."""
    lo = (offs & 0xFFFFFFFF).to(tl.uint32)
    hi = (offs >> 32).to(tl.uint32)
    key = seed_key.to(tl.uint32)  # i32 (< 2**31) or i64 (< 2**32): both keep the low 32 bits
    h = _mix32(_mix32(lo ^ key) ^ hi)
    return ((h >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def round_element(
    v,
    u,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    TAPERED: tl.constexpr,
    HAS_INF: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    OVERFLOW_INF: tl.constexpr,
    ROUNDING: tl.constexpr,
):
    """Round float32 ``v`` to the nearest element value, as ``ElementSpec.quantize`` does.

    Binade ``e`` is rounded on the grid of step ``2**(max(e, EMIN) - m(e))``; ``m(e)`` is ``MBITS``, or
    HiF8's tapered 3/2/1/0 bits when ``TAPERED``. Results above ``MAX_NORMAL`` saturate, or become Inf
    when ``OVERFLOW_INF`` (the wrapper sets it only for formats with Inf, saturate=False, not rz).
    """
    vb = v.to(tl.uint32, bitcast=True)
    sign = vb & 0x80000000
    finite = (vb & 0x7F800000) != 0x7F800000
    a0 = tl.where(finite, tl.abs(v), 0.0)
    e, m_a = frexp_bits(a0)
    e_eff = tl.maximum(e, EMIN)
    if TAPERED:
        ae = tl.abs(e_eff)
        mb = tl.where(ae <= 3, 3, tl.where(ae <= 7, 2, tl.where(ae <= 15, 1, 0)))
    else:
        mb = tl.zeros_like(e) + MBITS
    # r = a / 2**(e_eff - mb), exactly: a's mantissa times a power of two >= 2**-126.
    r = m_a * pow2(tl.maximum(e - e_eff + mb, -126))
    n = round_integer(r, u, ROUNDING)
    q = mul_pow2(n * pow2(-mb), e_eff)
    q = tl.where(a0 == 0.0, 0.0, q)
    over = q > MAX_NORMAL
    if OVERFLOW_INF:
        q = tl.where(over, bits_to_f32(tl.zeros_like(vb) + 0x7F800000), q)
    else:
        q = tl.where(over, MAX_NORMAL, q)
    out = bits_to_f32(q.to(tl.uint32, bitcast=True) | sign)  # copysign(q, v); q >= 0
    if not SIGNED_ZERO:
        out = tl.where(q == 0.0, 0.0, out)
    # Non-finite inputs: NaN stays NaN; +-Inf stays +-Inf with Inf in the format, else (signed) NaN.
    if HAS_INF:
        special = bits_to_f32(sign | 0x7F800000)
    else:
        special = bits_to_f32(sign | 0x7FC00000)
    special = tl.where(v != v, nan_like(v), special)
    return tl.where(finite, out, special)
