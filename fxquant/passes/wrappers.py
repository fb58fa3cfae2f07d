"""Module-level functions the rewrite passes put into Dynamo graphs as ``call_function`` targets.

ARCHITECTURE.md trap 1: ``Fn.apply`` as an FX target generates broken code, and FX writes a frozen
dataclass constant as ``LinearQuant(...)``, a name the generated code cannot resolve. So each target
here is a plain module-level function taking only tensors, numbers and a tuple of spec strings (one per
GEMM operand, None = high precision, in the order of ``fxquant.qfunctions.matmul.gemm_specs``); it
rebuilds the LinearQuant / MatmulQuant / AttentionQuant (cached) and calls ``fxquant.qfunctions``.
AOT autograd traces through them, so their forward and backward both reach the compiled graphs.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from fxquant.formats.tensor_quant import TensorQuant
from fxquant.qfunctions import (quantized_attention, quantized_baddbmm, quantized_bmm, quantized_linear,
                                quantized_matmul, quantized_sdpa)
from fxquant.qfunctions.flash_sdpa import flash_sdpa
from fxquant.qfunctions.matmul import gemm_specs
from fxquant.schemes.model import AttentionQuant, GemmQuant, LinearQuant, MatmulQuant

Specs = tuple  # of str | None


@functools.lru_cache(maxsize=None)
def _tq(spec: str | None) -> TensorQuant | None:
    return None if spec is None else TensorQuant.from_spec(spec)


def _gemms(specs: Specs) -> list[GemmQuant]:
    return [GemmQuant(_tq(specs[i]), _tq(specs[i + 1])) for i in range(0, len(specs), 2)]


@functools.lru_cache(maxsize=None)
def linear_quant(specs: Specs) -> LinearQuant:
    return LinearQuant(*_gemms(specs))


@functools.lru_cache(maxsize=None)
def matmul_quant(specs: Specs) -> MatmulQuant:
    return MatmulQuant(*_gemms(specs))


@functools.lru_cache(maxsize=None)
def attention_quant(specs: Specs) -> AttentionQuant:
    return AttentionQuant(matmul_quant(specs[:6]), matmul_quant(specs[6:]))


def linear_specs(lq: LinearQuant) -> Specs:
    return gemm_specs(lq.fprop, lq.dgrad, lq.wgrad)


def matmul_specs(mq: MatmulQuant) -> Specs:
    return gemm_specs(mq.forward, mq.grad_a, mq.grad_b)


def attention_specs(aq: AttentionQuant) -> Specs:
    return matmul_specs(aq.qk) + matmul_specs(aq.pv)


def fxquant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, specs: Specs) -> torch.Tensor:
    """``F.linear`` rewritten: ``quantized_linear`` with the LinearQuant of ``specs``."""
    return quantized_linear(x, weight, bias, linear_quant(specs))


def fxquant_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    specs: Specs,
    scores_tap: str | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` rewritten: ``quantized_sdpa`` with the AttentionQuant of ``specs``;
    ``scores_tap`` (set by the capture pass) captures the scores."""
    return quantized_sdpa(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, aq=attention_quant(specs),
        scores_tap=scores_tap,
    )


def mha_attention_weights(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.multi_head_attention_forward``'s attention when it returns weights, computed as torch does (high
    precision), on [B*H, L, d]: S = baddbmm(mask, q / sqrt(d), k^T) (bmm without a mask), P = softmax(S),
    dropout, O = P V. Returns (O, P). Put in the graph by ``passes.decompose_mha``."""
    q_scaled = query * math.sqrt(1.0 / float(query.shape[-1]))
    kt = key.transpose(-2, -1)
    s = torch.bmm(q_scaled, kt) if attn_mask is None else torch.baddbmm(attn_mask, q_scaled, kt)
    p = torch.softmax(s, dim=-1)
    if dropout_p > 0.0:
        p = F.dropout(p, p=dropout_p)
    return torch.bmm(p, value), p


def fxquant_attention_weights(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float,
    specs: Specs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mha_attention_weights`` rewritten: ``quantized_attention`` (O and the quantized path's P)."""
    return quantized_attention(query, key, value, attn_mask, dropout_p, aq=attention_quant(specs))


def fxquant_flash_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    specs: Specs,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` rewritten for the flash kernel: ``flash_sdpa`` (the custom op
    ``fxquant::flash_attention``) with the AttentionQuant of ``specs``."""
    return flash_sdpa(query, key, value, is_causal, scale, enable_gqa, aq=attention_quant(specs))


def fxquant_baddbmm(
    input: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor, beta: float, alpha: float, specs: Specs
) -> torch.Tensor:
    """Megatron's ``torch.baddbmm`` (Q K^T) rewritten: ``quantized_baddbmm`` with the qk MatmulQuant."""
    return quantized_baddbmm(input, batch1, batch2, beta=beta, alpha=alpha, mq=matmul_quant(specs))


def fxquant_bmm(input: torch.Tensor, mat2: torch.Tensor, specs: Specs) -> torch.Tensor:
    """Megatron's ``torch.bmm`` (P V) rewritten: ``quantized_bmm`` with the pv MatmulQuant."""
    return quantized_bmm(input, mat2, mq=matmul_quant(specs))


def fxquant_matmul(a: torch.Tensor, b: torch.Tensor, specs: Specs) -> torch.Tensor:
    """A linear's ``torch.matmul(x, weight.t())`` rewritten: ``quantized_matmul`` with ``LinearQuant.as_matmul()``."""
    return quantized_matmul(a, b, matmul_quant(specs))
