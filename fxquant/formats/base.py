"""The public ``Format`` interface: quantize / encode / decode, input validation and layout.

Every format computes in float32 on a canonical layout: ``dim`` moved last, contiguous, viewed as
``[rows, L]``. Stochastic rounding indexes its random stream by the flat position in that layout, so a
kernel that sees the same layout draws the same numbers (FORMATS.md, "Rounding modes": reproducible
from an explicit seed).
"""
from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass, field

import torch

from fxquant.formats._bits import uniforms
from fxquant.formats.options import QuantOptions, Rounding, parse_enum

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Encoded:
    """Codes and scales of one encoded tensor; ``Format.decode`` turns it back into values.

    codes: uint8, the input's shape (one code per element; bf16/fp16 give int32 bit patterns).
    scales: uint8 per block (E8M0 for MX, E4M3 for NVFP4), the input's shape with ``dim`` holding the
        number of blocks; None for element formats.
    tensor_scale: float32 0-dim: NVFP4's g, or the per-tensor factor that decoded elements are
        multiplied by (2**-k) with ``scaling="tensor"``; None otherwise.
    """

    format: str
    codes: torch.Tensor
    scales: torch.Tensor | None
    tensor_scale: torch.Tensor | None
    dim: int
    dtype: torch.dtype
    options: QuantOptions = field(repr=False, default=None)  # type: ignore[assignment]


def check_tensor(x: object, dim: int) -> int:
    """Validate the input tensor and ``dim``; return ``dim`` normalised to [0, ndim)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        allowed = [str(d) for d in SUPPORTED_DTYPES]
        raise ValueError(f"x has dtype {x.dtype}; quantize takes floating tensors of dtype {allowed}")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    nd = max(x.dim(), 1)
    if not -nd <= dim < nd:
        raise ValueError(f"dim={dim} is out of range for a tensor of {x.dim()} dimensions: allowed [{-nd}, {nd - 1}]")
    return dim % nd


def to_canonical(x: torch.Tensor, dim: int, float32: bool = True) -> torch.Tensor:
    """``dim`` last, contiguous, 2-D ``[rows, L]`` (a 0-dim tensor becomes ``[1, 1]``), in float32 unless
    ``float32=False`` (formats whose first float32 operation promotes exactly skip the extra pass)."""
    x32 = x.reshape(1) if x.dim() == 0 else x
    x32 = x32.movedim(dim, -1).to(torch.float32 if float32 else x.dtype, memory_format=torch.contiguous_format)
    length = x32.shape[-1]
    rows = x32.numel() // length if length else int(torch.Size(x32.shape[:-1]).numel())
    return x32.reshape(rows, length)


def restore_layout(y: torch.Tensor, shape: torch.Size, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inverse of ``to_canonical``: ``[rows, L]`` back to ``shape``, contiguous, cast to ``dtype`` (one pass)."""
    dtype = y.dtype if dtype is None else dtype
    if len(shape) == 0:
        return y.reshape(()).to(dtype)
    moved = list(shape)
    moved.append(moved.pop(dim))
    view = y.reshape(moved).movedim(-1, dim)
    if view.dtype == dtype and view.is_contiguous():
        return view
    return torch.empty(shape, dtype=dtype, device=y.device).copy_(view)


def resolve_seed(rounding: Rounding, seed: int | None) -> int:
    """The seed of a stochastic-rounding call: the given one, or one drawn from torch's default generator."""
    if rounding is not Rounding.SR:
        return 0
    if seed is None:
        return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    return seed


def draw_uniforms(
    rounding: Rounding, seed: int, shape: torch.Size, device: torch.device, offset: int = 0
) -> torch.Tensor | None:
    """The stochastic-rounding uniforms of a ``shape`` slab starting at flat canonical index ``offset``."""
    if rounding is not Rounding.SR:
        return None
    return uniforms(int(torch.Size(shape).numel()), seed, device, offset).reshape(shape)


# Rows of the canonical layout are quantized in slabs of about this many elements on CPU: the reference makes
# about ten passes over each, and a slab's temporaries (~1 MiB each in float32) stay in cache. Results are
# identical to one pass over the whole tensor (per-tensor quantities are computed once; SR keeps its index).
CHUNK_ELEMENTS = 1 << 18


def straight_through(x: torch.Tensor, values) -> torch.Tensor:
    """``values(x)``, differentiable with the straight-through estimator where autograd records (the gradient
    reaches ``x`` unchanged), as ``fxquant::quantize``'s autograd is."""
    if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
        return _StraightThrough.apply(x, values)
    return values(x)


