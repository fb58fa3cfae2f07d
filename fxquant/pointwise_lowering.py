"""Inductor lowerings of the ops a traced quantize records, ``fxquant::round_elements`` (an element format's
rounding), ``fxquant::block_scales`` (a block format's inverse scale and scale per block, from its amaxes) and
``fxquant::block_values`` (a block format's values from x and its scales): each output becomes one pointwise
computation that evaluates every step of the reference arithmetic once per element. NVFP4's scales are
realised as buffers (a per-block loop of their own); MX's are inlined into the per-element loop.

Inductor lowers an ATen graph node by node, and the code of a node that is inlined into its consumers is
generated again for every use: an operand shared at several depths (the binade of ``ufp``, used three times, from
a clamp used twice; a block's exponent, read by its scale and by its inverse) is regenerated once per path
through the graph, so the Python code generation of a few dozen quantize ops grows to hundreds or thousands of
op calls per kernel variant. These lowerings trace the op's own Python implementation (the reference
arithmetic, with fake tensors, as a compiler sees it) into an ATen graph once per signature, and run that graph
inside a single ``Pointwise`` inner function, each ATen op mapped to the Inductor op of the same semantics:
every intermediate is a variable computed once, the generated code is the same arithmetic in the same order, and
the result equals the reference bit for bit (tests/test_formats_lowering.py, tests/test_formats_steps.py). A
nested ``round_elements`` (in ``block_scales`` and ``block_values``) is interpreted in place. A graph with an ATen
op outside the table, or with inputs of different sizes, is lowered by Inductor's own lowerings instead (the
same values).

``register()`` installs all three (idempotent); ``fxquant.lowering`` calls it before Inductor compiles a graph, and
the ops' fake implementations call it when Inductor is loaded.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

log = logging.getLogger(__name__)

aten = torch.ops.aten
prims = torch.ops.prims


@functools.lru_cache(maxsize=None)
def _ops_table() -> dict:
    """ATen op -> function of Inductor ``ops`` values (scalars already made constants of the operand's dtype).
    ``ops`` dispatches to the handler current at call time, so one table serves every kernel."""
    from torch._inductor.virtualized import ops

    return {
        aten.abs.default: ops.abs,
        aten.neg.default: ops.neg,
        aten.add.Tensor: ops.add,
        aten.sub.Tensor: ops.sub,
        aten.mul.Tensor: ops.mul,
        aten.clamp_min.default: ops.maximum,  # NaN-propagating, as Inductor lowers clamp_min
        aten.clamp_max.default: ops.minimum,
        aten.copysign.Tensor: ops.copysign,
        aten.eq.Tensor: ops.eq,
        aten.eq.Scalar: ops.eq,
        aten.gt.Tensor: ops.gt,
        aten.gt.Scalar: ops.gt,
        aten.ge.Tensor: ops.ge,
        aten.ge.Scalar: ops.ge,
        aten.lt.Tensor: ops.lt,
        aten.lt.Scalar: ops.lt,
        aten.le.Scalar: ops.le,
        aten.ne.Tensor: ops.ne,
        aten.ne.Scalar: ops.ne,
        aten.div.Tensor: ops.truediv,  # IEEE division: what fdiv spells, on every device (docs/kernels.md)
        aten.reciprocal.default: ops.reciprocal,
        aten.round.default: ops.round,  # half to even, as Inductor lowers it
        aten.bitwise_or.Tensor: ops.bitwise_or,
        aten.bitwise_or.Scalar: ops.bitwise_or,
        aten.bitwise_and.Tensor: ops.bitwise_and,
        aten.bitwise_and.Scalar: ops.bitwise_and,
        aten.bitwise_not.default: ops.bitwise_not,
        aten.__rshift__.Scalar: ops.bitwise_right_shift,
        aten.__lshift__.Scalar: ops.bitwise_left_shift,
        aten.where.self: ops.where,
    }


_SPECIAL = (aten.scalar_tensor.default, aten.view.dtype, prims.convert_element_type.default)


def _trace(fn: Callable, examples: list[tuple[torch.dtype, bool]]) -> torch.fx.GraphModule:
    """ATen graph of ``fn`` over fake 1-D tensors of the given (dtype, present) inputs (absent: None)."""
    from torch._inductor.pattern_matcher import fwd_only

    with _disable_current_modes(), FakeTensorMode():
        args = [torch.ones(2, dtype=dt) for dt, present in examples if present]
        slots = [present for _, present in examples]

        def call(*tensors: torch.Tensor) -> torch.Tensor:
            it = iter(tensors)
            return fn(*(next(it) if present else None for present in slots))

        return fwd_only(call, args)


@functools.lru_cache(maxsize=None)
def elements_graph(element: str, rounding: str, saturate: bool, finite: bool, with_u: bool) -> torch.fx.GraphModule:
    """The traced ``ELEMENTS[element].quantize_steps`` for one option set: placeholders v (and u)."""
    from fxquant.formats.element import ELEMENTS

    spec = ELEMENTS[element]
    return _trace(lambda v, u: spec.quantize_steps(v, rounding, saturate, u, finite=finite),
                  [(torch.float32, True), (torch.float32, with_u)])


@functools.lru_cache(maxsize=None)
def scale_graph(fmt: str, rounding: str, scale_mode: str | None, amax_dtype: torch.dtype,
                with_tensor_amax: bool) -> torch.fx.GraphModule:
    """The traced ``block_scales`` of a block format for one option set: placeholders amax (, tensor_amax);
    outputs the inverse scale and the scale."""
    from fxquant import formats

    f = formats.get(fmt)
    opts = f.resolve(rounding=rounding, scale_mode=scale_mode)
    return _trace(lambda amax, t: f.block_scales(amax, t, opts),
                  [(amax_dtype, True), (torch.float32, with_tensor_amax)])


@functools.lru_cache(maxsize=None)
def block_graph(fmt: str, rounding: str, x_dtype: torch.dtype, with_u: bool) -> torch.fx.GraphModule:
    """The traced ``scaled_values`` of a block format for one option set and input dtype: placeholders xb, inv,
    scale (, u)."""
    from fxquant import formats

    f = formats.get(fmt)
    opts = f.resolve(rounding=rounding)
    return _trace(lambda xb, inv, scale, u: f.scaled_values(xb, inv, scale, u, opts),
                  [(x_dtype, True), (torch.float32, True), (torch.float32, True), (torch.float32, with_u)])


def supported(gm: torch.fx.GraphModule) -> bool:
    """Whether every op of ``gm`` (and of the element graphs it calls) is in the table."""
    table = _ops_table()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target in table or n.target in _SPECIAL:
            continue
        if n.target is torch.ops.fxquant.round_elements.default and supported(_nested_graph(n)):
            continue
        return False
    return True


def _nested_graph(node: torch.fx.Node) -> torch.fx.GraphModule:
    v, u, element, rounding, saturate, finite = node.args
    return elements_graph(element, rounding, saturate, finite, u is not None)


def _run(gm: torch.fx.GraphModule, inputs: list, call: Callable[[torch.fx.Node, dict], object]) -> object:
    """Walk ``gm`` once: placeholders take ``inputs`` in order, every other node ``call(node, env)``; the output's
    value (a tuple for a graph of several outputs)."""
    env: dict = {}
    inputs_left = iter(inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(inputs_left)
        elif node.op == "output":
            return torch.fx.node.map_arg(node.args[0], env.__getitem__)
        else:
            env[node] = call(node, env)
    raise AssertionError("traced graph without an output")  # pragma: no cover


def _dtype_of(a: torch.fx.Node) -> torch.dtype:
    return a.meta["val"].dtype


def _interpret(gm: torch.fx.GraphModule, inputs: list) -> object:
    """Run ``gm`` on Inductor ``ops`` values ``inputs`` (one per placeholder), each node once."""
    return _run(gm, inputs, _interpret_node)


def _interpret_node(node: torch.fx.Node, env: dict) -> object:
    from torch._inductor.virtualized import ops

    if node.target is aten.scalar_tensor.default:
        return ops.constant(node.args[0], node.kwargs.get("dtype") or torch.float32)
    if node.target is aten.view.dtype:
        return ops.to_dtype_bitcast(env[node.args[0]], node.args[1], _dtype_of(node.args[0]))
    if node.target is prims.convert_element_type.default:
        return ops.to_dtype(env[node.args[0]], node.args[1])
    if node.target is torch.ops.fxquant.round_elements.default:
        v, u = node.args[:2]
        return _interpret(_nested_graph(node), [env[v]] + ([] if u is None else [env[u]]))
    if node.target in _ON_BOOL and _dtype_of(node.args[0]) is torch.bool:
        return getattr(ops, _ON_BOOL[node.target])(*_promoted(node, env))
    return _ops_table()[node.target](*_promoted(node, env))


_COMPARISONS = {aten.eq.Tensor, aten.eq.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
                aten.lt.Tensor, aten.lt.Scalar, aten.le.Scalar, aten.ne.Tensor, aten.ne.Scalar}
# On booleans Inductor lowers the bitwise ATen ops to its logical ops.
_ON_BOOL = {aten.bitwise_or.Tensor: "logical_or", aten.bitwise_or.Scalar: "logical_or",
            aten.bitwise_and.Tensor: "logical_and", aten.bitwise_and.Scalar: "logical_and",
            aten.bitwise_not.default: "logical_not"}


def _promoted(node: torch.fx.Node, env: dict) -> list:
    """The Inductor values of ``node``'s arguments in the dtype the ATen op computes in (ATen's type promotion:
    a comparison in its tensors' common dtype, everything else in its result's dtype; a select's condition as
    it is); Python scalars as constants of that dtype."""
    from torch._inductor.virtualized import ops

    tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if node.target in _COMPARISONS:
        want = functools.reduce(torch.promote_types, [_dtype_of(a) for a in tensors])
    else:
        want = node.meta["val"].dtype
    out = []
    for i, a in enumerate(node.args):
        if not isinstance(a, torch.fx.Node):
            out.append(ops.constant(a, want))
        elif (node.target is aten.where.self and i == 0) or _dtype_of(a) == want:
            out.append(env[a])
        else:
            out.append(ops.to_dtype(env[a], want))
    return out


def _lower_op_by_op(gm: torch.fx.GraphModule, inputs: list) -> object:
    """``gm`` through Inductor's own lowerings (any op Inductor knows; inputs broadcast)."""
    from torch._inductor.lowering import lowerings

    def call(node: torch.fx.Node, env: dict) -> object:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
        return lowerings[node.target](*args, **kwargs)

    return _run(gm, inputs, call)


