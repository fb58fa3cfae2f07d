"""Which implementation the quantize ops of a compiled graph run (``fxquant.compile(kernels=...)``).

``fxquant::quantize`` is a custom op: opaque to the compiler, it runs as one eager call per operand (the
pure-torch reference on CPU, a standalone Triton kernel on CUDA). Under ``Kernels.INDUCTOR`` AOT autograd
replaces every call by the reference's own arithmetic (``Format.quantize_traceable``): plain ATen ops over
the whole tensor, no slab loop, no host sync, which Inductor fuses into one kernel per operand (block amax,
scale, round, clamp, rescale) together with the ops around it, through its C++ codegen on CPU and its
Triton codegen on CUDA. Under Inductor the replacement is a post-grad pass (``LowerQuantize``): AOT
autograd traces, and its partitioner cuts, a graph with one node per quantize, and each of the forward and
backward graphs is expanded just before Inductor lowers it (under ``aot_eager`` the op is decomposed while
AOT traces). The result equals the reference bit for bit (``tests/test_formats_lowering.py``):

- a block's exponent comes from the float32 bits of its amax; an element rounds to nearest even by Veltkamp's
  splitting where its format's binades all have the same width (``_bits.round_nearest_bits``), otherwise from
  its binade by Rump's exact ``ufp`` and adding and subtracting 2**23 grid steps (``ElementSpec.quantize_steps``:
  no per-element bit reinterpretation or float8 conversion, which Inductor's C++ vectoriser does through
  memory); every multiplication by a power of two is exact; the per-element arithmetic reaches Inductor as one
  op (``fxquant::round_elements`` or ``fxquant::block_values``, the latter after ``fxquant::block_scales`` per
  block), each lowered by ``fxquant.pointwise_lowering`` into one pointwise computation;
- divisions are IEEE float32 divisions (``formats._bits.fdiv``): float32 ``/`` on CPU, where Inductor's C++
  keeps them divisions, and elsewhere float64 divisions rounded to float32, exact even where a backend
  divides approximately or by a reciprocal;
- every product that feeds a sum is a product with a power of two (exact), so contraction into FMA cannot change
  a value;
- no transcendental function is used.

Stochastic rounding with ``seed=None`` draws its seed inside the graph (``torch.randint``, no host sync) and
indexes the same counter-based uniforms as the reference; with an explicit seed it draws the reference's
numbers exactly.

On CUDA that holds for every format but NVFP4 (measured on an H200, torch 2.11, triton 3.6): there Inductor's
code for NVFP4's scales gives 1 / g as if the per-tensor scale g = amax / 2688 had not been rounded to float32
first, so a few elements per tensor (those whose scaled value lies within an ulp of a rounding boundary)
differ from the reference, and so did a linear site's output in its last bits. ``lowers_exactly`` says so; the op then
stays in the graph and its registered kernel runs (``LowerQuantize`` and the AOT-time decomposition skip it),
and ``resolve`` keeps a graph that quantizes in NVFP4 on CUDA off ``Kernels.INDUCTOR`` (``inexact_formats``).

Kernels:
    AUTO       INDUCTOR when the inner backend is Inductor and the lowering is exact for the graph's formats on
               its device (CPU: all; CUDA: all but NVFP4, measured faster than the Triton kernels in
               benchmarks/RESULTS.md); otherwise the op as registered (the Triton kernels on CUDA, the
               reference elsewhere)
    INDUCTOR   the traceable arithmetic, fused by Inductor (under aot_eager it runs op by op); refused under
               Inductor for a graph with a format in ``inexact_formats``
    TRITON     the op with the standalone Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1 after
               ``fxquant.kernels.register("cpu")``)
    REFERENCE  the op with the pure-torch reference on every device (CPU slab loop; the oracle)
"""
from __future__ import annotations

import enum
import functools
from typing import Iterable

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

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
    # Under dynamic shapes Dynamo may pass the int arguments as SymInts. The blocked dim is specialised (a guard:
    # the block layout depends on it); a seed is not (a seed that changes every call, such as the step number,
    # would recompile every call and fall back to eager at Dynamo's recompile limit): a SymInt seed enters the
    # graph as a 0-dim int64 tensor, which the uniforms' hash takes as it takes an int (its low 64 bits).
    dim = int(dim)
    check_tensor(x, dim)
    seed_: int | torch.Tensor = 0
    if tq.options.rounding is Rounding.SR:
        if seed is None:
            seed_ = torch.randint(0, SEED_HIGH, (), dtype=torch.int64, device=x.device)
        elif isinstance(seed, torch.SymInt):
            seed_ = torch.full((), seed, dtype=torch.int64, device=x.device)
        else:
            seed_ = int(seed)
    return tq.fmt.quantize_traceable(x, dim, tq.options, seed_)


