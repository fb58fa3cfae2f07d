"""``flash_sdpa``: scaled dot-product attention with every GEMM operand quantized, as the quantized
flash-attention kernel computes it (docs/flash_attention.md), through two torch.library custom ops:

    fxquant::flash_attention(Tensor q, Tensor k, Tensor v, str specs, bool is_causal, float scale,
                             int block_n) -> (Tensor out, Tensor lse)
    fxquant::flash_attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor grad_out,
                             str specs, bool is_causal, float scale, int block_n) -> (Tensor, Tensor, Tensor)

q [B, Hq, Lq, d], k [B, Hk, Lk, d], v [B, Hk, Lk, dv] (Hq a multiple of Hk: GQA); out [B, Hq, Lq, dv] in
q's dtype, lse [B, Hq, Lq] float32; every output is contiguous. ``specs`` holds the twelve operand specs of
an AttentionQuant (``encode_specs``: ``TensorQuant.spec()`` strings in ``attention_specs`` order, joined by
``;``, empty = high precision). ``block_n`` is the forward's key tile, part of the semantics (P is the
unnormalised probability tile).

Implementations: the default one (CPU and any other device) is the torch reference
``fxquant.qfunctions.flash_reference``; on CUDA the Triton kernels (``fxquant.kernels.flash_attention_*``),
registered when this module is imported on a machine with Triton and a CUDA device. Both have the same
semantics; they differ only in float32 accumulation order (and the GPU's exp/log). Tests route the CPU
implementation through Triton's interpreter with ``register_triton("cpu")`` (ARCHITECTURE.md trap 7).
The fake implementations give the shapes and strides above (checked by ``torch.library.opcheck``); the
autograd formula calls the backward op, so AOT autograd and Inductor see two opaque ops and compiled
code runs exactly what eager runs.
"""
from __future__ import annotations

import functools
import logging
import math

import torch

from fxquant.formats.tensor_quant import TensorQuant
from fxquant.kernels.flash_attention_spec import FlashBlocks, FlashQuant
from fxquant.qfunctions import flash_reference as ref
from fxquant.schemes.model import AttentionQuant, GemmQuant, MatmulQuant

log = logging.getLogger(__name__)

SEP = ";"
IO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 128  # head dims the kernels are tuned and tested for (tiles padded to a power of two >= 32)
DEFAULT_BLOCK_N = 64
DEVICES = ("cuda", "cpu")


# -- the AttentionQuant as one string ----------------------------------------------------------------------
def _gemm_tqs(aq: AttentionQuant) -> list[TensorQuant | None]:
    return [t for mm in (aq.qk, aq.pv) for g in (mm.forward, mm.grad_a, mm.grad_b) for t in (g.a, g.b)]


def encode_specs(aq: AttentionQuant) -> str:
    """The ``specs`` argument of the ops: twelve operand specs joined by ``;`` (empty: high precision)."""
    if not isinstance(aq, AttentionQuant):
        raise TypeError(f"aq must be a fxquant.schemes.AttentionQuant, got {type(aq).__name__}")
    return SEP.join("" if t is None else t.spec() for t in _gemm_tqs(aq))


@functools.lru_cache(maxsize=256)
def decode_specs(specs: str) -> AttentionQuant:
    """The AttentionQuant of an ``encode_specs`` string."""
    parts = specs.split(SEP)
    if len(parts) != 12:
        raise ValueError(f"specs={specs!r} must hold 12 operand specs separated by {SEP!r}, got {len(parts)}")
    tqs = [TensorQuant.from_spec(p) if p else None for p in parts]
    gemms = [GemmQuant(tqs[i], tqs[i + 1]) for i in range(0, 12, 2)]
    return AttentionQuant(MatmulQuant(*gemms[:3]), MatmulQuant(*gemms[3:]))


@functools.lru_cache(maxsize=256)
def _flash_quant(specs: str) -> FlashQuant:
    return FlashQuant(decode_specs(specs))


def _blocks(specs: str, block_n: int) -> FlashBlocks:
    blocks = FlashBlocks(block_n=block_n)
    blocks.check(_flash_quant(specs))
    return blocks


