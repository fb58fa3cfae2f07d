"""The torch reference of the quantized flash-attention kernel: the same quantized tiles, in the same order.

docs/flash_attention.md states the semantics; ``fxquant.kernels.flash_attention_kernels`` is the kernel.
Every quantization goes through ``TensorQuant.quantize`` (fxquant.formats), on the same tile along the
same axis as the kernel, so kernel and reference differ only in float32 accumulation order (and the GPU's
``exp``/``log``):

forward: one pass over the BLOCK_N key tiles in order, every query row at once (the online softmax of a
    row does not depend on how rows are tiled). Per tile: S = q(Q) q(K_j)^T * scale with masked entries
    -inf; m' = max(m, rowmax S); P~ = exp(S - m') unnormalised; l = l * exp(m - m') + rowsum(P~);
    acc = acc * exp(m - m') + q(P~ along Lk, this tile only) @ q(V_j along Lk); O = acc / l.
backward: nothing in it depends on the tiling (P = exp(S - LSE) is normalised; every operand is an input
    or an element-wise matrix, blocked along Lq or Lk in 32-blocks that tiles of a multiple of 32 never
    split), so it runs on whole matrices, in chunks of query rows (a multiple of 32) to bound memory.
Unquantized P and dS are rounded to the input dtype before their GEMM (``.to(q.dtype)``). GQA: key/value
head ``h // group`` serves query head h; dK and dV sum over the group.
"""
from __future__ import annotations

import torch

from fxquant.kernels.flash_attention_spec import FlashQuant, Operand


def _q(x: torch.Tensor, fq: FlashQuant, op: Operand, dim: int) -> torch.Tensor:
    """Operand ``op`` of float32 ``x`` quantized along ``dim`` (or ``x`` unquantized), float32 out."""
    tq = fq.tq(op)
    return x if tq is None else tq.quantize(x, dim)


def _operand(x: torch.Tensor, fq: FlashQuant, op: Operand, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A computed operand (P, dS): quantized, or rounded to the input dtype when ``op`` is not quantized."""
    if fq.tq(op) is None:
        return x.to(dtype).float()
    return _q(x, fq, op, dim)


def _expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _valid(rows: torch.Tensor, cols: torch.Tensor, causal: bool) -> torch.Tensor:
    """[len(rows), len(cols)] bool: where attention is allowed (SDPA's top-left causal mask)."""
    if not causal:
        return torch.ones(rows.numel(), cols.numel(), dtype=torch.bool, device=rows.device)
    return cols[None, :] <= rows[:, None]


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float, fq: FlashQuant, block_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O in q's dtype, LSE float32 [B, Hq, Lq]) of the kernel's forward with key tiles of ``block_n``."""
    group = q.shape[1] // k.shape[1]
    lq, lk = q.shape[2], k.shape[2]
    qq = _q(q.float(), fq, Operand.QK_Q, -1)
    k32, v32 = _expand_kv(k, group).float(), _expand_kv(v, group).float()
    rows = torch.arange(lq, device=q.device)
    m = torch.full(q.shape[:3], float("-inf"), device=q.device)
    l = torch.zeros(q.shape[:3], device=q.device)
    acc = torch.zeros(*q.shape[:3], v.shape[3], device=q.device)
    for start in range(0, lk, block_n):
        stop = min(start + block_n, lk)
        kq = _q(k32[:, :, start:stop], fq, Operand.QK_K, -1)
        s = torch.matmul(qq, kq.transpose(-2, -1)) * scale
        s = s.masked_fill(~_valid(rows, torch.arange(start, stop, device=q.device), causal), float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m_new[..., None])
        alpha = torch.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        vq = _q(v32[:, :, start:stop], fq, Operand.PV_V, -2)
        acc = acc * alpha[..., None] + torch.matmul(_operand(p, fq, Operand.PV_P, -1, q.dtype), vq)
        m = m_new
    return (acc / l[..., None]).to(q.dtype), m + torch.log(l)


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    fq: FlashQuant,
    chunk: int = 512,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) in the input dtype, for the forward's (O, LSE) and the incoming gradient ``do``."""
    if chunk % 32:
        raise ValueError(f"chunk={chunk} must be a multiple of 32 (MX blocks along Lq lie inside one chunk)")
    group = q.shape[1] // k.shape[1]
    lq, lk = q.shape[2], k.shape[2]
    k32, v32 = _expand_kv(k, group).float(), _expand_kv(v, group).float()
    cols = torch.arange(lk, device=q.device)
    kq = _q(k32, fq, Operand.QK_K, -1)
    vq = _q(v32, fq, Operand.DP_V, -1)
    kq_lk = _q(k32, fq, Operand.DQ_K, -2)
    delta = (do.float() * o.float()).sum(-1)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k32.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v32.shape, dtype=torch.float32, device=q.device)
    for start in range(0, lq, chunk):
        stop = min(start + chunk, lq)
        rows = torch.arange(start, stop, device=q.device)
        q32, do32 = q[:, :, start:stop].float(), do[:, :, start:stop].float()
        s = torch.matmul(_q(q32, fq, Operand.QK_Q, -1), kq.transpose(-2, -1)) * scale
        p = torch.where(_valid(rows, cols, causal), torch.exp(s - lse[:, :, start:stop, None]), 0.0)
        dv += torch.matmul(_operand(p, fq, Operand.DV_P, -2, q.dtype).transpose(-2, -1), _q(do32, fq, Operand.DV_DO, -2))
        dp = torch.matmul(_q(do32, fq, Operand.DP_DO, -1), vq.transpose(-2, -1))
        ds = scale * (p * (dp - delta[:, :, start:stop, None]))
        dk += torch.matmul(_operand(ds, fq, Operand.DK_DS, -2, q.dtype).transpose(-2, -1), _q(q32, fq, Operand.DK_Q, -2))
        dq[:, :, start:stop] = torch.matmul(_operand(ds, fq, Operand.DQ_DS, -1, q.dtype), kq_lk)
    if group > 1:
        b, hk = k.shape[:2]
        dk = dk.reshape(b, hk, group, lk, dk.shape[-1]).sum(2)  # explicit sizes: B = 0 leaves -1 undefined
        dv = dv.reshape(b, hk, group, lk, dv.shape[-1]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def flash_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    aq,
    blocks=None,
) -> torch.Tensor:
    """The differentiable torch reference: ``flash_quantized_attention(..., impl="reference")``."""
    from fxquant.kernels.flash_attention import flash_quantized_attention

    return flash_quantized_attention(q, k, v, is_causal=is_causal, scale=scale, aq=aq, blocks=blocks, impl="reference")
