"""What the quantized flash-attention kernel quantizes, as data: operands, their codes and block sizes.

Imports no Triton, so the torch reference (``fxquant.qfunctions.flash_reference``) and the kernels share
one validation. docs/flash_attention.md is the user guide; FORMATS.md "Which dimension is blocked" fixes
the axes. The twelve GEMM operands of attention and the axis each is blocked along:

    qk  S  = Q K^T    Q along d,  K along d          pv  O  = P V      P along Lk, V along Lk
    dq  dQ = dS K     dS along Lk, K along Lk         dp  dP = dO V^T   dO along dv, V along dv
    dk  dK = dS^T Q   dS along Lq, Q along Lq         dv  dV = P^T dO   P along Lq, dO along Lq

Inside a kernel every operand's TensorQuant is one small integer constexpr (``operand_code``): kind
(none / element / MX), element format (an index into ``ELEMENT_TABLE``), rounding, MX scale mode and the
overflow-to-Inf flag. The kernel supports what can be computed from the tile alone: element formats
(HiF8, FP8, bf16, fp16) without per-tensor scaling, and MX formats; deterministic roundings (rne, ta, rz).
NVFP4 and per-tensor scaling need a tensor-wide amax (P and dS never exist as whole tensors) and
stochastic rounding needs a random stream this kernel does not define: each is refused with a ValueError.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from fxquant.formats.element import BF16, E2M1, E2M3, E3M2, E4M3, E5M2, FP16, HIF8, INT8, ElementSpec
from fxquant.formats.legacy import LegacyClampFormat
from fxquant.formats.mx import MXFormat
from fxquant.formats.options import Rounding, ScaleMode, Scaling
from fxquant.formats.scalar import ElementFormat
from fxquant.formats.tensor_quant import TensorQuant
from fxquant.schemes.model import AttentionQuant

# Index = the ELEM field of an operand code; the kernels' ``_round_elem`` has one branch per entry, with
# these specs' data written as literals (a test checks them against ``launch.element_constexprs``).
ELEMENT_TABLE: tuple[ElementSpec, ...] = (E4M3, E5M2, E3M2, E2M3, E2M1, INT8, HIF8, BF16, FP16)
ROUNDINGS: tuple[Rounding, ...] = (Rounding.RNE, Rounding.TA, Rounding.RZ)
SCALE_MODES: tuple[ScaleMode, ...] = (ScaleMode.FLOOR, ScaleMode.CEIL, ScaleMode.EVEN, ScaleMode.RCEIL)
MX_BLOCK = 32


class Kind(enum.IntEnum):
    NONE = 0
    ELEMENT = 1
    MX = 2


class Axis(str, enum.Enum):
    """The attention dimension an operand's MX blocks run along."""

    D = "d"  # the head dimension of Q/K (or dv of V/dO): whole rows of the tensor, independent of tiling
    LK = "Lk"  # key positions: blocks of 32 inside one BLOCK_N tile
    LQ = "Lq"  # query positions: blocks of 32 inside one BLOCK_M tile


class Operand(enum.Enum):
    """The twelve GEMM operands: (GEMM name, operand name, matmul, GemmQuant field, a/b, blocked axis)."""

    QK_Q = ("qk", "q", "qk", "forward", "a", Axis.D)
    QK_K = ("qk", "k", "qk", "forward", "b", Axis.D)
    DQ_DS = ("dq", "ds", "qk", "grad_a", "a", Axis.LK)
    DQ_K = ("dq", "k", "qk", "grad_a", "b", Axis.LK)
    DK_Q = ("dk", "q", "qk", "grad_b", "a", Axis.LQ)
    DK_DS = ("dk", "ds", "qk", "grad_b", "b", Axis.LQ)
    PV_P = ("pv", "p", "pv", "forward", "a", Axis.LK)
    PV_V = ("pv", "v", "pv", "forward", "b", Axis.LK)
    DP_DO = ("dp", "do", "pv", "grad_a", "a", Axis.D)
    DP_V = ("dp", "v", "pv", "grad_a", "b", Axis.D)
    DV_P = ("dv", "p", "pv", "grad_b", "a", Axis.LQ)
    DV_DO = ("dv", "do", "pv", "grad_b", "b", Axis.LQ)

    @property
    def label(self) -> str:
        return f"{self.value[0]}.{self.value[1]}"

    @property
    def axis(self) -> Axis:
        return self.value[5]

    def of(self, aq: AttentionQuant) -> TensorQuant | None:
        _, _, mm, gemm, side, _ = self.value
        return getattr(getattr(getattr(aq, mm), gemm), side)