def decompositions(kernels: Kernels, *, inductor: bool = False) -> dict:
    """Entries to add to AOT autograd's decomposition table for ``kernels`` (resolved, not AUTO). Under Inductor
    (``inductor=True``) INDUCTOR adds none: ``LowerQuantize`` expands the op after partitioning."""
    import fxquant.ops  # noqa: F401  (defines the ops)

    op = torch.ops.fxquant.quantize.default
    if kernels is Kernels.INDUCTOR:
        return {op: _aot_time_decomposition} if inductor else {op: quantize_traceable}
    if kernels is Kernels.REFERENCE:
        return {op: torch.ops.fxquant.quantize_reference.default}
    return {}


class DecompositionTable(dict):
    """AOT autograd's decomposition table under Inductor: Inductor's (``select_decomp_table``) plus fxquant's
    entries for ``kernels``. It pickles as the call that builds it, ``decomposition_table(kernels)``:
    Inductor's FX-graph and AOT-autograd caches put the table in their keys, and pickled entry by entry it
    holds a function with no stable pickle, for which both caches bypass the graph (a rerun would redo all of
    Inductor's code generation). The entries' code is keyed by ``passes.cache_key`` (fxquant's sources) and
    torch's version, which both caches key on."""

    def __init__(self, kernels: Kernels) -> None:
        from torch._inductor.decomposition import select_decomp_table

        super().__init__({**select_decomp_table(), **decompositions(kernels, inductor=True)})
        self.kernels = kernels

    def __reduce__(self) -> tuple:
        return decomposition_table, (self.kernels.value,)


def decomposition_table(kernels: Kernels | str) -> DecompositionTable:
    """The table ``compile_fx`` gets for a graph whose quantizes run ``kernels`` (resolved, not AUTO)."""
    return DecompositionTable(parse_kernels(kernels))


def register_fallback() -> None:
    """Give ``fxquant::quantize`` an Inductor fallback (its registered kernel, called as an extern op) before a
    graph that may keep it is lowered. Under ``Kernels.INDUCTOR`` the op is in the decomposition table (the
    AOT-time entry) and yet stays in the graph where it does not lower exactly (``lowers_exactly``); Inductor
    (torch >= 2.13) refuses to create an implicit fallback for an op that has a decomposition ("both a
    fallback and a decomp for same op"). The layout constraint is the one an implicit fallback would get."""
    import fxquant.ops  # noqa: F401  (defines the op)
    from torch._inductor import lowering as inductor_lowering
    from torch._library.utils import get_layout_constraint_tag

    op = torch.ops.fxquant.quantize.default
    if op in inductor_lowering.lowerings:
        return
    constraint = inductor_lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
    inductor_lowering.make_fallback(op, layout_constraint=constraint, override_decomp=True)


def _aot_time_decomposition(x: torch.Tensor, qspec: str, dim: int, seed: int | None = None) -> object:
    """AOT-time decomposition under Inductor only where the post-grad pass cannot do it: a SymInt ``dim``, ``seed``
    or shape (dynamic shapes: the block layout specialises on them here, with guards, which a post-grad pass
    cannot add), or an element format (``_post_grad``). Every other call stays one node for ``LowerQuantize``."""
    if not lowers_exactly(qspec, x.device.type):
        return NotImplemented  # stays the op: its registered kernel runs
    symbolic = isinstance(dim, torch.SymInt) or isinstance(seed, torch.SymInt)
    if symbolic or any(isinstance(n, torch.SymInt) for n in x.shape) or not _post_grad(qspec):
        return quantize_traceable(x, qspec, dim, seed)
    return NotImplemented


def lowers_exactly(qspec: str, device: str) -> bool:
    """Whether Inductor's code for this spec's lowering equals the reference on ``device``: everywhere but
    NVFP4 off CPU (module docstring). Where it does not, ``LowerQuantize`` and the AOT-time decomposition
    leave the op in the graph, and its registered kernel runs (the Triton kernel on CUDA)."""
    from fxquant.formats.nvfp4 import NVFP4Format
    from fxquant.ops import parse_qspec

    return device == "cpu" or not isinstance(parse_qspec(qspec).fmt, NVFP4Format)


