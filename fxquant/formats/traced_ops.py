"""The ops a traced quantize records (``_tracing()`` in ``fxquant.formats``), so that a compiler sees one node per
stage of the reference arithmetic instead of its few dozen ATen ops:

``fxquant::round_elements(Tensor v, Tensor? u, str element, str rounding, bool saturate, bool finite)``
    ``ELEMENTS[element].quantize_steps(v, rounding, saturate, u, finite=finite)``: an element format's rounding.
``fxquant::block_values(Tensor xb, Tensor amax, Tensor? tensor_amax, Tensor? u, str fmt, str rounding,
str? scale_mode)``
    ``formats.get(fmt).block_values(xb, amax, tensor_amax, u, options)``: a block format's values (MX, NVFP4)
    from the blocked input and its block amaxes (and NVFP4's tensor amax), broadcast to ``xb``, after the
    reductions.

Each implementation is the reference itself (any device). ``fxquant.pointwise_lowering`` lowers both for Inductor
into one pointwise computation per op; the fake implementations install those lowerings when Inductor is loaded
(a compile on its way to Inductor traces them first). ``flexible_layout``: no stride constraint, also where
Inductor met an op before the lowering was installed (its fallback would otherwise leave a constraint behind
that the lowering cannot meet).
"""
from __future__ import annotations

import sys

import torch

from fxquant.formats.element import ELEMENTS

_TAGS = (torch.Tag.flexible_layout,)


def _install_lowerings() -> None:
    if "torch._inductor.lowering" in sys.modules:  # traced on the way to Inductor
        from fxquant import pointwise_lowering

        pointwise_lowering.register()


@torch.library.custom_op("fxquant::round_elements", mutates_args=(), tags=_TAGS)
def round_elements(
    v: torch.Tensor, u: torch.Tensor | None, element: str, rounding: str, saturate: bool, finite: bool
) -> torch.Tensor:
    return ELEMENTS[element].quantize_steps(v, rounding, saturate, u, finite=finite)


@round_elements.register_fake
def _round_elements_fake(v, u, element, rounding, saturate, finite):
    _install_lowerings()
    return torch.empty_like(v, dtype=torch.float32)


@torch.library.custom_op("fxquant::block_values", mutates_args=(), tags=_TAGS)
def block_values(
    xb: torch.Tensor, amax: torch.Tensor, tensor_amax: torch.Tensor | None, u: torch.Tensor | None, fmt: str,
    rounding: str, scale_mode: str | None
) -> torch.Tensor:
    from fxquant import formats

    f = formats.get(fmt)
    return f.block_values(xb, amax, tensor_amax, u, f.resolve(rounding=rounding, scale_mode=scale_mode))


@block_values.register_fake
def _block_values_fake(xb, amax, tensor_amax, u, fmt, rounding, scale_mode):
    _install_lowerings()
    return torch.empty(xb.shape, dtype=torch.float32, device=xb.device)