QGEMM_KERNEL = "the quantizing GEMM kernel (fxquant.kernels.qgemm)"  # operand_code's messages, for qgemm's operands


def operand_code(tq: TensorQuant | None, where: str = "operand", kernel: str = "the flash-attention kernel") -> int:
    """The kernel constexpr of one operand: ``KIND | ELEM << 2 | RND << 6 | SMODE << 8 | OVF << 11``.

    0 means "not quantized". Raises ValueError for what the kernel (named ``kernel`` in messages) cannot compute
    from a tile.
    """
    if tq is None:
        return 0
    if not isinstance(tq, TensorQuant):
        raise TypeError(f"{where}: expected a TensorQuant or None, got {type(tq).__name__}")
    fmt, opts = tq.fmt, tq.options
    if opts.rounding not in ROUNDINGS:
        raise ValueError(
            f"{where}: rounding={opts.rounding.value!r} is not supported inside {kernel}; "
            f"allowed: {[r.value for r in ROUNDINGS]} (stochastic rounding needs a random stream per tile "
            "that the kernel does not define: use fxquant.qfunctions.quantized_sdpa)"
        )
    if isinstance(fmt, MXFormat):
        if fmt.block_size != MX_BLOCK:  # pragma: no cover - every MX format has 32-element blocks
            raise ValueError(f"{where}: MX block size {fmt.block_size} is not {MX_BLOCK}")
        kind, smode, ovf = Kind.MX, SCALE_MODES.index(opts.scale_mode), 0
    elif isinstance(fmt, ElementFormat):
        if opts.scaling is not Scaling.NONE:
            raise ValueError(
                f"{where}: {tq.spec()!r} uses scaling='tensor', which needs the amax of a whole tensor; "
                f"{kernel} quantizes tiles (allowed: scaling='none')"
            )
        spec = fmt.element
        ovf = int(spec.has_inf and not opts.saturate and opts.rounding is not Rounding.RZ)
        kind, smode = Kind.ELEMENT, 0
    else:
        why = ("a compatibility format that only the reference implements" if isinstance(fmt, LegacyClampFormat)
               else "NVFP4's tensor scale needs the amax of a whole tensor")
        raise ValueError(
            f"{where}: format {tq.format!r} is not supported inside {kernel} ({why}); allowed: element formats "
            "(hifp8, fp8_e4m3, fp8_e5m2, bf16, fp16) and MX formats (mxfp8_e4m3, mxfp8_e5m2, mxfp6_*, mxfp4_e2m1, "
            "mxint8)"
        )
    elem = ELEMENT_TABLE.index(fmt.element)
    return int(kind) | elem << 2 | ROUNDINGS.index(opts.rounding) << 6 | smode << 8 | ovf << 11


def bf16_exact(tq: TensorQuant | None) -> bool:
    """Whether the format's values have at most 8 significant bits, so a GEMM on the GPU may feed the tensor
    cores bf16 without changing them. fp16 elements have 11 significant bits: not exact. One exception, kept
    for the tensor cores' speed: an MX block of float32 input whose amax is below about 2^-118 (scale 2^-127)
    holds float32 subnormals finer than bf16's subnormal step 2^-133; values below 2^-130 may be rounded to
    that step (docs/flash_attention.md). bf16 and fp16 inputs give only values bf16 holds."""
    return tq is not None and tq.fmt.element.mbits <= 7


