"""The Triton quantize kernels: one per format family, one pass each (load tile, block amax, scale, round,
write), generic over the element format's data passed as constexprs.

Every kernel works on the reference's canonical layout (``formats/base.py``): ``dim`` moved last,
contiguous, ``[n_rows, n_cols]``; stochastic rounding draws its uniform for flat index
``row * n_cols + col`` of that layout, so kernel and reference consume the same random numbers.
- ``_quantize_element_kernel``: FP8 / HiF8 / bf16 / fp16 element-wise, optional per-tensor power-of-two
  scale 2**k (k from a small amax pre-pass, loaded from ``k_ptr``) -- ``formats/scalar.py``.
- ``_quantize_mx_kernel``: 32-element blocks, E8M0 scale per the scale mode -- ``formats/mx.py``.
- ``_quantize_nvfp4_kernel``: 16-element blocks, E4M3 block scale, float32 tensor scale from the
  tensor amax at ``amax_ptr`` -- ``formats/nvfp4.py``. With ``HAS_BLOCK_AMAX`` (``block_2d``: 16x16 tiles)
  each block's scale comes from the amax at ``block_amax_ptr`` (float32, one per block of the canonical
  layout, flat block index ``row * n_blocks_row + j``: its tile's amax, from the launcher's pre-pass) instead
  of the block's own.
The block kernels process ``BLOCK_B`` blocks per program as a ``[BLOCK_B, BLOCK_SIZE]`` tile.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fxquant.kernels._primitives import (
    frexp_bits,
    load_f32,
    mul_pow2,
    nan_like,
    round_element,
    round_integer,
    store_from_f32,
    uniforms,
)


@triton.jit(do_not_specialize=["seed_key"])  # a key of 1 must stay a runtime int
def _quantize_element_kernel(
    x_ptr,
    y_ptr,
    k_ptr,
    n_elements,
    seed_key,
    BLOCK: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROUNDING: tl.constexpr,
    OVERFLOW_INF: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    TAPERED: tl.constexpr,
    HAS_INF: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    v = load_f32(x_ptr + offs, mask)
    if HAS_SCALE:
        k = tl.load(k_ptr)
        v = mul_pow2(v, k)
    if ROUNDING == "sr":
        u = uniforms(offs, seed_key)
    else:
        u = v  # unused
    q = round_element(v, u, EMIN, MBITS, MAX_NORMAL, TAPERED, HAS_INF, SIGNED_ZERO, OVERFLOW_INF, ROUNDING)
    if HAS_SCALE:
        q = mul_pow2(q, -k)
    store_from_f32(y_ptr + offs, q, mask)


@triton.jit
def _block_ids(n_rows, n_blocks_row, BLOCK_B: tl.constexpr):
    """Flat indices ``[BLOCK_B]`` of this program's blocks (``row * n_blocks_row + j``), and which exist."""
    offs_b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    return offs_b, offs_b < n_rows * n_blocks_row


@triton.jit
def _block_tile(n_rows, n_cols, n_blocks_row, BLOCK_B: tl.constexpr, BLOCK_SIZE: tl.constexpr, EVEN_COLS: tl.constexpr):
    """Flat element offsets ``[BLOCK_B, BLOCK_SIZE]`` of this program's blocks, and their mask."""
    offs_b, valid = _block_ids(n_rows, n_blocks_row, BLOCK_B)
    offs_e = tl.arange(0, BLOCK_SIZE)
    if EVEN_COLS:  # rows hold whole blocks: block j covers elements [j * BLOCK_SIZE, (j + 1) * BLOCK_SIZE)
        offs = offs_b[:, None] * BLOCK_SIZE + offs_e[None, :]
        mask = valid[:, None] & (offs_e[None, :] < BLOCK_SIZE)
    else:  # the last block of every row is short; its missing elements read as 0
        row = offs_b // n_blocks_row
        cols = (offs_b - row * n_blocks_row)[:, None] * BLOCK_SIZE + offs_e[None, :]
        offs = row[:, None] * n_cols + cols
        mask = valid[:, None] & (cols < n_cols)
    return offs, mask


@triton.jit
def _mx_scale_exponent(
    amax, SCALE_MODE: tl.constexpr, ELEM_EMAX: tl.constexpr, MANT_SCALE: tl.constexpr, MAX_NORMAL: tl.constexpr
):
    """The unclamped shared exponent s of each block (``mx.mx_scale_exponent``), finite ``amax >= 0``."""
    e, m = frexp_bits(amax)
    if SCALE_MODE == "floor":
        s = e - ELEM_EMAX
    elif SCALE_MODE == "ceil":
        s = e + (m != 1.0).to(tl.int32) - ELEM_EMAX
    elif SCALE_MODE == "even":
        n = round_integer(m * MANT_SCALE, m, "rne")  # m * 2**mbits, rounded to nearest even
        s = e + (n == 2.0 * MANT_SCALE).to(tl.int32) - ELEM_EMAX
    else:  # rceil: d = amax / max_normal (IEEE float32 division), s = ceil(log2 d) from d's bits
        ed, md = frexp_bits(tl.math.div_rn(amax, MAX_NORMAL))
        s = ed + (md != 1.0).to(tl.int32)
    return s


