"""``quantized_linear``: ``F.linear`` with its three GEMMs quantized per a ``LinearQuant``.

A module-level wrapper around one ``torch.autograd.Function`` (ARCHITECTURE.md trap 1: ``Fn.apply`` as an
FX target generates broken code). With X flattened to [M, K] (M = all leading dims, row-major), W [N, K]
and dY [M, N] (FORMATS.md "Which dimension is blocked"):

    fprop  Y  = F.linear(q(X, K), q(W, K), bias)      bias in high precision
    dgrad  dX = q(dY, N) @ q(W, N)
    wgrad  dW = q(dY, M)^T @ q(X, M)                  dbias = sum of dY over M, in high precision

Every operand is quantized from the high-precision tensor saved by the forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fxquant.qfunctions.matmul import gemm_specs, q, qc
from fxquant.schemes.model import LinearQuant


class _QuantizedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, specs: tuple) -> torch.Tensor:
        ctx.specs = specs
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        y = F.linear(q(x, specs[0], -1), q(weight, specs[1], 1), bias)
        ctx.gemm_dtype = y.dtype  # the autocast dtype under torch.autocast (qc)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        s, dt = ctx.specs, ctx.gemm_dtype
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(qc(dy2, s[2], 1, dt), qc(weight, s[3], 0, dt)).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            dw = torch.mm(qc(dy2, s[4], 0, dt).t(), qc(x2, s[5], 0, dt))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None


def quantized_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lq: LinearQuant
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with fprop, dgrad and wgrad quantized per ``lq`` (bias in high precision)."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"quantized_linear: x and weight must be tensors, got {type(x).__name__}, {type(weight).__name__}")
    if weight.dim() not in (1, 2) or x.dim() < 1 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"quantized_linear: x [..., K] and weight [N, K] (or [K]) needed, got x {tuple(x.shape)}, weight "
            f"{tuple(weight.shape)}"
        )
    if not isinstance(lq, LinearQuant):
        raise TypeError(f"quantized_linear: lq must be a fxquant.schemes.LinearQuant, got {type(lq).__name__}")
    if weight.dim() == 1:  # F.linear's vector weight: N = 1, that dimension dropped from the result
        if bias is not None and bias.dim() != 0:
            raise ValueError(f"quantized_linear: a weight of shape {tuple(weight.shape)} takes a 0-dim bias (as "
                             f"F.linear), got bias {tuple(bias.shape)}")
        return quantized_linear(x, weight.unsqueeze(0), None if bias is None else bias.reshape(1), lq).squeeze(-1)
    return _QuantizedLinearFn.apply(x, weight, bias, gemm_specs(lq.fprop, lq.dgrad, lq.wgrad))