@dataclass(frozen=True)
class FlashQuant:
    """The kernel's view of an AttentionQuant: one code per operand, validated on construction."""

    aq: AttentionQuant

    def __post_init__(self) -> None:
        if not isinstance(self.aq, AttentionQuant):
            raise TypeError(f"aq must be a fxquant.schemes.AttentionQuant, got {type(self.aq).__name__}")
        for op in Operand:
            operand_code(op.of(self.aq), f"aq operand {op.label}")

    def tq(self, op: Operand) -> TensorQuant | None:
        return op.of(self.aq)

    def code(self, op: Operand) -> int:
        return operand_code(op.of(self.aq), op.label)

    def kind(self, op: Operand) -> Kind:
        """How ``op`` is quantized: not at all, element by element, or in MX blocks."""
        return Kind(self.code(op) & 3)

    def blocked_along(self, axis: Axis) -> bool:
        """Whether an MX operand is blocked along ``axis`` (then that tile size must be a multiple of 32)."""
        return any(op.axis is axis and self.kind(op) is Kind.MX for op in Operand)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class FlashBlocks:
    """Tile sizes: forward (``block_m`` query rows x ``block_n`` key columns) and backward (``bwd_m`` x
    ``bwd_n``). Powers of two >= 16; multiples of 32 where an MX operand is blocked along that axis.
    ``block_n`` is part of the forward's semantics (P is quantized per BLOCK_N tile of the online softmax);
    the other three only change fp32 accumulation order. The defaults measured fastest on an H100 at
    Llama-3.2-1B's attention shape (``benchmarks/bench_flash_tiles.py``; docs/flash_attention.md).

    Launch settings, speed only: ``fwd_warps`` / ``bwd_warps`` warps per program (a power of two <= 16;
    0: 4 for tiles of at most 64 x 64, else 8, at every head dimension) and ``fwd_stages`` / ``bwd_stages``
    Triton's software-pipelining depth (>= 1)."""

    block_m: int = 64
    block_n: int = 64
    bwd_m: int = 64
    bwd_n: int = 32
    fwd_warps: int = 0
    bwd_warps: int = 0
    fwd_stages: int = 2
    bwd_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "bwd_m", "bwd_n"):
            v = getattr(self, name)
            if not _is_int(v) or v < 16 or v & (v - 1):
                raise ValueError(f"FlashBlocks.{name}={v!r} must be a power of two >= 16")
        for name in ("fwd_warps", "bwd_warps"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0 or v > 16 or v & (v - 1):
                raise ValueError(f"FlashBlocks.{name}={v!r} must be 0 (chosen by tile size) or a power of two <= 16")
        for name in ("fwd_stages", "bwd_stages"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"FlashBlocks.{name}={v!r} must be an int >= 1")

    def launch(self, backward: bool) -> dict[str, int]:
        """Triton's launch options for the forward or the backward kernels."""
        bm, bn = (self.bwd_m, self.bwd_n) if backward else (self.block_m, self.block_n)
        warps = self.bwd_warps if backward else self.fwd_warps
        if not warps:
            warps = 4 if bm * bn <= 64 * 64 else 8
        return dict(num_warps=warps, num_stages=self.bwd_stages if backward else self.fwd_stages)

    def check(self, fq: FlashQuant) -> None:
        """MX blocks must lie inside one tile: 32 | tile size along every blocked axis."""
        needs = {Axis.LK: ("block_n", "bwd_n"), Axis.LQ: ("bwd_m",)}
        for axis, names in needs.items():
            if not fq.blocked_along(axis):
                continue
            for name in names:
                v = getattr(self, name)
                if v % MX_BLOCK:
                    raise ValueError(
                        f"FlashBlocks.{name}={v}: an MX operand is blocked along {axis.value}, so its 32-element "
                        f"blocks must lie inside one tile; use a multiple of {MX_BLOCK}"
                    )