def _lower_graph(gm: torch.fx.GraphModule, inputs: list) -> object:
    """One Pointwise over the first input's shape running ``gm`` (a tuple of them, one per output, for a graph of
    several outputs), or Inductor's op-by-op lowering of it."""
    from torch._inductor import ir

    first = inputs[0]
    if not supported(gm) or any(list(t.get_size()) != list(first.get_size()) for t in inputs):
        log.debug("fxquant: %s lowered op by op", gm)
        return _lower_op_by_op(gm, inputs)
    loaders = [t.make_loader() for t in inputs]

    def pointwise(pick: Callable[[object], object]) -> object:
        return ir.Pointwise.create(device=first.get_device(), dtype=torch.float32, ranges=list(first.get_size()),
                                   inner_fn=lambda index: pick(_interpret(gm, [load(index) for load in loaders])))

    outputs = gm.graph.output_node().args[0]
    if not isinstance(outputs, (tuple, list)):
        return pointwise(lambda out: out)
    return tuple(pointwise(lambda out, i=i: out[i]) for i in range(len(outputs)))


def _lower_round_elements(v, u, element: str, rounding: str, saturate: bool, finite: bool):
    gm = elements_graph(element, rounding, saturate, finite, u is not None)
    return _lower_graph(gm, [v] if u is None else [v, u])


