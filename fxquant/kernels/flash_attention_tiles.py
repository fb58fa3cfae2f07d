"""Triton device functions of the flash-attention kernels: quantize a 2-D tile per an operand code, round to
the I/O dtype, and the GEMM of two quantized tiles.

``quant_tile(x, AXIS, CODE)`` equals ``TensorQuant.quantize`` of the same tile along ``AXIS`` (1: along
the columns, 0: along the rows) for the formats ``flash_attention_spec.operand_code`` accepts; it reuses
the quantize kernels' device functions (``round_element``, ``_mx_scale_exponent``, ``mul_pow2``), so the
element rounding is the reference's bit for bit. MX tiles are reshaped to ``[.., 32, ..]`` blocks; a
tile size along the blocked axis must be a multiple of 32 (``FlashBlocks.check``), and padding (masked
loads give 0) is the reference's zero-padded short block.

Element data are literals below, one branch per ``ELEMENT_TABLE`` entry (a test checks them against
``launch.element_constexprs``): an operand is one integer constexpr instead of twelve.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fxquant.kernels._primitives import mul_pow2, nan_like, round_element
from fxquant.kernels._quantize import _mx_scale_exponent

# ELEMENT_TABLE order: E4M3, E5M2, E3M2, E2M3, E2M1, INT8, HIF8, BF16, FP16.


@triton.jit
def _round_elem(v, ELEM: tl.constexpr, ROUNDING: tl.constexpr, OVF: tl.constexpr):
    """``round_element`` of element format ``ELEMENT_TABLE[ELEM]``; arguments: EMIN, MBITS, MAX_NORMAL,
    TAPERED, HAS_INF, SIGNED_ZERO."""
    if ELEM == 0:
        y = round_element(v, v, -6, 3, 448.0, False, False, True, OVF, ROUNDING)
    elif ELEM == 1:
        y = round_element(v, v, -14, 2, 57344.0, False, True, True, OVF, ROUNDING)
    elif ELEM == 2:
        y = round_element(v, v, -2, 2, 28.0, False, False, True, OVF, ROUNDING)
    elif ELEM == 3:
        y = round_element(v, v, 0, 3, 7.5, False, False, True, OVF, ROUNDING)
    elif ELEM == 4:
        y = round_element(v, v, 0, 1, 6.0, False, False, True, OVF, ROUNDING)
    elif ELEM == 5:
        y = round_element(v, v, 0, 6, 1.984375, False, False, False, OVF, ROUNDING)
    elif ELEM == 6:
        y = round_element(v, v, -22, 3, 32768.0, True, True, False, OVF, ROUNDING)
    elif ELEM == 7:
        y = round_element(v, v, -126, 7, 3.3895313892515355e+38, False, True, True, OVF, ROUNDING)
    else:
        y = round_element(v, v, -14, 10, 65504.0, False, True, True, OVF, ROUNDING)
    return y


@triton.jit
def _round_code(v, ELEM: tl.constexpr, RND: tl.constexpr, OVF: tl.constexpr):
    """Element rounding with the rounding mode as its ``ROUNDINGS`` index (rne, ta, rz)."""
    if RND == 0:
        y = _round_elem(v, ELEM, "rne", OVF)
    elif RND == 1:
        y = _round_elem(v, ELEM, "ta", OVF)
    else:
        y = _round_elem(v, ELEM, "rz", OVF)
    return y


@triton.jit
def _mx_exp_mode(amax, ELEM: tl.constexpr, MODE: tl.constexpr):
    """``_mx_scale_exponent`` of MX element ``ELEM``: arguments ELEM_EMAX, MANT_SCALE (2**mbits), MAX_NORMAL."""
    if ELEM == 0:
        s = _mx_scale_exponent(amax, MODE, 8, 8.0, 448.0)
    elif ELEM == 1:
        s = _mx_scale_exponent(amax, MODE, 15, 4.0, 57344.0)
    elif ELEM == 2:
        s = _mx_scale_exponent(amax, MODE, 4, 4.0, 28.0)
    elif ELEM == 3:
        s = _mx_scale_exponent(amax, MODE, 2, 8.0, 7.5)
    elif ELEM == 4:
        s = _mx_scale_exponent(amax, MODE, 2, 2.0, 6.0)
    else:
        s = _mx_scale_exponent(amax, MODE, 0, 64.0, 1.984375)
    return s


@triton.jit
def _mx_exp(amax, ELEM: tl.constexpr, SMODE: tl.constexpr):
    """The shared exponent with the scale mode as its ``SCALE_MODES`` index (floor, ceil, even, rceil)."""
    if SMODE == 0:
        s = _mx_exp_mode(amax, ELEM, "floor")
    elif SMODE == 1:
        s = _mx_exp_mode(amax, ELEM, "ceil")
    elif SMODE == 2:
        s = _mx_exp_mode(amax, ELEM, "even")
    else:
        s = _mx_exp_mode(amax, ELEM, "rceil")
    return s


@triton.jit
def _mx_blocks(xb, AX: tl.constexpr, ELEM: tl.constexpr, RND: tl.constexpr, SMODE: tl.constexpr):
    """MX-quantize a 3-D tile whose axis ``AX`` holds the 32 elements of each block (``_quantize_mx_kernel``)."""
    finite = (xb.to(tl.uint32, bitcast=True) & 0x7F800000) != 0x7F800000
    bad = tl.max(tl.where(finite, 0, 1), axis=AX) > 0  # a NaN or Inf in the block
    amax = tl.where(bad, 0.0, tl.max(tl.where(finite, tl.abs(xb), 0.0), axis=AX))
    s = _mx_exp(amax, ELEM, SMODE)
    bad = tl.expand_dims(bad | (s > 127), AX)
    s = tl.expand_dims(tl.minimum(tl.maximum(s, -127), 127), AX)
    scaled = tl.where(bad, 0.0, mul_pow2(xb, -s))
    p = _round_code(scaled, ELEM, RND, False)
    y = mul_pow2(p, s)
    return tl.where(bad, nan_like(y), y)


@triton.jit
def quant_tile(x, AXIS: tl.constexpr, CODE: tl.constexpr):
    """Fake-quantize the float32 tile ``x`` [R, C] per operand code ``CODE``, MX blocks along ``AXIS``."""
    KIND: tl.constexpr = CODE % 4
    ELEM: tl.constexpr = (CODE // 4) % 16
    RND: tl.constexpr = (CODE // 64) % 4
    SMODE: tl.constexpr = (CODE // 256) % 8
    OVF: tl.constexpr = CODE // 2048
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    if KIND == 0:
        y = x
    elif KIND == 1:
        y = _round_code(x, ELEM, RND, OVF)
    elif AXIS == 1:
        y = tl.reshape(_mx_blocks(tl.reshape(x, (R, C // 32, 32)), 2, ELEM, RND, SMODE), (R, C))
    else:
        y = tl.reshape(_mx_blocks(tl.reshape(x, (R // 32, 32, C)), 1, ELEM, RND, SMODE), (R, C))
    return y


@triton.jit
def round_io(x, IO: tl.constexpr):
    """Round float32 ``x`` to the I/O dtype and back (0 fp32, 1 bf16 with c10's RNE on the bits, 2 fp16),
    what an unquantized P or dS becomes before its GEMM (as ``p.to(q.dtype)``)."""
    if IO == 1:
        xb = x.to(tl.uint32, bitcast=True)
        r = ((xb + 0x7FFF + ((xb >> 16) & 1)) >> 16) << 16
        y = tl.where(x != x, x, r.to(tl.float32, bitcast=True))
    elif IO == 2:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def operand(x, AXIS: tl.constexpr, CODE: tl.constexpr, IO: tl.constexpr):
    """A computed GEMM operand (P, dS): quantized per ``CODE``, or rounded to the I/O dtype when not quantized."""
    if CODE == 0:
        y = round_io(x, IO)
    else:
        y = quant_tile(x, AXIS, CODE)
    return y


@triton.jit
def mm(a, b, BF16: tl.constexpr):
    """``a @ b`` with float32 accumulation. ``BF16``: both operands hold bf16 values exactly, so the GPU feeds
    the tensor cores bf16 (exact products); otherwise an IEEE float32 dot (also under the interpreter,
    whose bf16 dot is broken, ARCHITECTURE.md trap 8)."""
    if BF16:
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    else:
        c = tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)
    return c