# -- what the ops support ----------------------------------------------------------------------------------
def unsupported_reason(query: object, key: object, value: object, attn_mask: object = None, dropout_p: object = 0.0,
                       enable_gqa: object = False, aq: AttentionQuant | None = None) -> str | None:
    """Why ``F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, ..., enable_gqa)`` with
    the quantization ``aq`` cannot run as ``flash_sdpa``, or None when it can. Works on fake tensors."""
    if attn_mask is not None:
        return "an attn_mask is given (the kernel offers the causal mask only)"
    if not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        return f"dropout_p={dropout_p!r} (the kernel has no dropout)"
    ts = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in ts):
        return "query, key and value are not all tensors"
    if any(t.dim() != 4 for t in ts):
        return f"query/key/value are not 4-D [B, H, L, d]: {[tuple(t.shape) for t in ts]}"
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in IO_DTYPES:
        return f"dtypes {query.dtype}/{key.dtype}/{value.dtype}; the kernel takes one of {list(IO_DTYPES)}"
    d, dv = query.shape[-1], value.shape[-1]
    if not all(isinstance(x, int) for x in (d, dv, key.shape[-1], query.shape[1], key.shape[1], value.shape[1])):
        return "a head count or head dim is symbolic (dynamic shapes)"
    if d == 0 or dv == 0 or query.shape[1] == 0:
        return f"query {tuple(query.shape)}, value {tuple(value.shape)}: the kernel needs >= 1 head and head dims >= 1"
    if key.shape[-1] != d or d > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        return f"head dims d={d}, dk={key.shape[-1]}, dv={dv}: the kernel needs d == dk, both <= {MAX_HEAD_DIM}"
    if not query.shape[0] == key.shape[0] == value.shape[0] or key.shape[2] != value.shape[2]:
        return (f"batch sizes {query.shape[0]}/{key.shape[0]}/{value.shape[0]} or key/value lengths "
                f"{key.shape[2]}/{value.shape[2]} differ (the kernel broadcasts no dim)")
    if isinstance(key.shape[2], int) and key.shape[2] == 0:
        return "key length 0 (no key for any row: SDPA gives zeros, the kernel's normaliser would be 0)"
    hq, hk = query.shape[1], key.shape[1]
    if hk != value.shape[1] or hk == 0 or hq % hk or (hq != hk and not enable_gqa):
        return f"query heads {hq}, key/value heads {hk}/{value.shape[1]} (enable_gqa={enable_gqa})"
    if aq is not None:
        try:
            FlashQuant(aq)
        except ValueError as exc:
            return str(exc)
    return None


# -- the ops -----------------------------------------------------------------------------------------------
def _contiguous(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.contiguous() for t in ts]


def _reference_forward(q, k, v, specs, is_causal, scale, block_n):
    _blocks(specs, block_n)
    q, k, v = _contiguous(q, k, v)
    return ref.forward(q, k, v, causal=is_causal, scale=scale, fq=_flash_quant(specs), block_n=block_n)


def _reference_backward(q, k, v, out, lse, grad_out, specs, is_causal, scale, block_n):
    q, k, v, out, lse, grad_out = _contiguous(q, k, v, out, lse, grad_out)
    return ref.backward(q, k, v, out, lse, grad_out, causal=is_causal, scale=scale, fq=_flash_quant(specs))


