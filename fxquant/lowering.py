"""Which implementation the quantize ops of a compiled graph run (``fxquant.compile(kernels=...)``).

``fxquant::quantize`` is a custom op: opaque to the compiler, it runs as one eager call per operand (the
pure-torch reference on CPU, a standalone Triton kernel on CUDA). Under ``Kernels.INDUCTOR`` AOT autograd
replaces every call by the reference's own arithmetic (``Format.quantize_traceable``): plain ATen ops over
the whole tensor, no slab loop, no host sync, which Inductor fuses into one kernel per operand (block amax,
scale, round, clamp, rescale) together with the ops around it, through its C++ codegen on CPU and its
Triton codegen on CUDA. The result equals the reference bit for bit (``tests/test_formats_lowering.py``):

- exponents and powers of two come from float32 bits, and every multiplication by a power of two is exact;
- divisions are float64 divisions rounded to float32 (``formats._bits.fdiv``), equal to IEEE float32
  division even where a backend divides approximately or by a reciprocal;
- no sum of a product appears in the rounding arithmetic, so contraction into FMA cannot change a value;
- no transcendental function is used; rounding is ``round`` (ties to even), ``floor`` and comparisons.

Stochastic rounding with ``seed=None`` draws its seed inside the graph (``torch.randint``, no host sync) and
indexes the same counter-based uniforms as the reference; with an explicit seed it draws the reference's
numbers exactly.

Kernels:
    AUTO       INDUCTOR when the inner backend is Inductor and the graph runs on CPU; otherwise the op as
               registered (the Triton kernels on CUDA, the reference elsewhere)
    INDUCTOR   the traceable arithmetic, fused by Inductor (under aot_eager it runs op by op)
    TRITON     the op with the standalone Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1 after
               ``fxquant.kernels.register("cpu")``)
    REFERENCE  the op with the pure-torch reference on every device (CPU slab loop; the oracle)
"""
from __future__ import annotations

import enum

import torch

from fxquant.formats.base import check_tensor
from fxquant.formats.options import Rounding, parse_enum

SEED_HIGH = 2**62  # seeds drawn inside a graph are uniform in [0, 2**62), as the reference's resolve_seed


class Kernels(str, enum.Enum):
    AUTO = "auto"
    INDUCTOR = "inductor"
    TRITON = "triton"
    REFERENCE = "reference"


def parse_kernels(value: object) -> Kernels:
    return parse_enum(Kernels, value, "kernels")


def quantize_traceable(x: torch.Tensor, qspec: str, dim: int, seed: int | None = None) -> torch.Tensor:
    """``fxquant::quantize(x, qspec, dim, seed)`` as traceable ATen ops (the decomposition AOT autograd uses)."""
    from fxquant.ops import parse_qspec

    tq = parse_qspec(qspec)
    # Under dynamic shapes Dynamo may pass the int arguments as SymInts: specialise them (a guard), since the
    # block layout and the random stream depend on their values.
    dim = int(dim)
    seed = None if seed is None else int(seed)
    check_tensor(x, dim)
    seed_: int | torch.Tensor = 0
    if tq.options.rounding is Rounding.SR:
        seed_ = seed if seed is not None else torch.randint(0, SEED_HIGH, (), dtype=torch.int64, device=x.device)
    return tq.fmt.quantize_traceable(x, dim, tq.options, seed_)


def decompositions(kernels: Kernels) -> dict:
    """Entries to add to AOT autograd's decomposition table for ``kernels`` (resolved, not AUTO)."""
    import fxquant.ops  # noqa: F401  (defines the ops)

    op = torch.ops.fxquant.quantize.default
    if kernels is Kernels.INDUCTOR:
        return {op: quantize_traceable}
    if kernels is Kernels.REFERENCE:
        return {op: torch.ops.fxquant.quantize_reference.default}
    return {}


def inductor_config_patches() -> dict[str, object]:
    """Inductor settings under INDUCTOR kernels: keep float32 subnormals in generated Triton code (an MX scale
    of 2**-127 is one). Only settings this torch has are set; Inductor's C++ code never flushes them."""
    from torch._inductor import config

    numerics = getattr(config, "eager_numerics", None)
    return {"eager_numerics.disable_ftz": True} if hasattr(numerics, "disable_ftz") else {}


def inductor_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """A ``torch.compile`` backend: Inductor with ``fxquant::quantize`` lowered (no fxquant passes), for a
    function that calls the op itself (``torch.compile(fn, backend=lowering.inductor_backend)``)."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    table = {**select_decomp_table(), **decompositions(Kernels.INDUCTOR)}
    return compile_fx(gm, example_inputs, config_patches=inductor_config_patches(), decompositions=table)


def graph_device(example_inputs: list) -> str:
    """"cuda" when any input of a graph is a CUDA tensor, else "cpu"."""
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            return "cuda"
    return "cpu"


def resolve(kernels: Kernels, *, inductor: bool, device: str) -> Kernels:
    """The implementation ``kernels`` stands for in a graph compiled by Inductor (or not) on ``device``.

    Raises ValueError for TRITON where the Triton kernels cannot run."""
    if kernels is Kernels.AUTO:
        if inductor and device == "cpu":
            return Kernels.INDUCTOR
        return Kernels.TRITON if _triton_registered(device) else Kernels.REFERENCE
    if kernels is Kernels.TRITON and not _triton_registered(device):
        raise ValueError(
            f"kernels='triton' needs the Triton kernels registered for {device!r}: a CUDA device with Triton "
            "installed, or on CPU TRITON_INTERPRET=1 and fxquant.kernels.register('cpu'); allowed here: "
            "'auto', 'inductor', 'reference'"
        )
    return kernels


def _triton_registered(device: str) -> bool:
    from fxquant import kernels

    return kernels.registered(device)
