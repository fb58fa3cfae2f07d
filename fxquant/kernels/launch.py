"""Checked Python wrappers that launch the Triton quantize kernels, exactly like the reference's public path.

``quantize(x, tq, dim, seed)`` validates its input with the reference's own checks, puts ``x`` in the
canonical layout (``dim`` last, contiguous, ``[rows, L]``, in x's own dtype: the kernels widen to float32
on load and round back on store), runs the pre-pass a format needs (the tensor amax of per-tensor scaling
and NVFP4; with NVFP4's ``block_2d``, each block's 16x16 tile amax, the tensor amax their largest),
launches with keyword arguments and restores the layout. The result equals ``tq.quantize(x, dim,
seed=seed)`` bit for bit.

Importing this module imports Triton and defines the kernels: under ``TRITON_INTERPRET=1`` they run on
CPU tensors, otherwise they compile for the GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from triton.runtime.interpreter import InterpretedFunction

from fxquant.formats._bits import seed_key
from fxquant.formats.base import check_tensor, resolve_seed, restore_layout
from fxquant.formats.element import E2M1, E4M3, ElementSpec, HiF8
from fxquant.formats.mx import MXFormat, blocks, tile_amax
from fxquant.formats.nvfp4 import GLOBAL_DIVISOR, NVFP4Format
from fxquant.formats.options import QuantOptions, Rounding, Scaling
from fxquant.formats.scalar import ElementFormat, tensor_scale_exponent
from fxquant.formats.tensor_quant import TensorQuant
from fxquant.kernels._quantize import _quantize_element_kernel, _quantize_mx_kernel, _quantize_nvfp4_kernel

# Fixed when the kernels were decorated: TRITON_INTERPRET=1 at that moment makes them CPU-interpreted.
INTERPRETED = isinstance(_quantize_element_kernel, InterpretedFunction)


@dataclass(frozen=True)
class KernelLaunch:
    """Launch settings of the quantize kernels, speed only (results are the same bits for any): ``elements``
    per program (a power of two, at least one block; 0: 2048 on a GPU, 65536 in the interpreter) and
    ``warps`` per program (a power of two <= 32; 0: 8 for element formats, 4 for block formats)."""

    elements: int = 0
    warps: int = 0

    def __post_init__(self) -> None:
        for name, top in (("elements", 1 << 20), ("warps", 32)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > top or v & (v - 1):
                raise ValueError(f"KernelLaunch.{name}={v!r} must be 0 (the default) or a power of two <= {top}")

    def per_program(self) -> int:
        return self.elements or (1 << 16 if INTERPRETED else 2048)

    def num_warps(self, blocked: bool) -> int:
        return self.warps or (4 if blocked else 8)


DEFAULT_LAUNCH = KernelLaunch()


def element_constexprs(spec: ElementSpec, prefix: str = "") -> dict[str, object]:
    """The element format's data as kernel constexprs (``EMIN``, ``MBITS``, ``MAX_NORMAL``, ...)."""
    return {
        f"{prefix}EMIN": spec.emin,
        f"{prefix}MBITS": spec.mbits,
        f"{prefix}MAX_NORMAL": float(spec.max_normal),
        f"{prefix}HAS_INF": spec.has_inf,
        f"{prefix}SIGNED_ZERO": spec.signed_zero,
    }


def _overflow_to_inf(spec: ElementSpec, opts: QuantOptions) -> bool:
    """``ElementSpec.quantize``'s overflow rule: Inf only with Inf in the format, saturate=False, not rz."""
    return spec.has_inf and not opts.saturate and opts.rounding is not Rounding.RZ


def _check_device(x: torch.Tensor) -> None:
    if x.device.type == "cuda" and not INTERPRETED:
        return
    if x.device.type == "cpu" and INTERPRETED:
        return
    if INTERPRETED:
        hint = ("they run CPU tensors only (move x to the CPU, or start the process without TRITON_INTERPRET for "
                "CUDA tensors)")
    else:
        hint = "they run CUDA tensors only (set TRITON_INTERPRET=1 before fxquant.kernels is first imported to run them on CPU)"
    mode = "the Triton interpreter (TRITON_INTERPRET=1)" if INTERPRETED else "the GPU"
    raise ValueError(f"x is on device {x.device}; the Triton kernels were built for {mode}: {hint}")


