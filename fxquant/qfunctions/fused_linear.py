"""``fused_quantized_linear``: a linear whose three GEMMs quantize their operands on load (opt-in).

    >>> y = fused_quantized_linear(x, weight, bias, lq)     # same contract as quantized_linear(x, weight, bias, lq)

The GEMMs run through the custom op

    fxquant::quantized_mm(Tensor a, Tensor b, str a_spec, str b_spec) -> Tensor
        quantize(a, dim=-1) @ quantize(b, dim=0), a [M, K], b [K, N], float32 accumulation, a's dtype out
        ("" = that operand unquantized)

whose default implementation (CPU, any device) is the reference (``TensorQuant.quantize`` of each operand,
then a float32 matmul) and whose CUDA implementation is the fused Triton GEMM ``fxquant.kernels.qgemm``
(registered at import on a machine with Triton and CUDA). With X [M, K] (tokens flattened), W [N, K]:
fprop ``X @ W^T`` (both along K), dgrad ``dY @ W`` (both along N), wgrad ``dY^T @ X`` (both along M), each
one launch on the tensors as they are (transposes are strides), FORMATS.md "Which dimension is blocked".

It is not what ``fxquant.compile`` uses (``quantized_linear``: quantize kernel + cuBLAS): the issue keeps a
fusion only where the benchmark shows it winning, and ``benchmarks/run_all.py --sections fused`` prints
that verdict per shape and format on a GPU (benchmarks/RESULTS.md). Formats: those the kernel quantizes
per tile (``kernels.qgemm.supported``); NVFP4, per-tensor scaling and stochastic rounding raise ValueError.
"""
from __future__ import annotations

import functools

import torch

from fxquant.formats.tensor_quant import TensorQuant
from fxquant.schemes.model import LinearQuant

DEVICES = ("cuda", "cpu")


@functools.lru_cache(maxsize=256)
def _tq(spec: str) -> TensorQuant | None:
    return TensorQuant.from_spec(spec) if spec else None


def _spec(tq: TensorQuant | None) -> str:
    return "" if tq is None else tq.spec()


@functools.lru_cache(maxsize=256)
def _check_specs(a_spec: str, b_spec: str) -> None:
    """Refuse, on every device, what the fused kernel cannot quantize per tile (so all devices agree)."""
    from fxquant.kernels.flash_attention_spec import QGEMM_KERNEL, operand_code

    operand_code(_tq(a_spec), "quantized_mm operand a", QGEMM_KERNEL)
    operand_code(_tq(b_spec), "quantized_mm operand b", QGEMM_KERNEL)


def _reference_mm(a: torch.Tensor, b: torch.Tensor, a_spec: str, b_spec: str) -> torch.Tensor:
    _check_specs(a_spec, b_spec)
    qa, qb = a.float(), b.float()
    if a_spec:
        qa = _tq(a_spec).quantize(qa, -1)
    if b_spec:
        qb = _tq(b_spec).quantize(qb, 0)
    return torch.matmul(qa, qb).to(a.dtype).contiguous()


@torch.library.custom_op("fxquant::quantized_mm", mutates_args=())
def quantized_mm(a: torch.Tensor, b: torch.Tensor, a_spec: str, b_spec: str) -> torch.Tensor:
    return _reference_mm(a, b, a_spec, b_spec)


@quantized_mm.register_fake
def _quantized_mm_fake(a, b, a_spec, b_spec):
    _check_specs(a_spec, b_spec)
    return a.new_empty(a.shape[0], b.shape[1])


def _triton_mm(a: torch.Tensor, b: torch.Tensor, a_spec: str, b_spec: str) -> torch.Tensor:
    from fxquant.kernels.qgemm import qgemm

    return qgemm(a, b, _tq(a_spec), _tq(b_spec))


def register_triton(device: str = "cuda") -> None:
    """Run ``fxquant::quantized_mm`` on ``device`` with the fused kernel (``"cpu"``: tests, under the interpreter)."""
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not supported; allowed: {list(DEVICES)}")
    if device == "cpu":
        from fxquant.kernels import qgemm

        if not qgemm.interpreted():
            raise ValueError("device='cpu' needs TRITON_INTERPRET=1 set before fxquant's Triton kernels were first imported")
    torch.library.register_kernel("fxquant::quantized_mm", device, _triton_mm)


def restore_reference(device: str) -> None:
    """Make the reference the implementation of ``fxquant::quantized_mm`` on ``device`` again."""
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not supported; allowed: {list(DEVICES)}")
    torch.library.register_kernel("fxquant::quantized_mm", device, _reference_mm)


def unsupported_reason(lq: LinearQuant) -> str | None:
    """Why ``lq`` cannot run fused (None: it can)."""
    from fxquant.kernels.flash_attention_spec import QGEMM_KERNEL, operand_code

    for gemm in ("fprop", "dgrad", "wgrad"):
        g = getattr(lq, gemm)
        for side in ("a", "b"):
            try:
                operand_code(getattr(g, side), f"{gemm}.{side}", QGEMM_KERNEL)
            except ValueError as exc:
                return str(exc)
    return None


class _FusedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, specs: tuple[str, ...]):
        ctx.save_for_backward(x2, weight)
        ctx.specs = specs
        return torch.ops.fxquant.quantized_mm(x2, weight.t(), specs[0], specs[1])

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        s = ctx.specs
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.ops.fxquant.quantized_mm(dy, weight, s[2], s[3])  # dY along N, W along N (its dim 0)
        if ctx.needs_input_grad[1]:
            dw = torch.ops.fxquant.quantized_mm(dy.t(), x2, s[4], s[5])  # dY along M, X along M
        return dx, dw, None


def fused_quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lq: LinearQuant) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with every GEMM operand quantized per ``lq``, fused into the GEMMs."""
    if not isinstance(lq, LinearQuant):
        raise TypeError(f"lq must be a fxquant.schemes.LinearQuant, got {type(lq).__name__}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fused_quantized_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit [.., K], [N, K]")
    reason = None if torch.compiler.is_compiling() else unsupported_reason(lq)  # traced: the op checks its specs
    if reason is not None:
        raise ValueError(f"fused_quantized_linear cannot fuse this scheme: {reason}")
    specs = tuple(_spec(t) for g in (lq.fprop, lq.dgrad, lq.wgrad) for t in (g.a, g.b))
    y = _FusedLinearFn.apply(x.reshape(-1, x.shape[-1]), weight, specs).reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def _register_cuda_when_present() -> None:
    from fxquant import kernels

    if kernels.available() and torch.cuda.is_available():
        torch.library.register_kernel("fxquant::quantized_mm", "cuda", _triton_mm)


_register_cuda_when_present()
