"""The ops a traced quantize records (``_tracing()`` in ``fxquant.formats``), so that a compiler sees one node per
stage of the reference arithmetic instead of its few dozen ATen ops:

``fxquant::round_elements(Tensor v, Tensor? u, str element, str rounding, bool saturate, bool finite)``
    ``ELEMENTS[element].quantize_steps(v, rounding, saturate, u, finite=finite)``: an element format's rounding.
``fxquant::block_scales(Tensor amax, Tensor? tensor_amax, str fmt, str rounding, str? scale_mode) -> (Tensor, Tensor)``
    ``formats.get(fmt).block_scales(amax, tensor_amax, options)``: a block format's inverse scale and scale per
    block, from its block amaxes (and NVFP4's tensor amax, broadcast to them), after the reductions.
``fxquant::block_values(Tensor xb, Tensor inv, Tensor scale, Tensor? u, str fmt, str rounding)``
    ``formats.get(fmt).scaled_values(xb, inv, scale, u, options)``: a block format's values (MX, NVFP4) from
    the blocked input and its scales broadcast to it.

Each implementation is the reference itself (any device). ``fxquant.pointwise_lowering`` lowers each for Inductor
into one pointwise computation per output; the fake implementations install those lowerings when Inductor is loaded
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


@torch.library.custom_op("fxquant::block_scales", mutates_args=(), tags=_TAGS)
def block_scales(
    amax: torch.Tensor, tensor_amax: torch.Tensor | None, fmt: str, rounding: str, scale_mode: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    f = _block_format(fmt)
    return f.block_scales(amax, tensor_amax, f.resolve(rounding=rounding, scale_mode=scale_mode))


@block_scales.register_fake
def _block_scales_fake(amax, tensor_amax, fmt, rounding, scale_mode):
    _install_lowerings()
    return tuple(torch.empty(amax.shape, dtype=torch.float32, device=amax.device) for _ in range(2))


@torch.library.custom_op("fxquant::block_values", mutates_args=(), tags=_TAGS)
def block_values(
    xb: torch.Tensor, inv: torch.Tensor, scale: torch.Tensor, u: torch.Tensor | None, fmt: str, rounding: str
) -> torch.Tensor:
    f = _block_format(fmt)
    return f.scaled_values(xb, inv, scale, u, f.resolve(rounding=rounding))


@block_values.register_fake
def _block_values_fake(xb, inv, scale, u, fmt, rounding):
    _install_lowerings()
    return torch.empty(xb.shape, dtype=torch.float32, device=xb.device)


def _block_format(name: str):
    from fxquant import formats

    return formats.get(name)
