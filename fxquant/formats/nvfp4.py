"""NVFP4: E2M1 elements in blocks of 16, an E4M3 scale per block, a float32 scale per tensor.

FORMATS.md "NVFP4", in float32 and in this order (matching NVIDIA's and torchao's kernels to the bit):
  g = amax_tensor / (448 * 6)
  b = e4m3_rne(clamp(amax_block / 6 / g, 2**-9, 448))
  P = e2m1(clamp(x * ((1 / g) / b), -6, 6))           value = P * (g * b)
amax_tensor == 0 gives all zeros, and so does a tensor too small for the recipe's float32 arithmetic
(g underflows to 0, or 1 / g overflows: amax_tensor < 2688 * 2**-128, about 7.9e-36); a NaN or Inf
anywhere makes the whole tensor NaN (the per-tensor scale is then undefined). Every division is an IEEE
float32 division, on CUDA too (``fdiv``).

``block_2d=True`` (NVIDIA's recipe for weights): one E4M3 scale per 16x16 tile of a 2-D tensor (16 along
``dim`` by 16 along the other dimension; tiles at the edges hold what is left), b from the tile's amax; g and
the elements as above. Each 16-element block of the canonical layout takes its tile's amax, so the 1-D code
computes the rest, and the same tiles give the same values along either dim: quantize(W, 0) equals
quantize(W, 1) (round to nearest; stochastic rounding draws by position in the layout of ``dim``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fxquant.formats._bits import F32_MAX, fdiv, nonfinite
from fxquant.formats.base import Format
from fxquant.formats.element import E2M1, E4M3, ElementSpec, _tracing
from fxquant.formats.mx import block_stage, blocked_uniforms, blocks, tile_amax, unblock
from fxquant.formats.options import QuantOptions

NVFP4_BLOCK = 16
GLOBAL_DIVISOR = 448.0 * 6.0  # 2688


@dataclass(frozen=True)
class NVFP4Format(Format):
    name: str
    description: str
    block_size: int = NVFP4_BLOCK
    element: ElementSpec = E2M1
    scale_layout = "E4M3 per 16 + fp32 per tensor"

    def resolve(self, *, rounding=None, scale_mode=None, saturate=None, block_2d=None) -> QuantOptions:
        if scale_mode is not None:
            raise ValueError(f"scale_mode={scale_mode!r} applies to MX formats; NVFP4's scales are fixed by its recipe")
        if saturate is not None and saturate is not True:
            raise ValueError(f"saturate={saturate!r}: NVFP4 elements always saturate; allowed: True")
        if block_2d is not None and not isinstance(block_2d, bool):
            raise ValueError(f"block_2d={block_2d!r}: allowed True (16x16 tiles of a 2-D tensor), False")
        return QuantOptions(rounding=self._rounding(rounding, "rne"), saturate=True, block_2d=bool(block_2d))

    def check_shape(self, x, dim, opts):
        if opts.block_2d and x.dim() != 2:
            raise ValueError(f"NVFP4 with block_2d=True quantizes 2-D tensors (16x16 tiles of a weight); got shape "
                             f"{tuple(x.shape)}")

    def row_group(self, opts):
        return self.block_size if opts.block_2d else 1

    def _tensor_context(self, x2, opts):
        return x2.abs().amax() if x2.numel() else torch.zeros((), device=x2.device)

    def _amax(self, x2: torch.Tensor, opts: QuantOptions, amax_t: torch.Tensor | None = None):
        """(blocked x, block amaxes [rows, nblocks, 1], the tensor's amax); ``amax_t`` given: the whole tensor's.
        With ``block_2d`` each block's amax is its 16x16 tile's (the rows of ``x2`` are the other dimension)."""
        xb = blocks(x2, self.block_size)
        amax_b = xb.abs().amax(dim=-1, keepdim=True)
        if opts.block_2d:
            amax_b = tile_amax(amax_b, self.block_size)
        if amax_t is None:  # the whole tensor's amax is the largest block amax: no second pass over x
            amax_t = amax_b.amax() if amax_b.numel() else torch.zeros((), device=x2.device)
        return xb, amax_b, amax_t

    def _scale_values(self, amax_b: torch.Tensor, amax_t: torch.Tensor):
        """(g, b, inv = (1/g)/b, zero, bad) per the recipe, from block and tensor amaxes (broadcastable)."""
        bad = nonfinite(amax_t)
        g = fdiv(torch.where(bad, 1.0, amax_t), GLOBAL_DIVISOR)
        inv_g = fdiv(1.0, g)
        zero = inv_g > F32_MAX  # g == 0, or 1 / g overflows
        g = torch.where(zero, 1.0, g)
        inv_g = torch.where(zero, 1.0, inv_g)
        amax_b = torch.where(bad, 0.0, amax_b)
        # the clamped quotient is finite: no Inf fix-up in the E4M3 rounding
        b = E4M3.quantize(torch.clamp(fdiv(fdiv(amax_b, 6.0), g), 2.0**-9, 448.0), "rne", True, None, finite=True)
        return g, b, fdiv(inv_g, b), zero, bad

    def _elements(self, xb, inv, u, opts):
        """Element values P of blocked ``xb`` (``inv`` = (1/g)/b broadcast to it). |x * inv| <= 6 / (1 - 2**-4) in a
        finite block (b is amax_b / 6 / g rounded to E4M3, at most 2**-4 below it; clamped, only upwards), so the
        saturating E2M1 rounding (monotone, 6 on its grid) gives what rounding it clamped to [-6, 6] would."""
        return E2M1.quantize(xb * inv, opts.rounding.value, True, u, finite=True)

    def block_scales(self, amax, tensor_amax, opts):
        """(inv = (1/g)/b, g * b) per block from its amax and the tensor's (broadcastable), float32; the scale is 0
        where the tensor quantizes to zeros and NaN where it has a NaN or Inf (g * b > 0 otherwise: g >= 2**-128,
        b >= 2**-9)."""
        g, b, inv, zero, bad = self._scale_values(amax, tensor_amax)
        return inv, torch.where(zero, 0.0, torch.where(bad, float("nan"), g * b))

    def scaled_values(self, xb, inv, scale, u, opts):
        """The quantized values (float32) of blocked ``xb`` given ``block_scales`` broadcast to it: a NaN scale gives
        NaN through the product (any NaN: FORMATS.md gives NaN payloads no meaning), a zero scale +0."""
        return torch.where(scale == 0, 0.0, self._elements(xb, inv, u, opts) * scale)

    def block_values(self, xb, amax, tensor_amax, u, opts):
        """The quantized values (float32) of blocked ``xb`` given its block amaxes and the tensor's amax (both
        broadcastable to ``xb``): the per-block and per-element stages of ``quantize``, after the reductions."""
        return self.scaled_values(xb, *self.block_scales(amax, tensor_amax, opts), u, opts)

    def _quantize_canonical(self, x2, opts, seed, *, ctx=None, offset=0, out_dtype=torch.float32):
        if ctx is None and _tracing() and x2.shape[1] % self.block_size:
            # Traced with a short last block, block_stage takes each piece's block amaxes itself: the tensor's amax
            # is then one plain reduction of x (the same value), not the largest of padded block amaxes taken
            # only for it (a second block-amax pass over x).
            ctx = self._tensor_context(x2, opts)
        xb, amax_b, amax_t = self._amax(x2, opts, ctx)
        return block_stage(self, x2, xb, amax_b, amax_t, opts, seed, offset, out_dtype)

    def _encode_canonical(self, x2, opts, seed):
        xb, amax_b, amax_t = self._amax(x2, opts)
        g, b, inv, zero, bad = self._scale_values(amax_b, amax_t)
        p = self._elements(xb, inv, blocked_uniforms(opts, seed, x2, 0, self.block_size), opts)
        p = torch.where(zero | bad, 0.0, p)
        codes = unblock(E2M1.encode(p), x2.shape[1])
        tensor_scale = torch.where(zero, 0.0, torch.where(bad, float("nan"), g))
        return codes, E4M3.encode(b.squeeze(-1)), tensor_scale

    def _decode_canonical(self, codes, scales, tensor_scale, opts):
        p = blocks(E2M1.decode(codes), self.block_size)
        b = E4M3.decode(scales)
        g = tensor_scale.to(torch.float32)
        y = p * (g * b).unsqueeze(-1)
        return unblock(torch.where(g == 0, 0.0, y), codes.shape[1])
