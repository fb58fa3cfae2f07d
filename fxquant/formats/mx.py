"""OCP Microscaling (MX v1.0) block formats: 32 elements along ``dim`` share one E8M0 scale 2**s.

FORMATS.md "MX block formats". Scale rules (amax = max |x| over the block, emax = the element's
exponent of max normal):
  floor: s = floor(log2 amax) - emax          ceil: s = ceil(log2 amax) - emax
  rceil: s = ceil(log2(amax / max_normal)), the division in float32, the ceiling from d's bits
  even:  amax rounded (RNE) to the element's mantissa width, then floor
s < -127 is clamped to -127; s > 127, or a NaN/Inf in the block, gives the NaN scale 0xFF and the
whole block decodes to NaN. A short last block is treated as padded with zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fxquant.formats._bits import fdiv, frexp_bits, mul_pow2, nonfinite, pow2_wide
from fxquant.formats.base import Format, draw_uniforms
from fxquant.formats.element import ElementSpec, _tracing
from fxquant.formats.options import QuantOptions, ScaleMode, parse_enum

E8M0_NAN = 0xFF
E8M0_BIAS = 127


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """All 256 E8M0 codes: 2**(c - 127) for c in 0..254, NaN for 0xFF (2**-127 is a float32 subnormal)."""
    c = codes.to(torch.int32)
    s = c - E8M0_BIAS
    v = mul_pow2(torch.ones(c.shape, dtype=torch.float32, device=c.device), s)
    return torch.where(c == E8M0_NAN, float("nan"), v)


def blocks(x2: torch.Tensor, block: int) -> torch.Tensor:
    """``[rows, L]`` -> ``[rows, nblocks, block]``, the last block zero-padded."""
    rows, length = x2.shape
    pad = (-length) % block
    if pad:
        x2 = F.pad(x2, (0, pad))
    return x2.reshape(rows, (length + pad) // block, block)


def unblock(xb: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of ``blocks``: ``[rows, nblocks, block]`` -> ``[rows, length]``."""
    return xb.reshape(xb.shape[0], xb.shape[1] * xb.shape[2])[:, :length]


def tile_amax(amax_b: torch.Tensor, rows_per_tile: int) -> torch.Tensor:
    """Block amaxes ``[rows, nblocks, 1]`` -> each block's tile amax (the largest over the ``rows_per_tile``
    consecutive rows of its group, the last group holding what is left; NaN propagates), same shape. Whole-tensor
    ATen ops, the full groups and the last one as two pieces: Inductor's CPU code generation (torch 2.13) gave
    the last rows uninitialised values when the rows were zero-padded to whole groups and the result sliced back
    (tests/test_formats_lowering.py checks the traced form against the reference at such shapes)."""
    rows, nblocks, _ = amax_b.shape
    if amax_b.numel() == 0:  # no rows or no blocks: no tiles
        return amax_b
    a = amax_b.squeeze(-1)
    full = rows - rows % rows_per_tile
    pieces = []
    if full:
        tiles = a[:full].reshape(-1, rows_per_tile, nblocks).amax(dim=1, keepdim=True)
        pieces.append(tiles.expand(-1, rows_per_tile, nblocks).reshape(full, nblocks))
    if rows > full:
        pieces.append(a[full:].amax(dim=0, keepdim=True).expand(rows - full, nblocks))
    return (torch.cat(pieces) if len(pieces) > 1 else pieces[0]).unsqueeze(-1)


def blocked_uniforms(opts: QuantOptions, seed: int, x2: torch.Tensor, offset: int, block: int) -> torch.Tensor | None:
    """The stochastic-rounding uniforms of canonical ``x2`` (a slab starting at flat index ``offset``), blocked."""
    u = draw_uniforms(opts.rounding, seed, x2.shape, x2.device, offset)
    return None if u is None else blocks(u, block)


