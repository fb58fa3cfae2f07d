"""``quantized_sdpa``: ``F.scaled_dot_product_attention`` semantics in explicit math, with the QK^T and PV
matmuls (forward and their backward GEMMs dQ, dK, dP, dV) quantized per an ``AttentionQuant``;
``quantized_attention`` is the same and also returns P (nn.MultiheadAttention's need_weights).

The reference, step by step (q [.., Hq, Lq, d], k [.., Hk, Lk, d], v [.., Hk, Lk, dv]):

    enable_gqa: k heads repeated (``repeat_interleave``) Hq / Hk times, v heads Hq / Hv times (each must
        divide Hq; unchanged when all three are equal); their gradients sum back
    the dims before [L, d] (batch, heads) then broadcast as in ``torch.matmul``, as SDPA's math backend
        does: k, v [B, 1, Lk, d] serve every query head, [1, Lk, d] every batch of a 3-D q; the gradient
        of a broadcast operand is summed over the dims it was broadcast along
    S = quantized_matmul(q, k^T, aq.qk, gemm_dtype=float32)   q, k quantized in their own dtype (FORMATS.md), the
        GEMM in float32 (float64 inputs: float64): a float16 GEMM output would overflow to Inf where |q.k| > 65504 before the scale brings it
        down (SDPA's math backend scales q and k first, the flash kernel accumulates S in float32)
    S' = S * scale  (+ additive mask | -inf where a bool mask is False | causal: -inf above diagonal)
    P = softmax(S') in float32, rows that are masked everywhere give 0 (as ``aten._safe_softmax``), cast back
        to the input dtype
    dropout: keep = torch.empty_like(P).bernoulli_(1 - dropout_p) drawn once in the forward from torch's
        default generator; P = P * keep / (1 - dropout_p) (dropout_p = 1: P * 0, as torch's dropout); autograd
        reuses the same mask in the backward
    O = quantized_matmul(P, v, aq.pv)

Scores and softmax are float32 whatever the input dtype (stable: torch subtracts the row max), so bf16 and fp16
inputs lose precision only in the PV GEMM and the cast of P to the input dtype; dS, the gradient of S, is float32
too (dQ and dK are cast back to the inputs' dtype by autograd). The causal mask is SDPA's: top-left
aligned, ``tril`` of an [Lq, Lk] matrix of ones. Autograd through the scale, mask, softmax and dropout is
torch's; the four backward GEMMs run inside ``quantized_matmul``'s backward.
"""
from __future__ import annotations

import math

import torch

from fxquant.qfunctions.matmul import quantized_matmul
from fxquant.schemes.model import AttentionQuant


