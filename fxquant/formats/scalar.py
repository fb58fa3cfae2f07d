"""Element-wise formats: FP8 (E4M3, E5M2), HiFloat8, and the bf16/fp16 baseline casts.

FORMATS.md "Element formats" and "HiFloat8". With ``scaling="tensor"`` one power-of-two factor 2**k is
chosen per tensor so that ``amax * 2**k`` lands at or just under ``scale_target`` (default: the format's
max normal), the elements are quantized, and the factor is divided back out. ``k`` is clamped to
[-126, 126]; a zero or non-finite amax leaves k = 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import math

import numpy as np
import torch

from fxquant.formats._bits import frexp_bits, mul_pow2
from fxquant.formats.base import Format, draw_uniforms
from fxquant.formats.element import ElementSpec
from fxquant.formats.options import QuantOptions, Scaling, parse_enum


_F32_MIN_NORMAL = 2.0**-126  # 1.1754943508222875e-38, the smallest normal float32


def tensor_scale_exponent(x2: torch.Tensor, target: float) -> torch.Tensor:
    """k (int32 0-dim) with amax * 2**k <= target < amax * 2**(k+1), exactly from bits."""
    amax = x2.abs().amax().to(torch.float32) if x2.numel() else torch.zeros((), device=x2.device)
    ok = torch.isfinite(amax) & (amax > 0)
    a = torch.where(ok, amax, 1.0)
    ea, ma = frexp_bits(a)
    mt, et = math.frexp(float(np.float32(target)))  # the float32 target = mt * 2**et, mt in [0.5, 1)
    et, mt = et - 1, mt * 2.0  # as frexp_bits: mantissa in [1, 2)
    k = et - ea - (ma > mt).to(torch.int32)
    return torch.where(ok, torch.clamp(k, -126, 126), 0).to(torch.int32)


@dataclass(frozen=True)
class ElementFormat(Format):
    """A format whose elements are quantized independently (no blocks)."""

    name: str
    element: ElementSpec
    description: str
    allow_tensor_scaling: bool = True
    default_saturate: bool = True
    canonical_float32 = False  # converted per slab of rows (in cache) by _quantize_canonical

    @property
    def scale_layout(self) -> str:
        return "optional 2^k per tensor" if self.allow_tensor_scaling else "none"

    def resolve(self, *, rounding=None, scale_mode=None, saturate=None, scaling=None, scale_target=None) -> QuantOptions:
        if scale_mode is not None:
            raise ValueError(f"scale_mode={scale_mode!r} applies to MX block formats only, not {self.name!r}")
        rnd = self._rounding(rounding, self.element.default_rounding)
        sat = self.default_saturate if saturate is None else saturate
        if not isinstance(sat, bool):
            raise TypeError(f"saturate must be a bool, got {type(sat).__name__}")
        if not sat and not self.element.has_inf:
            raise ValueError(f"saturate=False needs a format with Inf; {self.name!r} has none (allowed: True)")
        mode = parse_enum(Scaling, "none" if scaling is None else scaling, "scaling")
        target = None
        if mode is Scaling.TENSOR:
            if not self.allow_tensor_scaling:
                raise ValueError(f"scaling='tensor' is not offered for {self.name!r} (allowed: 'none')")
            allowed = (f"in [2**-126 (1.17549e-38), {self.element.max_normal:g}] for {self.name!r} (a positive, "
                       f"finite, normal float32 no larger than the format's max normal)")
            try:
                if isinstance(scale_target, bool):
                    raise TypeError
                target = self.element.max_normal if scale_target is None else float(scale_target)
            except (TypeError, ValueError):
                raise ValueError(f"scale_target={scale_target!r} must be a number {allowed}") from None
            # The exponent is read from the float32 target (tensor_scale_exponent): below 2**-126 it is subnormal or 0.
            if not _F32_MIN_NORMAL <= target <= self.element.max_normal:
                raise ValueError(f"scale_target={scale_target!r} must lie {allowed}")
        elif scale_target is not None:
            raise ValueError("scale_target is only meaningful with scaling='tensor'")
        return QuantOptions(rounding=rnd, saturate=sat, scaling=mode, scale_target=target)

    def _scale(self, x2: torch.Tensor, opts: QuantOptions) -> torch.Tensor | None:
        if opts.scaling is Scaling.NONE:
            return None
        return tensor_scale_exponent(x2, opts.scale_target)

    def _tensor_context(self, x2, opts):
        return self._scale(x2, opts)

    def _quantize_canonical(self, x2, opts, seed, *, ctx=None, offset=0, out_dtype=torch.float32):
        u = draw_uniforms(opts.rounding, seed, x2.shape, x2.device, offset)
        k = ctx if ctx is not None else self._scale(x2, opts)
        x2 = x2.to(torch.float32)
        v = x2 if k is None else mul_pow2(x2, k)
        q = self.element.quantize(v, opts.rounding.value, opts.saturate, u)
        return (q if k is None else mul_pow2(q, -k)).to(out_dtype)

    def _encode_canonical(self, x2, opts, seed):
        u = draw_uniforms(opts.rounding, seed, x2.shape, x2.device)
        k = self._scale(x2, opts)
        x2 = x2.to(torch.float32)
        v = x2 if k is None else mul_pow2(x2, k)
        codes = self.element.encode(self.element.quantize(v, opts.rounding.value, opts.saturate, u))
        tscale = None if k is None else mul_pow2(torch.ones((), device=x2.device), -k)
        return codes, None, tscale

    def _decode_canonical(self, codes, scales, tensor_scale, opts):
        v = self.element.decode(codes)
        if tensor_scale is None:
            return v
        k, _ = frexp_bits(tensor_scale)  # tensor_scale is exactly 2**-k
        return mul_pow2(v, k)