@functools.lru_cache(maxsize=None)
def _post_grad(qspec: str) -> bool:
    """Whether ``LowerQuantize`` expands this spec after partitioning: block formats. An element format's
    arithmetic (no block amax; its rounding one ``fxquant::round_elements`` op) is expanded while AOT autograd
    traces, which compiles and runs faster: measured on the 2-layer Llama of ``benchmarks/bench_step.py``
    (2-core CPU), linear_hifp8's first step (the compile) takes 24.7 s that way against 27.2 s expanded after
    partitioning, and its step 1.08x plain against 1.13x. Block formats reach the partitioner as one node each
    (its min-cut over a block quantize's few dozen ops costs seconds)."""
    from fxquant.ops import parse_qspec

    return parse_qspec(qspec).fmt.block_size is not None


class LowerQuantize(CustomGraphPass):
    """Inductor post-grad pass: every ``fxquant::quantize`` node becomes ``quantize_traceable``'s ATen ops.

    Run on the forward and the backward graph after AOT autograd partitioned them, so the joint graph, the
    min-cut partitioner and AOT's tracing see one node per quantize instead of its few dozen ops. ``inner``:
    a pass the user had installed in the same slot, run first. ``uuid`` keys Inductor's caches on fxquant's
    sources (``passes.cache_key``).
    """

    def __init__(self, inner: object = None) -> None:
        self.inner = inner

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.inner is not None:
            self.inner(graph)
        traced: dict[tuple, torch.fx.GraphModule] = {}
        created: set[torch.fx.Node] = set()
        for node in list(graph.nodes):
            if (node.op == "call_function" and node.target is torch.ops.fxquant.quantize.default
                    and lowers_exactly(node.args[1], node.args[0].meta["val"].device.type)):
                created |= _expand(graph, node, traced)
        if created:
            _merge_duplicates(graph, created)

    def uuid(self) -> object:
        from fxquant.passes.cache_key import sources_hash

        if self.inner is None:
            return f"fxquant.LowerQuantize:{sources_hash()}"
        inner = self.inner.uuid() if isinstance(self.inner, CustomGraphPass) else None
        return None if inner is None else f"fxquant.LowerQuantize:{sources_hash()}:{inner!r}"


