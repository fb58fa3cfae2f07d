"""Quantized matmuls as torch functions: ``quantized_matmul`` (batched ``A @ B``), and ``quantized_bmm`` /
``quantized_baddbmm`` with the call signatures of ``torch.bmm`` / ``torch.baddbmm`` (Megatron's unfused
attention) plus a ``mq`` keyword.

Each is a module-level function around one ``torch.autograd.Function`` whose forward and backward are
written here, so the three GEMMs of ``C = A @ B`` quantize their operands independently, each blocked along
its own reduction dimension and always from the high-precision tensor (FORMATS.md "Which dimension is
blocked"; the axes are listed in ``fxquant.schemes.model``):

    forward  C  = q(A, -1) @ q(B, -2)
    grad_a   dA = q(dC, -1) @ q(B, -1)^T
    grad_b   dB = q(A, -2)^T @ q(dC, -2)

Quantization goes through the ``fxquant::quantize`` custom op with ``seed=None`` (stochastic rounding
draws its seed when the op runs). The MatmulQuant is turned into spec strings before ``Function.apply``,
so Dynamo sees only tensors and constant strings.
"""
from __future__ import annotations

import torch

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant.quantize)
from fxquant.schemes.model import GemmQuant, MatmulQuant

Specs = tuple  # six entries: (fwd a, fwd b, grad_a a, grad_a b, grad_b a, grad_b b), each a spec str or None


def gemm_specs(*gemms: GemmQuant) -> Specs:
    """Spec strings (or None) of the operands of ``gemms``, two per GEMM, in order."""
    out = []
    for g in gemms:
        out.append(None if g.a is None else g.a.spec())
        out.append(None if g.b is None else g.b.spec())
    return tuple(out)


def q(x: torch.Tensor, spec: str | None, dim: int) -> torch.Tensor:
    """``x`` quantized along ``dim`` per ``spec`` through the custom op; ``x`` itself when spec is None."""
    if spec is None:
        return x
    return torch.ops.fxquant.quantize(x, spec, dim, None)


def _check_matmul_args(a: object, b: object, mq: object, fn: str) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{fn}: {name} must have at least 2 dimensions (a matrix or a batch), got shape {tuple(t.shape)}")
    if not isinstance(mq, MatmulQuant):
        raise TypeError(f"{fn}: mq must be a fxquant.schemes.MatmulQuant, got {type(mq).__name__}")


def qc(x: torch.Tensor, spec: str | None, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``q(x, spec, dim)`` cast to ``dtype``: a backward GEMM's operand in the dtype its forward GEMM ran in (under
    ``torch.autocast`` the forward's GEMM casts its quantized operands to the autocast dtype and the backward runs
    outside autocast, so the backward casts them itself; autograd casts each gradient back to its input's dtype)."""
    return q(x, spec, dim).to(dtype)


class _QuantizedMatmulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, specs: Specs, gemm_dtype: torch.dtype | None) -> torch.Tensor:
        ctx.specs = specs
        ctx.save_for_backward(a, b)
        qa, qb = q(a, specs[0], -1), q(b, specs[1], -2)
        if gemm_dtype is not None:  # the quantized operands (in their own dtype) widened: the GEMM's result in it
            qa, qb = qa.to(gemm_dtype), qb.to(gemm_dtype)
        out = torch.matmul(qa, qb)
        ctx.gemm_dtype = out.dtype
        return out

    @staticmethod
    def backward(ctx, dc: torch.Tensor):
        a, b = ctx.saved_tensors
        s, dt = ctx.specs, ctx.gemm_dtype
        da = db = None
        if ctx.needs_input_grad[0]:
            da = torch.matmul(qc(dc, s[2], -1, dt), qc(b, s[3], -1, dt).transpose(-2, -1))
            if da.shape != a.shape:
                da = da.sum_to_size(a.shape)
        if ctx.needs_input_grad[1]:
            db = torch.matmul(qc(a, s[4], -2, dt).transpose(-2, -1), qc(dc, s[5], -2, dt))
            if db.shape != b.shape:
                db = db.sum_to_size(b.shape)
        return da, db, None, None


def quantized_matmul(a: torch.Tensor, b: torch.Tensor, mq: MatmulQuant,
                     gemm_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.matmul(a, b)`` (a [.., M, K], b [.., K, N], batch dims broadcast) with its forward, grad_a
    and grad_b GEMMs quantized per ``mq``. ``gemm_dtype`` (e.g. float32 for half inputs): the three GEMMs run in
    it, on the operands quantized in their own dtype and then widened, and the result is in it (the incoming
    gradient is quantized in it too); autograd casts the gradients back to the inputs' dtypes."""
    _check_matmul_args(a, b, mq, "quantized_matmul")
    return _QuantizedMatmulFn.apply(a, b, gemm_specs(mq.forward, mq.grad_a, mq.grad_b), gemm_dtype)


def quantized_bmm(input: torch.Tensor, mat2: torch.Tensor, *, mq: MatmulQuant) -> torch.Tensor:
    """``torch.bmm(input, mat2)`` (3-D operands) quantized per ``mq``; Megatron's ``P @ V``."""
    if not isinstance(input, torch.Tensor) or not isinstance(mat2, torch.Tensor) or input.dim() != 3 or mat2.dim() != 3:
        raise ValueError(
            "quantized_bmm: input and mat2 must be 3-D tensors, got "
            f"{getattr(input, 'shape', type(input).__name__)} and {getattr(mat2, 'shape', type(mat2).__name__)}"
        )
    return quantized_matmul(input, mat2, mq)


def quantized_baddbmm(
    input: torch.Tensor,
    batch1: torch.Tensor,
    batch2: torch.Tensor,
    *,
    beta: float = 1.0,
    alpha: float = 1.0,
    mq: MatmulQuant,
) -> torch.Tensor:
    """``torch.baddbmm(input, batch1, batch2, beta=, alpha=)`` = ``beta * input + alpha * (batch1 @ batch2)``
    with the GEMM quantized per ``mq``; Megatron's ``Q @ K^T``. As in torch, ``beta == 0`` ignores ``input``
    (NaN or uninitialised memory in it does not propagate). ``alpha`` scales the GEMM's result; in the
    backward the quantized ``dC`` is the gradient of the GEMM's own output ``C = batch1 @ batch2``, i.e.
    ``alpha`` times the incoming gradient, as in ``quantized_sdpa`` (where dS is the gradient of Q K^T
    before the softmax scale)."""
    if batch1.dim() != 3 or batch2.dim() != 3:
        raise ValueError(
            f"quantized_baddbmm: batch1 and batch2 must be 3-D, got {tuple(batch1.shape)} and {tuple(batch2.shape)}"
        )
    # as torch.baddbmm: the product in float32 times alpha, one rounding to the inputs' dtype (a float16 GEMM output
    # overflows where |b1 . b2| > 65504 before alpha = 1 / sqrt(d) brings it down); float32 / float64: their own
    dtype = torch.promote_types(batch1.dtype, batch2.dtype)
    out = quantized_matmul(batch1, batch2, mq, gemm_dtype=torch.promote_types(dtype, torch.float32))
    out = (out * alpha if alpha != 1 else out).to(dtype)
    if beta == 0:
        return out
    if beta != 1:
        input = input * beta
    return input + out
