"""``flash_quantized_attention``: quantized flash attention (forward + backward) as one autograd function.

    >>> from fxquant.kernels.flash_attention import flash_quantized_attention
    >>> o = flash_quantized_attention(q, k, v, is_causal=True, aq=scheme_attention_quant)

q [B, Hq, Lq, d], k [B, Hk, Lk, d], v [B, Hk, Lk, dv] (Hq a multiple of Hk: GQA). Dispatch
(``FlashImpl.AUTO``): the Triton kernels on CUDA tensors, and on CPU tensors when the kernels run in
Triton's interpreter (``TRITON_INTERPRET=1`` before they are first imported, as in the tests); otherwise
the torch reference ``fxquant.qfunctions.flash_reference``, which has the same semantics
(docs/flash_attention.md). Dropout and arbitrary masks are not offered: ``quantized_sdpa`` has them.

Triton is imported lazily (first launch), so a test can set ``TRITON_INTERPRET=1`` before it.
"""
from __future__ import annotations

import enum
import math

import torch

from fxquant.kernels.flash_attention_spec import Axis, FlashBlocks, FlashQuant, Operand, bf16_exact
from fxquant.schemes.model import AttentionQuant

IO_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class FlashImpl(str, enum.Enum):
    AUTO = "auto"  # Triton where it can run (CUDA, or CPU under the interpreter), else the reference
    TRITON = "triton"
    REFERENCE = "reference"


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device`` in this process."""
    from fxquant import kernels

    if not kernels.available():
        return False
    from fxquant.kernels import flash_attention_launch as fl

    interp = fl.interpreted()
    return (device.type == "cuda" and not interp) or (device.type == "cpu" and interp)


def check_inputs(q: object, k: object, v: object, scale: object) -> tuple[int, float]:
    """Validate shapes and dtypes; returns (GQA group size, softmax scale)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_quantized_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"flash_quantized_attention: {name} must be 4-D [B, H, L, d], got shape {tuple(t.shape)}")
        if t.dtype not in IO_CODES:
            raise ValueError(f"flash_quantized_attention: {name} has dtype {t.dtype}; allowed {list(IO_CODES)}")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError("flash_quantized_attention: q, k, v need one dtype and one device")
    (b, hq, _, d), (bk, hk, lk, dk), (bv, hv, lv, _) = q.shape, k.shape, v.shape
    if not (b == bk == bv and hk == hv and lk == lv and d == dk):
        raise ValueError(
            f"flash_quantized_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
            "fit [B, Hq, Lq, d], [B, Hk, Lk, d], [B, Hk, Lk, dv]"
        )
    if hq == 0 or d == 0:
        what = "query heads" if hq == 0 else "head dim"
        raise ValueError(f"flash_quantized_attention: q of shape {tuple(q.shape)} has no {what} ([B, Hq, Lq, d] needs "
                         "Hq >= 1 and d >= 1)")
    if hk == 0 or hq % hk:
        raise ValueError(f"flash_quantized_attention: query heads ({hq}) must be a multiple of key/value heads ({hk})")
    if lk == 0:
        raise ValueError("flash_quantized_attention: key length 0 leaves every row without a key")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"flash_quantized_attention: scale={scale!r} must be a finite float or None")
    return hq // hk, float(scale)


def gemm_bf16(fq: FlashQuant, a: Operand, b: Operand, dtype: torch.dtype) -> bool:
    """Whether the GEMM of operands ``a``, ``b`` may run on bf16 tensor cores without changing any value."""
    return all(bf16_exact(fq.tq(op)) if fq.code(op) else dtype == torch.bfloat16 for op in (a, b))


class _FlashFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, group: int, fq: FlashQuant, blocks: FlashBlocks, use_triton: bool):
        if use_triton:
            from fxquant.kernels import flash_attention_launch as fl

            o, lse = fl.forward(q, k, v, causal, scale, group, fq, blocks)
        else:
            from fxquant.qfunctions import flash_reference as ref

            o, lse = ref.forward(q, k, v, causal=causal, scale=scale, fq=fq, block_n=blocks.block_n)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, scale, group, fq, blocks, use_triton)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        causal, scale, group, fq, blocks, use_triton = ctx.args
        do = do.contiguous()
        if use_triton:
            from fxquant.kernels import flash_attention_launch as fl

            dq, dk, dv = fl.backward(q, k, v, o, lse, do, causal, scale, group, fq, blocks)
        else:
            from fxquant.qfunctions import flash_reference as ref

            dq, dk, dv = ref.backward(q, k, v, o, lse, do, causal=causal, scale=scale, fq=fq)
        return dq, dk, dv, None, None, None, None, None, None


def flash_quantized_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    aq: AttentionQuant,
    blocks: FlashBlocks | None = None,
    impl: FlashImpl | str = FlashImpl.AUTO,
) -> torch.Tensor:
    """Attention ``softmax(q k^T * scale) v`` with every GEMM operand quantized per ``aq`` inside the kernel
    (module docstring; semantics: docs/flash_attention.md). Differentiable in q, k and v."""
    from fxquant.formats.options import parse_enum

    group, scale_ = check_inputs(q, k, v, scale)
    if not isinstance(is_causal, bool):
        raise TypeError(f"flash_quantized_attention: is_causal must be a bool, got {type(is_causal).__name__}")
    fq = FlashQuant(aq)
    blocks = FlashBlocks() if blocks is None else blocks
    if not isinstance(blocks, FlashBlocks):
        raise TypeError(f"flash_quantized_attention: blocks must be a FlashBlocks, got {type(blocks).__name__}")
    blocks.check(fq)
    impl_ = parse_enum(FlashImpl, impl, "impl")
    runs = impl_ is not FlashImpl.REFERENCE and triton_runs_on(q.device)
    if impl_ is FlashImpl.TRITON and not runs:
        raise ValueError(
            f"impl='triton' cannot run on {q.device}: the kernels need CUDA tensors, or CPU tensors with "
            "TRITON_INTERPRET=1 set before fxquant's Triton kernels are first imported"
        )
    q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
    return _FlashFn.apply(q, k, v, is_causal, scale_, group, fq, blocks, runs)


__all__ = ["Axis", "FlashBlocks", "FlashImpl", "FlashQuant", "flash_quantized_attention"]