@triton.jit(do_not_specialize=["seed_key"])  # a key of 1 must stay a runtime int
def _quantize_mx_kernel(
    x_ptr,
    y_ptr,
    n_rows,
    n_cols,
    n_blocks_row,
    seed_key,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    EVEN_COLS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    ROUNDING: tl.constexpr,
    ELEM_EMAX: tl.constexpr,
    MANT_SCALE: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    TAPERED: tl.constexpr,
    HAS_INF: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
):
    offs, mask = _block_tile(n_rows, n_cols, n_blocks_row, BLOCK_B, BLOCK_SIZE, EVEN_COLS)
    x = load_f32(x_ptr + offs, mask)
    finite = (x.to(tl.uint32, bitcast=True) & 0x7F800000) != 0x7F800000
    bad = tl.max(tl.where(finite, 0, 1), axis=1) > 0  # a NaN or Inf in the block
    amax = tl.where(bad, 0.0, tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1))
    s = _mx_scale_exponent(amax, SCALE_MODE, ELEM_EMAX, MANT_SCALE, MAX_NORMAL)
    bad = bad | (s > 127)
    s = tl.minimum(tl.maximum(s, -127), 127)[:, None]
    scaled = tl.where(bad[:, None], 0.0, mul_pow2(x, -s))
    if ROUNDING == "sr":
        u = uniforms(offs, seed_key)
    else:
        u = scaled  # unused
    p = round_element(scaled, u, EMIN, MBITS, MAX_NORMAL, TAPERED, HAS_INF, SIGNED_ZERO, False, ROUNDING)
    y = mul_pow2(p, s)
    y = tl.where(bad[:, None], nan_like(y), y)
    store_from_f32(y_ptr + offs, y, mask)


@triton.jit
def _clamp(v, lo, hi):
    """``torch.clamp`` for float32: NaN passes through (``tl.maximum`` would drop it on the GPU)."""
    return tl.where(v < lo, lo, tl.where(v > hi, hi, v))


@triton.jit(do_not_specialize=["seed_key"])  # a key of 1 must stay a runtime int
def _quantize_nvfp4_kernel(
    x_ptr,
    y_ptr,
    amax_ptr,
    block_amax_ptr,
    n_rows,
    n_cols,
    n_blocks_row,
    seed_key,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    EVEN_COLS: tl.constexpr,
    HAS_BLOCK_AMAX: tl.constexpr,
    ROUNDING: tl.constexpr,
    GLOBAL_DIVISOR: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    HAS_INF: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    S_EMIN: tl.constexpr,
    S_MBITS: tl.constexpr,
    S_MAX_NORMAL: tl.constexpr,
    S_MIN_SUBNORMAL: tl.constexpr,
    S_HAS_INF: tl.constexpr,
    S_SIGNED_ZERO: tl.constexpr,
):
    # Per-tensor scale g = amax / (448 * 6); zero amax (or g underflowing, or 1 / g overflowing) gives
    # zeros, non-finite NaNs.
    amax_t = tl.load(amax_ptr)
    bad = (amax_t.to(tl.uint32, bitcast=True) & 0x7F800000) == 0x7F800000
    g = tl.math.div_rn(tl.where(bad, 1.0, amax_t), GLOBAL_DIVISOR)
    inv_g = tl.math.div_rn(1.0, g)
    zero = (g == 0.0) | (inv_g == float("inf"))
    g = tl.where(zero, 1.0, g)
    inv_g = tl.where(zero, 1.0, inv_g)

    offs, mask = _block_tile(n_rows, n_cols, n_blocks_row, BLOCK_B, BLOCK_SIZE, EVEN_COLS)
    x = load_f32(x_ptr + offs, mask)
    if HAS_BLOCK_AMAX:  # block_2d: each block's amax is its 16x16 tile's, from the pre-pass
        offs_b, valid = _block_ids(n_rows, n_blocks_row, BLOCK_B)
        amax_b = tl.load(block_amax_ptr + offs_b, mask=valid, other=0.0)
    else:
        amax_b = tl.max(tl.abs(x), axis=1)
    amax_b = tl.where(bad, 0.0, amax_b)
    sb = _clamp(tl.math.div_rn(tl.math.div_rn(amax_b, MAX_NORMAL), g), S_MIN_SUBNORMAL, S_MAX_NORMAL)
    b = round_element(sb, sb, S_EMIN, S_MBITS, S_MAX_NORMAL, False, S_HAS_INF, S_SIGNED_ZERO, False, "rne")
    inv = tl.math.div_rn(inv_g, b)[:, None]
    v = _clamp(x * inv, -MAX_NORMAL, MAX_NORMAL)
    if ROUNDING == "sr":
        u = uniforms(offs, seed_key)
    else:
        u = v  # unused
    p = round_element(v, u, EMIN, MBITS, MAX_NORMAL, False, HAS_INF, SIGNED_ZERO, False, ROUNDING)
    y = p * (g * b)[:, None]
    y = tl.where(zero, 0.0, tl.where(bad, nan_like(y), y))
    store_from_f32(y_ptr + offs, y, mask)