class _StraightThrough(torch.autograd.Function):
    """``values(x)`` forward (computed without autograd), the gradient passed to ``x`` unchanged backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, values) -> torch.Tensor:
        return values(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class Format(abc.ABC):
    """A number format. Subclasses are frozen dataclasses holding the format's data."""

    name: str
    block_size: int | None = None
    canonical_float32 = True  # False: _quantize/_encode_canonical accept the input dtype as it is
    option_names: tuple[str, ...] = ()  # the keyword options of the class's ``resolve``, set per class

    def __init_subclass__(cls, **kwargs: object) -> None:
        # Read once per class, not per call (quantize validates every call) and not through a cache wrapper,
        # which Dynamo warns about when it traces a compiled quantize.
        super().__init_subclass__(**kwargs)
        params = inspect.signature(cls.resolve).parameters.values()
        cls.option_names = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)

    # -- options -----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def resolve(self, **options: object) -> QuantOptions:
        """Fill defaults (None -> the format's default) and validate every option value."""

    def inapplicable_option(self, options: dict[str, object]) -> str | None:
        """Why one of ``options`` (name -> value; None values are unset) is not an option of this format, or None."""
        key = next((k for k, v in options.items() if v is not None and k not in self.option_names), None)
        if key is None:
            return None
        why = ""
        if key in ("scaling", "scale_target"):
            blocks = f", which is block-scaled (blocks of {self.block_size})" if self.block_size else ""
            why = f"{blocks}: per-tensor scaling (scaling, scale_target) applies to element formats only (e.g. fp8_e4m3)"
        return (f"{key}={options[key]!r} does not apply to format {self.name!r}{why}; the options of {self.name!r} "
                f"are {', '.join(self.option_names)}")

    def _rounding(self, value: object, default: str) -> Rounding:
        return parse_enum(Rounding, default if value is None else value, "rounding")

    # -- the reference -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _quantize_canonical(
        self, x2: torch.Tensor, opts: QuantOptions, seed: int, *, ctx: object = None, offset: int = 0,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Fake-quantize ``[rows, L]``; returns ``out_dtype`` (float32 values cast with ``Tensor.to``) of the same
        shape. For a slab of a larger tensor, ``ctx`` is ``_tensor_context`` of the whole tensor and ``offset``
        the slab's first flat index. Block formats cast before un-blocking, so a compiler keeps one loop nest."""

    def _tensor_context(self, x2: torch.Tensor, opts: QuantOptions) -> object:
        """What depends on the whole tensor (NVFP4's amax, a per-tensor scale), computed once; None if nothing."""
        return None

    def check_shape(self, x: torch.Tensor, dim: int, opts: QuantOptions) -> None:
        """Raise ValueError if ``opts`` cannot quantize a tensor of ``x``'s shape along ``dim`` (NVFP4's 2-D blocks
        need a 2-D tensor); every shape is fine otherwise."""

    def row_group(self, opts: QuantOptions) -> int:
        """Rows of the canonical layout that share scales (16 for NVFP4's 2-D blocks, else 1): a slab of rows
        (``_quantize_rows``) holds whole groups."""
        return 1

    def _quantize_rows(
        self, x2: torch.Tensor, opts: QuantOptions, seed: int, out_dtype: torch.dtype, chunk_elements: int = CHUNK_ELEMENTS
    ) -> torch.Tensor:
        """``_quantize_canonical`` over slabs of rows (CPU, eager), or in one go."""
        rows, length = x2.shape
        group = self.row_group(opts)
        step = max(1, chunk_elements // max(length, 1) // group) * group
        if rows <= step or x2.device.type != "cpu" or torch.compiler.is_compiling():
            return self._quantize_canonical(x2, opts, seed, out_dtype=out_dtype)
        ctx = self._tensor_context(x2, opts)
        out = torch.empty(x2.shape, dtype=out_dtype, device=x2.device)
        for r0 in range(0, rows, step):
            out[r0 : r0 + step] = self._quantize_canonical(x2[r0 : r0 + step], opts, seed, ctx=ctx, offset=r0 * length)
        return out

    @abc.abstractmethod
    def _encode_canonical(self, x2: torch.Tensor, opts: QuantOptions, seed: int) -> tuple:
        """(codes [rows, L], scales [rows, nblocks] or None, tensor_scale or None)."""

    @abc.abstractmethod
    def _decode_canonical(self, codes: torch.Tensor, scales, tensor_scale, opts: QuantOptions) -> torch.Tensor:
        """float32 ``[rows, L]`` values from canonical codes and scales."""

    # -- public API ----------------------------------------------------------------------------------------
    def _prepare(self, x: torch.Tensor, dim: int, seed: int | None, **options: object) -> tuple[int, QuantOptions, int]:
        """Validate the call: (dim normalised, resolved options, the stochastic-rounding seed)."""
        d = check_tensor(x, dim)
        allowed = self.option_names
        unknown = [k for k in options if k not in allowed]
        if unknown:
            raise TypeError(f"{self.name} has no option {unknown[0]!r}; its options: {', '.join(allowed)}, seed")
        opts = self.resolve(**options)
        self.check_shape(x, d, opts)
        return d, opts, resolve_seed(opts.rounding, seed)

    def quantize(
        self,
        x: torch.Tensor,
        dim: int = -1,
        *,
        rounding: object = None,
        scale_mode: object = None,
        saturate: bool | None = None,
        seed: int | None = None,
        **extra: object,
    ) -> torch.Tensor:
        """Fake-quantize ``x``: nearest representable values, same shape, dtype and device; ``x`` untouched.

        ``None`` options take the format's default (FORMATS.md). ``dim`` is the blocked dimension of
        block formats. ``seed`` makes stochastic rounding reproducible (drawn from torch's generator
        when None). Differentiable with the straight-through estimator, like ``fxquant::quantize``: the
        gradient reaches ``x`` unchanged.
        """
        d, opts, seed_ = self._prepare(x, dim, seed, rounding=rounding, scale_mode=scale_mode, saturate=saturate, **extra)

        def values(t: torch.Tensor) -> torch.Tensor:
            if t.numel() == 0:
                return t.clone()
            y = self._quantize_rows(to_canonical(t, d, self.canonical_float32), opts, seed_, t.dtype)
            return restore_layout(y, t.shape, d, t.dtype)

        return straight_through(x, values)

    def quantize_traceable(self, x: torch.Tensor, dim: int, opts: QuantOptions, seed: int | torch.Tensor) -> torch.Tensor:
        """``quantize`` for compilers: the same arithmetic over the whole tensor, as plain ATen ops.

        No slab loop, no data-dependent Python control flow and no host sync, so torch.compile can trace it
        and Inductor fuse it (``fxquant.lowering``). ``opts`` are resolved; ``seed`` is a Python int or a 0-dim
        int64 tensor (a seed drawn inside the graph). The result equals ``quantize`` bit for bit; its layout is
        whatever the arithmetic gives (not forced contiguous), so a consumer may fuse the layout change.
        """
        d = check_tensor(x, dim)
        self.check_shape(x, d, opts)
        if x.numel() == 0:
            return x.clone()
        if self.block_size is None and opts.rounding is not Rounding.SR:
            # Element-wise with no random stream: the layout does not matter, so x is quantized as it lies and
            # calls that differ only in dim trace to the same ops (AOT's CSE merges them: one pass, not two).
            return self._quantize_canonical(x, opts, seed, out_dtype=x.dtype)
        y = self._quantize_canonical(to_canonical(x, d, self.canonical_float32), opts, seed, out_dtype=x.dtype)
        if x.dim() == 0:
            return y.reshape(())
        moved = list(x.shape)
        moved.append(moved.pop(d))
        return y.reshape(moved).movedim(-1, d)

    def encode(
        self,
        x: torch.Tensor,
        dim: int = -1,
        *,
        rounding: object = None,
        scale_mode: object = None,
        saturate: bool | None = None,
        seed: int | None = None,
        **extra: object,
    ) -> Encoded:
        """Integer codes and scales of ``quantize(x, ...)``; ``decode(encode(x)) == quantize(x)`` bitwise."""
        d, opts, seed_ = self._prepare(x, dim, seed, rounding=rounding, scale_mode=scale_mode, saturate=saturate, **extra)
        x2 = to_canonical(x, d, self.canonical_float32)
        codes, scales, tscale = self._encode_canonical(x2, opts, seed_)
        codes = restore_layout(codes, x.shape, d)
        if scales is not None:
            shape = list(x.shape) if x.dim() else [1]
            shape[d] = scales.shape[-1]
            moved = shape[:d] + shape[d + 1 :] + [shape[d]]
            scales = scales.reshape(moved).movedim(-1, d).contiguous()
            if x.dim() == 0:
                scales = scales.reshape(())
        return Encoded(self.name, codes, scales, tscale, d, x.dtype, opts)

    def decode(self, enc: Encoded) -> torch.Tensor:
        """Values of an ``Encoded``, in the dtype of the tensor it was encoded from."""
        if not isinstance(enc, Encoded):
            raise TypeError(f"decode takes an Encoded, got {type(enc).__name__}")
        if enc.format != self.name:
            raise ValueError(f"this Encoded holds format {enc.format!r}, not {self.name!r}")
        codes2 = to_canonical(enc.codes.to(torch.float32), enc.dim).to(torch.int64)
        scales2 = None
        if enc.scales is not None:
            s = enc.scales.reshape(1) if enc.scales.dim() == 0 else enc.scales
            scales2 = s.movedim(enc.dim, -1).contiguous().reshape(codes2.shape[0], s.shape[enc.dim])
        y = self._decode_canonical(codes2, scales2, enc.tensor_scale, enc.options)
        return restore_layout(y, enc.codes.shape, enc.dim, enc.dtype)

    def __str__(self) -> str:
        return self.name