def block_stage(fmt: Format, x2: torch.Tensor, xb: torch.Tensor, amax: torch.Tensor,
                tensor_amax: torch.Tensor | None, opts: QuantOptions, seed: int, offset: int,
                out_dtype: torch.dtype) -> torch.Tensor:
    """The quantized values (``[rows, L]``, cast to ``out_dtype``) of canonical ``x2`` (blocked: ``xb``) given its
    block amaxes (and NVFP4's tensor amax): ``fmt.block_values``, unblocked. Traced for a compiler, two ops that
    ``fxquant.pointwise_lowering`` lowers into pointwise computations: ``fxquant::block_scales`` per block (the
    inverse scale and the scale, from the block amaxes and NVFP4's tensor amax) and ``fxquant::block_values`` per
    element (the scaled, rounded, rescaled values, scales broadcast to the elements).

    With a short last block the traced form quantizes the full blocks and the short one as two blocked pieces of
    ``x2`` (each its own amax, scales and values) and concatenates them, rather than working over zero-padded
    blocks and slicing the result back to ``[:, :L]``: Inductor's CPU code generation miscompiles that slice when
    a fused pointwise op reads it (torch 2.13: only the first block's columns are written, with the first block's
    scale), and miscompiles the alternative of gathering each element's block scales when there is one row.
    Plain torch shows both: ``torch.compile`` of ``relu((tp * (tp.abs().amax(-1, keepdim=True) + 1)).reshape(4,
    64)[:, :50])`` with ``tp = F.pad(t, (0, 14)).view(4, 2, 32)`` for ``t`` of shape [4, 50], or of
    ``t * s.squeeze(-1)[:, torch.arange(48) // 32]`` with ``s`` that amax over ``F.pad(t, (0, 16)).view(1, 2,
    32)`` for ``t`` of shape [1, 48], differs from eager (tests/test_formats_lowering.py checks the traced form
    with such shapes and consumers)."""
    length = x2.shape[1]
    tracing = _tracing()
    if not tracing or length % fmt.block_size == 0:
        u = blocked_uniforms(opts, seed, x2, offset, fmt.block_size)
        values = _traced_values if tracing else type(fmt).block_values
        return unblock(values(fmt, xb, amax, tensor_amax, u, opts).to(out_dtype), length)
    rows, full = x2.shape[0], length - length % fmt.block_size
    u = draw_uniforms(opts.rounding, seed, x2.shape, x2.device, offset)
    pieces = []
    for lo, hi, size in ((0, full, fmt.block_size), (full, length, length - full)):
        if hi == lo:
            continue
        xp = x2[:, lo:hi].reshape(rows, (hi - lo) // size, size)
        up = None if u is None else u[:, lo:hi].reshape(xp.shape)
        ap = xp.abs().amax(dim=-1, keepdim=True).to(amax.dtype)
        if opts.block_2d:  # NVFP4's 16x16 tiles: a block's amax is its tile's
            ap = tile_amax(ap, fmt.block_size)
        pieces.append(_traced_values(fmt, xp, ap, tensor_amax, up, opts).to(out_dtype).reshape(rows, hi - lo))
    return torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]


def _traced_values(fmt: Format, xb: torch.Tensor, amax: torch.Tensor, tensor_amax: torch.Tensor | None,
                   u: torch.Tensor | None, opts: QuantOptions) -> torch.Tensor:
    """``fmt.block_values`` of blocked ``xb`` as the two traced ops (``fxquant::block_scales`` per block, then
    ``fxquant::block_values`` per element, scales broadcast to ``xb``)."""
    mode = None if opts.scale_mode is None else opts.scale_mode.value
    t = None if tensor_amax is None else tensor_amax.expand(amax.shape)
    inv, scale = torch.ops.fxquant.block_scales(amax, t, fmt.name, opts.rounding.value, mode)
    return torch.ops.fxquant.block_values(xb, inv.expand(xb.shape), scale.expand(xb.shape), u, fmt.name,
                                          opts.rounding.value)


def mx_scale_exponent(amax: torch.Tensor, elem: ElementSpec, mode: ScaleMode) -> torch.Tensor:
    """The unclamped shared exponent s (int32) of each block, for finite ``amax >= 0``."""
    e, m = frexp_bits(amax)
    if mode is ScaleMode.FLOOR:
        return e - elem.emax
    if mode is ScaleMode.CEIL:
        return e + (m != 1.0).to(torch.int32) - elem.emax
    if mode is ScaleMode.EVEN:
        n = torch.round(m * (2**elem.mbits))  # m * 2**mbits < 2**24 is exact; torch.round is RNE
        return e + (n == 2 ** (elem.mbits + 1)).to(torch.int32) - elem.emax
    if mode is ScaleMode.RCEIL:
        d = fdiv(amax, elem.max_normal)  # float32, correctly rounded on every device
        ed, md = frexp_bits(d)
        return ed + (md != 1.0).to(torch.int32)
    raise ValueError(f"unknown scale_mode {mode!r}")  # pragma: no cover - guarded by parse_enum