def _frozen(value: object) -> object:
    """A hashable stand-in for a node argument (nodes, numbers, dtypes as they are; containers as tuples)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_frozen(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _frozen(v)) for k, v in sorted(value.items())))
    if isinstance(value, slice):
        return ("slice", _frozen(value.start), _frozen(value.stop), _frozen(value.step))
    try:
        hash(value)
    except TypeError:
        return ("repr", type(value).__name__, repr(value))
    return (type(value).__name__, value)


def _merge_duplicates(graph: torch.fx.Graph, created: set[torch.fx.Node]) -> None:
    """Common-subexpression elimination among the nodes the quantizes' expansion ``created``. AOT autograd's CSE ran
    before, on one node per quantize, so two quantizes of one tensor (two formats, or one format blocked alike for two
    GEMMs) arrive as two copies of the same block-amax reduction; Inductor's C++ code generation fuses such twins of
    a bf16/fp16 reduction along a non-last dim into one kernel that declares the converted accumulator twice and does
    not compile. Merged, the reduction also runs once. Only deterministic functional calls with a tensor argument
    merge: random ops (``nondeterministic_seeded``), mutating ones and factories (an ``empty`` buffer must stay its
    own) are left alone, as is everything the expansion did not create."""
    seen: dict[tuple, torch.fx.Node] = {}
    for node in list(graph.nodes):
        target = node.target
        if (node not in created or node.op != "call_function" or not isinstance(target, torch._ops.OpOverload)
                or target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags
                or not any(isinstance(a, torch.fx.Node) for a in node.args)
                or target.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_like,
                                             torch.ops.aten.empty_strided, torch.ops.aten.new_empty)):
            continue
        key = (target, _frozen(node.args), _frozen(node.kwargs))
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
        else:
            seen[key] = node


def _expand(graph: torch.fx.Graph, node: torch.fx.Node, traced: dict) -> set[torch.fx.Node]:
    """Replace one quantize node by ``quantize_traceable``'s ops: traced once per (spec, dim, seed, input
    metadata) in the graph's fake mode, then copied, each copy's ``val`` recomputed on its own inputs."""
    from torch._inductor.pattern_matcher import fwd_only

    x, qspec, dim, *rest = node.args
    seed = rest[0] if rest else node.kwargs.get("seed")
    val = x.meta["val"]
    mode = torch._guards.detect_fake_mode([val])
    key = (qspec, dim, seed, tuple(val.shape), tuple(val.stride()), val.dtype, str(val.device))
    gm = traced.get(key)
    if gm is None:
        with mode:
            gm = traced[key] = fwd_only(lambda t: quantize_traceable(t, qspec, dim, seed), [val])
    meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta", "example_value")}
    env: dict[torch.fx.Node, object] = {}
    with graph.inserting_before(node):
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                env[n] = x
            elif n.op == "output":
                (out,) = n.args[0] if isinstance(n.args[0], (tuple, list)) else (n.args[0],)
                result = env[out]
            else:
                new = graph.node_copy(n, lambda a: env[a])
                new.meta = dict(meta)
                if new.op == "call_function":
                    args, kwargs = torch.fx.node.map_arg((new.args, new.kwargs), lambda a: a.meta["val"])
                    with mode:
                        new.meta["val"] = new.target(*args, **kwargs)
                env[n] = new
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return {n for n in env.values() if n is not x}


def inductor_config_patches() -> dict[str, object]:
    """Inductor settings under INDUCTOR kernels: the ``LowerQuantize`` post-grad pass (chaining a pass the user
    set there), float32 subnormals kept in generated Triton code (an MX scale of 2**-127 is one; Inductor's
    C++ code never flushes them), and no masked vector kernel for the remainder of a C++ loop
    (``cpp.enable_loop_tail_vec``): the scalar kernel, which Inductor generates for every loop anyway, runs
    the remainder instead. Inductor generates the masked kernel even for a loop with no remainder, the
    quantize arithmetic included, so this cuts the code generation of a compile (docs/compile.md, "Compile
    time"). Only settings this torch has are set."""
    from torch._inductor import config

    from fxquant import pointwise_lowering

    pointwise_lowering.register()
    register_fallback()
    existing = config.post_grad_custom_pre_pass
    patches: dict[str, object] = {
        "post_grad_custom_pre_pass": existing if isinstance(existing, LowerQuantize) else LowerQuantize(existing)
    }
    numerics = getattr(config, "eager_numerics", None)
    if hasattr(numerics, "disable_ftz"):
        patches["eager_numerics.disable_ftz"] = True
    if hasattr(config.cpp, "enable_loop_tail_vec"):
        patches["cpp.enable_loop_tail_vec"] = False
    return patches


def inductor_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """A ``torch.compile`` backend: Inductor with ``fxquant::quantize`` lowered (no fxquant passes), for a
    function that calls the op itself (``torch.compile(fn, backend=lowering.inductor_backend)``)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=inductor_config_patches(),
                      decompositions=decomposition_table(Kernels.INDUCTOR))


def graph_device(example_inputs: list) -> str:
    """"cuda" when any input of a graph is a CUDA tensor, else "cpu"."""
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            return "cuda"
    return "cpu"


def inexact_formats(configs: Iterable[object], device: str) -> list[str]:
    """The formats among the site configs ``configs`` (LinearQuant / AttentionQuant / None) that do not lower
    exactly on ``device`` (``lowers_exactly``)."""
    from fxquant.schemes.model import AttentionQuant, LinearQuant, attention_operands, linear_operands

    found = set()
    for cfg in configs:
        if isinstance(cfg, LinearQuant):
            table = linear_operands(cfg)
        elif isinstance(cfg, AttentionQuant):
            table = attention_operands(cfg)
        else:
            continue
        for operands in table.values():
            found.update(tq.format for tq in operands.values()
                         if tq is not None and not lowers_exactly(tq.spec(), device))
    return sorted(found)


def resolve(kernels: Kernels, *, inductor: bool, device: str, inexact: Iterable[str] = ()) -> Kernels:
    """The implementation ``kernels`` stands for in a graph compiled by Inductor (or not) on ``device`` whose
    formats include ``inexact`` (``inexact_formats``: those the lowering does not reproduce bit for bit there).

    Raises ValueError for TRITON where the Triton kernels cannot run, and for INDUCTOR under Inductor with an
    inexact format."""
    inexact = list(inexact)
    if kernels is Kernels.AUTO:
        if inductor and device in ("cpu", "cuda") and not inexact:
            return Kernels.INDUCTOR
        return Kernels.TRITON if _triton_registered(device) else Kernels.REFERENCE
    if kernels is Kernels.INDUCTOR and inductor and inexact:
        raise ValueError(
            f"kernels='inductor': Inductor's code on {device!r} does not reproduce the reference bit for bit for "
            f"{', '.join(inexact)} (docs/kernels.md); allowed here: 'auto' (which then uses "
            f"{'the Triton kernels' if _triton_registered(device) else 'the reference'}), 'triton', 'reference'"
        )
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