def _softmax_f32(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim (float32 in, float32 out); rows that are -inf everywhere give 0, not NaN,
    in the forward and the backward (as SDPA's math backend, ``aten._safe_softmax``)."""
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(torch.where(dead, 0.0, s), -1)
    return torch.where(dead, 0.0, p)


def _check(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, aq) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"quantized_sdpa: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"quantized_sdpa: {name} needs at least 2 dims [.., L, E], got shape {tuple(t.shape)}")
    if not isinstance(aq, AttentionQuant):
        raise TypeError(f"quantized_sdpa: aq must be a fxquant.schemes.AttentionQuant, got {type(aq).__name__}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"quantized_sdpa: query and key need the same last dim, got {q.shape[-1]} and {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"quantized_sdpa: key and value need the same length, got {k.shape[-2]} and {v.shape[-2]}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"quantized_sdpa: dropout_p={dropout_p!r} must lie in [0, 1]")
    lead = _check_broadcast(q, k, v, enable_gqa)
    if isinstance(attn_mask, torch.Tensor):  # as torch, the mask broadcasts to the scores, never the other way
        if attn_mask.dtype not in (torch.bool, torch.float32, q.dtype):  # torch's SDPA refuses the others
            raise TypeError(f"quantized_sdpa: attn_mask must be bool, float32 or the query's dtype ({q.dtype}), got "
                            f"{attn_mask.dtype} (F.scaled_dot_product_attention refuses it too)")
        if attn_mask.dim() < 2:
            raise ValueError(f"quantized_sdpa: attn_mask needs at least 2 dims [.., Lq, Lk], got shape "
                             f"{tuple(attn_mask.shape)} (F.scaled_dot_product_attention refuses it too)")
        scores = torch.Size((*lead, q.shape[-2], k.shape[-2]))
        try:
            fits = torch.broadcast_shapes(attn_mask.shape, scores) == scores
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"quantized_sdpa: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the "
                             f"attention scores {tuple(scores)} (F.scaled_dot_product_attention refuses it too)")


def _dim_name(dim: int, ndim: int) -> str:
    """SDPA's name for the leading dim ``dim`` (< -2) of inputs with up to ``ndim`` dims: [B, H, L, E] or [B, L, E]."""
    if dim == -3:
        return "heads (dim -3)" if ndim >= 4 else "batch (dim -3)"
    return f"batch (dim {dim})"


def _gqa_heads(q, k, v) -> int:
    """The query heads (dim -3), which ``enable_gqa`` repeats key and value heads to: each of Hk, Hv divides Hq."""
    if min(q.dim(), k.dim(), v.dim()) < 3:
        raise ValueError(f"quantized_sdpa: enable_gqa=True needs a heads dim (dim -3) in query, key and value, got "
                         f"shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hk == 0 or hv == 0 or hq % hk or hq % hv:
        raise ValueError(f"quantized_sdpa: enable_gqa needs query heads ({hq}) to be a multiple of key heads ({hk}) "
                         f"and of value heads ({hv})")
    return hq


def _check_broadcast(q, k, v, enable_gqa: bool) -> torch.Size:
    """The dims before [L, E] of query, key and value (key and value heads as ``enable_gqa`` repeats them) must
    broadcast as in ``torch.matmul``: per dim, the sizes other than 1 are all equal. Returns the dims of the
    attention scores (query's and key's, broadcast)."""
    lead = [list(t.shape[:-2]) for t in (q, k, v)]
    if enable_gqa:
        heads = _gqa_heads(q, k, v)
        for shape in lead:
            shape[-1] = heads
    ndim = max(len(s) for s in lead) + 2
    for dim in range(-3, -ndim - 1, -1):
        sizes = {name: s[dim + 2] for name, s in zip(("query", "key", "value"), lead) if len(s) >= -dim - 2}
        other = [n for n in sizes.values() if n != 1]
        if all(n == other[0] for n in other[1:]):
            continue
        what = ", ".join(f"{name} {n}" for name, n in sizes.items())
        hint = "; pass enable_gqa=True for GQA" if dim == -3 and ndim >= 4 and not enable_gqa else ""
        raise ValueError(f"quantized_sdpa: the {_dim_name(dim, ndim)} sizes {what} do not broadcast (each must be "
                         f"the same or 1, as in torch.matmul); shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}{hint}")
    return torch.broadcast_shapes(lead[0], lead[1])


def quantized_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    aq: AttentionQuant,
    scores_tap: str | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(...)`` with QK^T and PV quantized per ``aq`` (module docstring).
    ``scores_tap``: a capture tap string (fxquant.capture.tap) under which ``S'`` before the mask is captured."""
    return quantized_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, aq=aq,
                               scores_tap=scores_tap)[0]


def quantized_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    aq: AttentionQuant,
    scores_tap: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantized_sdpa`` returning ``(O, P)``: P is the probability matrix the PV GEMM consumed (after
    dropout, in the input dtype), what ``nn.MultiheadAttention(need_weights=True)`` returns per head."""
    _check(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, aq)
    if enable_gqa and not query.shape[-3] == key.shape[-3] == value.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    lq, lk = query.shape[-2], key.shape[-2]
    scale_ = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    s = quantized_matmul(query, key.transpose(-2, -1), aq.qk,
                         gemm_dtype=torch.promote_types(query.dtype, torch.float32)) * scale_
    if scores_tap is not None:  # capture (fxquant.passes.capture_taps): the scores, before the mask
        torch.ops.fxquant.capture(s, scores_tap)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.float()
    if is_causal:  # with an attn_mask too, both apply (torch's CPU SDPA combines them; its math backend refuses)
        causal = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
    p = _softmax_f32(s).to(query.dtype)
    if dropout_p == 1.0:  # torch's dropout: every weight dropped, input * 0
        p = p * 0.0
    elif dropout_p > 0.0:
        keep = torch.empty_like(p).bernoulli_(1.0 - dropout_p)
        p = p * keep / (1.0 - dropout_p)
    return quantized_matmul(p, value, aq.pv), p
