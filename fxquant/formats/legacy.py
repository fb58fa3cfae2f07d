"""Compatibility formats that reproduce a predecessor defect on purpose, for comparison with old results.

``hifp8_legacy_clamp``: HiFloat8 as the predecessor computed it at the bottom of the range (FORMATS.md,
"The predecessor's HiF8 differs"): a finite non-zero value that HiF8 rounds to 0 is clamped UP to
±2^-22 (the smallest denormal, code 0x01/0x81) instead. Everything else equals ``hifp8`` bit for bit
(same rounding, saturation, NaN/Inf rules). It is off by default: no preset uses it and it is not in
``formats.names()`` (the table of standard formats); a scheme asks for it by name
(``format: hifp8_legacy_clamp``), so it travels in the op's spec string like any format. Only the
pure-torch reference implements it: ``fxquant::quantize`` runs the reference for it on every device,
and the flash-attention kernel refuses it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fxquant.formats.base import Format
from fxquant.formats.element import ElementSpec
from fxquant.formats.options import QuantOptions, Scaling
from fxquant.formats.scalar import ElementFormat

TINY = 2.0**-22  # HiF8's smallest denormal (code 0x01): 2.384185791015625e-07


@dataclass(frozen=True)
class LegacyClampFormat(Format):
    """``base``'s element quantization, then non-zero values rounded to 0 become ±``tiny``."""

    name: str
    base: ElementFormat
    tiny: float
    description: str

    @property
    def element(self) -> ElementSpec:
        return self.base.element

    @property
    def scale_layout(self) -> str:
        return "none"

    def resolve(self, *, rounding=None, scale_mode=None, saturate=None, scaling=None,
                scale_target=None) -> QuantOptions:
        if scale_mode is not None:
            raise ValueError(f"scale_mode={scale_mode!r} applies to MX block formats only, not {self.name!r}")
        if scaling is not None and str(getattr(scaling, "value", scaling)).lower() != Scaling.NONE.value:
            raise ValueError(f"scaling={scaling!r} is not offered for {self.name!r}, which reproduces the "
                             "predecessor's unscaled HiF8 (allowed: 'none')")
        return self.base.resolve(rounding=rounding, saturate=saturate, scaling=scaling, scale_target=scale_target)

    def _clamp(self, x2: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        x32 = x2.to(torch.float32)
        tiny = (q == 0) & (x32 != 0) & torch.isfinite(x32)
        return torch.where(tiny, torch.copysign(torch.full_like(q, self.tiny), x32), q)

    def _quantize_canonical(self, x2, opts, seed, *, ctx=None, offset=0, out_dtype=torch.float32):
        q = self.base._quantize_canonical(x2, opts, seed, ctx=ctx, offset=offset)
        return self._clamp(x2, q).to(out_dtype)

    def _encode_canonical(self, x2, opts, seed):
        q = self._quantize_canonical(x2.to(torch.float32), opts, seed)
        return self.element.encode(q), None, None

    def _decode_canonical(self, codes, scales, tensor_scale, opts):
        return self.element.decode(codes)