@torch.library.custom_op("fxquant::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, specs: str, is_causal: bool, scale: float,
                    block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _reference_forward(q, k, v, specs, is_causal, scale, block_n)


@flash_attention.register_fake
def _flash_attention_fake(q, k, v, specs, is_causal, scale, block_n):
    _blocks(specs, block_n)  # the operand formats and tiles, validated while tracing
    b, h, lq, _ = q.shape
    return q.new_empty(b, h, lq, v.shape[-1]), q.new_empty(b, h, lq, dtype=torch.float32)


@torch.library.custom_op("fxquant::flash_attention_backward", mutates_args=())
def flash_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                             grad_out: torch.Tensor, specs: str, is_causal: bool, scale: float,
                             block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _reference_backward(q, k, v, out, lse, grad_out, specs, is_causal, scale, block_n)


@flash_attention_backward.register_fake
def _flash_attention_backward_fake(q, k, v, out, lse, grad_out, specs, is_causal, scale, block_n):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, specs, is_causal, scale, block_n = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (specs, is_causal, scale, block_n)


def _backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.fxquant.flash_attention_backward(q, k, v, out, lse, grad_out, *ctx.args)
    return dq, dk, dv, None, None, None, None


flash_attention.register_autograd(_backward, setup_context=_setup_context)


# -- the Triton implementations ----------------------------------------------------------------------------
def _triton_forward(q, k, v, specs, is_causal, scale, block_n):
    from fxquant.kernels import flash_attention_launch as fl

    q, k, v = _contiguous(q, k, v)
    return fl.forward(q, k, v, is_causal, scale, q.shape[1] // k.shape[1], _flash_quant(specs), _blocks(specs, block_n))


def _triton_backward(q, k, v, out, lse, grad_out, specs, is_causal, scale, block_n):
    from fxquant.kernels import flash_attention_launch as fl

    q, k, v, out, lse, grad_out = _contiguous(q, k, v, out, lse, grad_out)
    group = q.shape[1] // k.shape[1]
    return fl.backward(q, k, v, out, lse, grad_out, is_causal, scale, group, _flash_quant(specs), _blocks(specs, block_n))


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not supported; allowed: {list(DEVICES)}")


def register_triton(device: str = "cuda") -> None:
    """Run both ops on ``device`` with the Triton kernels. ``device="cpu"`` is for tests: it needs the kernels
    defined under Triton's interpreter (``TRITON_INTERPRET=1`` before they were first imported);
    ``restore_reference("cpu")`` undoes it."""
    _check_device(device)
    from fxquant import kernels

    if not kernels.available():
        raise RuntimeError("register_triton needs Triton: pip install 'fxquant[triton]'")
    if device == "cpu":
        from fxquant.kernels import flash_attention_launch as fl

        if not fl.interpreted():
            raise ValueError("device='cpu' needs TRITON_INTERPRET=1 set before fxquant's Triton kernels were first imported")
    torch.library.register_kernel("fxquant::flash_attention", device, _triton_forward)
    torch.library.register_kernel("fxquant::flash_attention_backward", device, _triton_backward)
    log.debug("fxquant::flash_attention runs the Triton kernels on %s", device)


def restore_reference(device: str) -> None:
    """Make the torch reference the implementation of both ops on ``device`` again."""
    _check_device(device)
    torch.library.register_kernel("fxquant::flash_attention", device, _reference_forward)
    torch.library.register_kernel("fxquant::flash_attention_backward", device, _reference_backward)


# -- the function ------------------------------------------------------------------------------------------
def flash_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool = False,
               scale: float | None = None, enable_gqa: bool = False, *, aq: AttentionQuant,
               block_n: int = DEFAULT_BLOCK_N) -> torch.Tensor:
    """``F.scaled_dot_product_attention(query, key, value, is_causal=..., scale=..., enable_gqa=...)`` with every
    GEMM operand quantized per ``aq`` with the flash kernel's semantics; differentiable in query, key, value.
    Raises ValueError for what the kernel does not support (``unsupported_reason``)."""
    if not isinstance(aq, AttentionQuant):
        raise TypeError(f"flash_sdpa: aq must be a fxquant.schemes.AttentionQuant, got {type(aq).__name__}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"flash_sdpa: is_causal must be a bool, got {type(is_causal).__name__}")
    reason = unsupported_reason(query, key, value, enable_gqa=enable_gqa)
    if reason is not None:
        raise ValueError(f"flash_sdpa cannot run this attention: {reason}")
    specs = encode_specs(aq)  # its formats are validated by the op (FlashQuant), eagerly and while tracing
    scale_ = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if not isinstance(scale_, (int, float)) or isinstance(scale_, bool) or not math.isfinite(scale_):
        raise ValueError(f"flash_sdpa: scale={scale!r} must be a finite float or None")
    out, _ = torch.ops.fxquant.flash_attention(query, key, value, specs, is_causal, float(scale_), block_n)
    return out


def _register_cuda_when_present() -> None:
    from fxquant import kernels

    if kernels.available() and torch.cuda.is_available():
        torch.library.register_kernel("fxquant::flash_attention", "cuda", _triton_forward)
        torch.library.register_kernel("fxquant::flash_attention_backward", "cuda", _triton_backward)


_register_cuda_when_present()  # Triton itself is imported by the first launch