def _lower_block_scales(amax, tensor_amax, fmt: str, rounding: str, scale_mode: str | None):
    gm = scale_graph(fmt, rounding, scale_mode, amax.get_dtype(), tensor_amax is not None)
    out = _lower_graph(gm, [t for t in (amax, tensor_amax) if t is not None])
    if tensor_amax is not None:
        # NVFP4: the tensor amax already puts the block amaxes and the per-element pass in separate loops over
        # x, so a buffer of scales costs no pass over x, and its per-block arithmetic (three divisions and an
        # E4M3 rounding) runs vectorised over blocks instead of as scalar code at the head of each block. MX
        # keeps its scale inline: there the block amax and the element pass share one loop over x.
        for t in out:
            t.realize()
    return out


def _lower_block_values(xb, inv, scale, u, fmt: str, rounding: str):
    gm = block_graph(fmt, rounding, xb.get_dtype(), u is not None)
    return _lower_graph(gm, [t for t in (xb, inv, scale, u) if t is not None])


@functools.lru_cache(maxsize=None)
def register() -> None:
    """Install the lowerings in Inductor (once per process)."""
    from torch._inductor.lowering import register_lowering

    import fxquant.formats  # noqa: F401  (defines the ops)

    register_lowering(torch.ops.fxquant.round_elements.default, type_promotion_kind=None)(_lower_round_elements)
    register_lowering(torch.ops.fxquant.block_scales.default, type_promotion_kind=None)(_lower_block_scales)
    register_lowering(torch.ops.fxquant.block_values.default, type_promotion_kind=None)(_lower_block_values)