def _canonical(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x in its own dtype, ``dim`` last, contiguous, as ``[rows, L]`` (``base.to_canonical`` minus the upcast)."""
    xc = x.reshape(1) if x.dim() == 0 else x
    xc = xc.movedim(dim, -1).contiguous()
    return xc.reshape(-1, xc.shape[-1])


def quantize(
    x: torch.Tensor, tq: TensorQuant, dim: int = -1, seed: int | None = None, launch: KernelLaunch = DEFAULT_LAUNCH
) -> torch.Tensor:
    """Fake-quantize ``x`` along ``dim`` per ``tq`` with the Triton kernels; equals ``tq.quantize`` bitwise
    (``launch``: the kernels' launch settings, speed only)."""
    if not isinstance(tq, TensorQuant):
        raise TypeError(f"tq must be a TensorQuant, got {type(tq).__name__}")
    if not isinstance(launch, KernelLaunch):
        raise TypeError(f"launch must be a KernelLaunch, got {type(launch).__name__}")
    d = check_tensor(x, dim)
    opts = tq.options
    tq.fmt.check_shape(x, d, opts)  # NVFP4's 16x16 tiles (block_2d) need a 2-D tensor
    seed_ = resolve_seed(opts.rounding, seed)
    if x.numel() == 0:
        return x.clone()
    _check_device(x)
    fmt = tq.fmt
    key = seed_key(seed_)
    if isinstance(fmt, ElementFormat):
        if opts.rounding is Rounding.SR:  # the random stream follows the canonical layout
            return restore_layout(_element(_canonical(x, d), fmt, opts, key, launch), x.shape, d)
        return _element(x.contiguous(), fmt, opts, key, launch).reshape(x.shape)  # element-wise: layout is free
    if isinstance(fmt, MXFormat):
        return restore_layout(_mx(_canonical(x, d), fmt, opts, key, launch), x.shape, d)
    if isinstance(fmt, NVFP4Format):
        return restore_layout(_nvfp4(_canonical(x, d), fmt, opts, key, launch), x.shape, d)
    raise TypeError(f"no Triton kernel for format {fmt.name!r} ({type(fmt).__name__})")  # pragma: no cover


def abs_max(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``x.abs().amax(dim)`` in float32 without materialising ``|x|``: one ``torch.aminmax`` pass over ``x``, the
    amax ``|max(-min, max)|`` (exact in any float dtype; a NaN propagates; +0 for a tensor of zeros of either
    sign, which the pre-passes' zero tests need)."""
    lo, hi = torch.aminmax(x) if dim is None else torch.aminmax(x, dim=dim)
    return torch.maximum(-lo, hi).abs().to(torch.float32)


def _element(xc: torch.Tensor, fmt: ElementFormat, opts: QuantOptions, key: int, launch: KernelLaunch) -> torch.Tensor:
    spec = fmt.element
    y = torch.empty_like(xc)
    if opts.scaling is Scaling.TENSOR:
        amax = abs_max(xc)
        k_buf = tensor_scale_exponent(amax.reshape(1, 1), opts.scale_target).reshape(1)
    else:
        k_buf = xc  # unused by the kernel
    n = xc.numel()
    block = launch.per_program()
    _quantize_element_kernel[(triton.cdiv(n, block),)](
        x_ptr=xc,
        y_ptr=y,
        k_ptr=k_buf,
        n_elements=n,
        seed_key=key,
        BLOCK=block,
        HAS_SCALE=opts.scaling is Scaling.TENSOR,
        ROUNDING=opts.rounding.value,
        OVERFLOW_INF=_overflow_to_inf(spec, opts),
        TAPERED=isinstance(spec, HiF8),
        **element_constexprs(spec),
        num_warps=launch.num_warps(False),
        enable_fp_fusion=False,
    )
    return y


def _block_launch(xc: torch.Tensor, block_size: int, launch: KernelLaunch) -> tuple[dict[str, object], int]:
    """Grid size and shape arguments shared by the block kernels."""
    rows, cols = xc.shape
    n_blocks_row = math.ceil(cols / block_size)
    block_b = max(1, launch.per_program() // block_size)
    args = dict(
        n_rows=rows,
        n_cols=cols,
        n_blocks_row=n_blocks_row,
        BLOCK_SIZE=block_size,
        BLOCK_B=block_b,
        EVEN_COLS=cols % block_size == 0,
    )
    return args, triton.cdiv(rows * n_blocks_row, block_b)


def _mx(xc: torch.Tensor, fmt: MXFormat, opts: QuantOptions, key: int, launch: KernelLaunch) -> torch.Tensor:
    spec = fmt.element
    y = torch.empty_like(xc)
    args, grid = _block_launch(xc, fmt.block_size, launch)
    _quantize_mx_kernel[(grid,)](
        x_ptr=xc,
        y_ptr=y,
        seed_key=key,
        **args,
        SCALE_MODE=opts.scale_mode.value,
        ROUNDING=opts.rounding.value,
        ELEM_EMAX=spec.emax,
        MANT_SCALE=float(2**spec.mbits),
        TAPERED=isinstance(spec, HiF8),
        **element_constexprs(spec),
        num_warps=launch.num_warps(True),
        enable_fp_fusion=False,
    )
    return y


def _tile_amaxes(xc: torch.Tensor, block_size: int) -> torch.Tensor:
    """NVFP4 ``block_2d``: each block's 16x16 tile amax, float32 ``[rows, n_blocks_row]`` contiguous (flat block
    index ``row * n_blocks_row + j``), as the reference takes it (``mx.blocks``, ``mx.tile_amax``); exact in any
    input dtype, NaN propagates."""
    amax_b = tile_amax(abs_max(blocks(xc, block_size), -1).unsqueeze(-1), block_size)
    return amax_b.squeeze(-1).to(torch.float32).contiguous()  # the last group's rows may be an expanded view


def _nvfp4(xc: torch.Tensor, fmt: NVFP4Format, opts: QuantOptions, key: int, launch: KernelLaunch) -> torch.Tensor:
    y = torch.empty_like(xc)
    if opts.block_2d:
        block_amax = _tile_amaxes(xc, fmt.block_size)
        amax = block_amax.amax().reshape(1)  # the largest tile amax is the tensor's: no second pass over x
    else:
        block_amax = xc  # unused by the kernel
        amax = abs_max(xc).reshape(1)  # the tensor amax pre-pass
    args, grid = _block_launch(xc, fmt.block_size, launch)
    _quantize_nvfp4_kernel[(grid,)](
        x_ptr=xc,
        y_ptr=y,
        amax_ptr=amax,
        block_amax_ptr=block_amax,
        seed_key=key,
        **args,
        HAS_BLOCK_AMAX=opts.block_2d,
        ROUNDING=opts.rounding.value,
        GLOBAL_DIVISOR=GLOBAL_DIVISOR,
        **element_constexprs(E2M1),
        **element_constexprs(E4M3, prefix="S_"),
        S_MIN_SUBNORMAL=float(E4M3.min_subnormal),
        num_warps=launch.num_warps(True),
        enable_fp_fusion=False,
    )
    return y