@dataclass(frozen=True)
class MXFormat(Format):
    """An MX block format: element spec + 32-element blocks + E8M0 scale."""

    name: str
    element: ElementSpec
    description: str
    block_size: int = 32
    scale_layout = "E8M0 per 32"
    canonical_float32 = False  # amax is exact in any input dtype; the scale multiply promotes to float32

    def resolve(self, *, rounding=None, scale_mode=None, saturate=None) -> QuantOptions:
        rnd = self._rounding(rounding, "rne")
        mode = parse_enum(ScaleMode, "floor" if scale_mode is None else scale_mode, "scale_mode")
        if saturate is not None and saturate is not True:
            raise ValueError(f"saturate={saturate!r}: MX elements always saturate (OCP MX rule); allowed: True")
        return QuantOptions(rounding=rnd, saturate=True, scale_mode=mode)

    def _exponents(self, amax: torch.Tensor, opts: QuantOptions) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, bad) from block amaxes (float32, any shape): the shared exponent, clamped to [-127, 127], and the
        NaN-scale mask.

        The shortest exact arithmetic, since compilers trace it once per operand (``fxquant.lowering``): under
        ``floor`` the exponent is the biased exponent field of amax (a float32 subnormal amax gives s <= -127
        either way, which the clamp maps to -127; amax = NaN/Inf has field 255); s > 127 cannot occur then.
        """
        if opts.scale_mode is ScaleMode.FLOOR:
            field = (amax.view(torch.int32) >> 23) & 0xFF
            return torch.clamp_min(field - (127 + self.element.emax), -127), field == 0xFF
        bad = nonfinite(amax)
        s = mx_scale_exponent(torch.where(bad, 0.0, amax), self.element, opts.scale_mode)
        return torch.clamp(s, -127, 127), bad | (s > 127)

    def _amax(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocked x [rows, nblocks, 32], amax [rows, nblocks, 1] in float32: exact in any input dtype)."""
        xb = blocks(x2, self.block_size)
        return xb, xb.abs().amax(dim=-1, keepdim=True).to(torch.float32)

    def _elements(self, xb: torch.Tensor, inv: torch.Tensor, u: torch.Tensor | None, opts: QuantOptions):
        """Element values P (``inv`` = 2**-s broadcast to ``xb``). Non-finite blocks give garbage here; callers
        mask them."""
        return self.element.quantize(xb * inv, opts.rounding.value, True, u, finite=True)

    def _inverse(self, s: torch.Tensor) -> torch.Tensor:
        """2**-s as one exact float32 per block (2**-127, for s = 127 where emax = 0, is a subnormal): the product
        ``x * 2**-s`` is the correctly rounded x / 2**s, the same as two multiplications by normal powers."""
        return pow2_wide(-s, subnormal=self.element.emax == 0)

    def block_scales(self, amax: torch.Tensor, tensor_amax: None, opts: QuantOptions):
        """(2**-s, 2**s or NaN for a NaN-scale block), float32, per block from its amax (MX has no tensor amax)."""
        s, bad = self._exponents(amax, opts)
        return self._inverse(s), torch.where(bad, float("nan"), pow2_wide(s))

    def scaled_values(self, xb: torch.Tensor, inv: torch.Tensor, scale: torch.Tensor, u: torch.Tensor | None,
                      opts: QuantOptions) -> torch.Tensor:
        """The quantized values (float32) of blocked ``xb`` given ``block_scales`` broadcast to it."""
        return self._elements(xb, inv, u, opts) * scale

    def block_values(self, xb: torch.Tensor, amax: torch.Tensor, tensor_amax: None, u: torch.Tensor | None,
                     opts: QuantOptions) -> torch.Tensor:
        """The quantized values (float32) of blocked ``xb`` given its block amaxes ``amax`` (broadcastable to
        ``xb``): the per-block and per-element stages of ``quantize``, after the reduction."""
        return self.scaled_values(xb, *self.block_scales(amax, tensor_amax, opts), u, opts)

    def _quantize_canonical(self, x2, opts, seed, *, ctx=None, offset=0, out_dtype=torch.float32):
        xb, amax = self._amax(x2)
        return block_stage(self, x2, xb, amax, None, opts, seed, offset, out_dtype)

    def _encode_canonical(self, x2, opts, seed):
        xb, amax = self._amax(x2)
        s, bad = self._exponents(amax, opts)
        p = self._elements(xb, self._inverse(s), blocked_uniforms(opts, seed, x2, 0, self.block_size), opts)
        p = torch.where(bad, 0.0, p)
        codes = unblock(self.element.encode(p), x2.shape[1])
        scales = torch.where(bad, E8M0_NAN, s + E8M0_BIAS).to(torch.uint8).squeeze(-1)
        return codes, scales, None

    def _decode_canonical(self, codes, scales, tensor_scale, opts):
        length = codes.shape[1]
        p = blocks(self.element.decode(codes), self.block_size)
        c = scales.to(torch.int32)
        y = mul_pow2(p, (c - E8M0_BIAS).unsqueeze(-1))
        y = torch.where((c == E8M0_NAN).unsqueeze(-1), float("nan"), y)
        return unblock(y, length)
