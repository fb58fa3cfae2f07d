"""torch.library custom ops of fxquant.

``fxquant::quantize(Tensor x, str qspec, int dim, int? seed) -> Tensor``
    Fake-quantize ``x`` along ``dim`` per ``qspec`` (a ``TensorQuant.spec()`` string). The default
    implementation is the pure-torch reference (any device); ``fxquant.kernels`` registers the Triton
    implementation for CUDA when Triton is importable. ``seed=None`` with stochastic rounding draws a
    seed from torch's default generator when the op runs (not when it is traced); the schema's int is an int64
    (``quantize_tensor`` passes a larger seed as the int64 of its low 64 bits). Its autograd is the
    straight-through estimator: the gradient passes unchanged. The output is always contiguous.
``fxquant::quantize_reference(...)``
    The same, always with the reference (any device, Triton registered or not). Compiled graphs reach it
    through ``fxquant.lowering`` (``kernels="reference"``), which also lowers ``fxquant::quantize`` into
    fusable ATen ops for Inductor (``kernels="inductor"``).
"""
from __future__ import annotations

import functools

import torch

from fxquant.formats.tensor_quant import TensorQuant


@functools.lru_cache(maxsize=512)
def parse_qspec(qspec: str) -> TensorQuant:
    return TensorQuant.from_spec(qspec)


@torch.library.custom_op("fxquant::quantize", mutates_args=())
def quantize(x: torch.Tensor, qspec: str, dim: int, seed: int | None = None) -> torch.Tensor:
    return parse_qspec(qspec).quantize(x, dim, seed=seed)


@quantize.register_fake
def _quantize_fake(x: torch.Tensor, qspec: str, dim: int, seed: int | None = None) -> torch.Tensor:
    return x.new_empty(x.shape)


def _quantize_setup_context(ctx, inputs, output) -> None:
    return None


def _quantize_backward(ctx, grad: torch.Tensor):
    return grad, None, None, None


quantize.register_autograd(_quantize_backward, setup_context=_quantize_setup_context)


@torch.library.custom_op("fxquant::quantize_reference", mutates_args=())
def quantize_reference(x: torch.Tensor, qspec: str, dim: int, seed: int | None = None) -> torch.Tensor:
    """``fxquant::quantize`` pinned to the pure-torch reference on every device (``kernels="reference"``)."""
    return parse_qspec(qspec).quantize(x, dim, seed=seed)


quantize_reference.register_fake(_quantize_fake)


def quantize_tensor(x: torch.Tensor, tq: TensorQuant | None, dim: int = -1, seed: int | None = None) -> torch.Tensor:
    """Quantize through the custom op (dispatching to Triton on CUDA); ``tq=None`` returns ``x``. ``seed`` is any
    int, as ``TensorQuant.quantize`` takes it (its low 64 bits count): passed to the op, whose schema holds an
    int64, as the signed int64 of the same 64 bits."""
    if tq is None:
        return x
    if seed is not None and not -(1 << 63) <= seed < (1 << 63):
        seed = ((seed + (1 << 63)) & ((1 << 64) - 1)) - (1 << 63)
    return torch.ops.fxquant.quantize(x, tq.spec(), dim, seed)


# Registers the Triton implementation for CUDA when Triton and a CUDA device are present (cheap otherwise:
# Triton itself is imported lazily by the first launch).
import fxquant.kernels  # noqa: E402,F401
