"""Inductor lowering of ``fxquant::round_elements`` (the traced element rounding of every format): one pointwise
computation that evaluates each step of the reference arithmetic once per element.

Inductor lowers an ATen graph node by node, and the code of a node that is inlined into its consumers is
generated again for every use: an operand shared at several depths (the binade of ``ufp``, used three times, from
a clamp used twice, ...) is regenerated once per path through the graph, so the Python code generation of a
dozen element-rounding ops grows to hundreds of op calls per kernel variant. This lowering runs the same ATen
graph (``ElementSpec.quantize_steps``, traced once per option set) inside a single ``Pointwise`` inner function,
mapping each ATen op to Inductor's ``ops``: every intermediate is a variable computed once, the generated code
is the same arithmetic, and the result equals the reference bit for bit (tests/test_formats_lowering.py,
tests/test_formats_steps.py). An ATen op outside the table is lowered by Inductor's own lowerings instead.

``register()`` installs it (idempotent); ``fxquant.lowering`` calls it before Inductor compiles a graph.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch.utils._python_dispatch import _disable_current_modes

log = logging.getLogger(__name__)

aten = torch.ops.aten


def _ops_table() -> dict:
    """ATen op -> function of Inductor ``ops`` values (Python scalars already made constants)."""
    from torch._inductor.virtualized import ops

    return {
        aten.abs.default: ops.abs,
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
        aten.bitwise_or.Tensor: ops.bitwise_or,  # of booleans
        aten.where.self: ops.where,
    }


@functools.lru_cache(maxsize=None)
def traced(element: str, rounding: str, saturate: bool, finite: bool, with_u: bool) -> torch.fx.GraphModule:
    """The ATen graph of ``ELEMENTS[element].quantize_steps`` for one option set: placeholders v (and u)."""
    from torch._inductor.pattern_matcher import fwd_only

    from fxquant.formats.element import ELEMENTS

    spec = ELEMENTS[element]

    def fn(*args: torch.Tensor) -> torch.Tensor:
        return spec.quantize_steps(args[0], rounding, saturate, args[1] if with_u else None, finite=finite)

    with _disable_current_modes():  # real example tensors, whatever mode the lowering runs under
        examples = [torch.ones(2)] + ([torch.full((2,), 0.5)] if with_u else [])
        return fwd_only(fn, examples)


def supported(gm: torch.fx.GraphModule) -> bool:
    table = _ops_table()
    return all(n.op != "call_function" or n.target in table or n.target is aten.scalar_tensor.default
               for n in gm.graph.nodes)


def _lower(v, u, element: str, rounding: str, saturate: bool, finite: bool):
    from torch._inductor import ir
    from torch._inductor.lowering import lowerings
    from torch._inductor.virtualized import ops

    gm = traced(element, rounding, saturate, finite, u is not None)
    inputs = [v] if u is None else [v, u]
    same_size = all(list(t.get_size()) == list(v.get_size()) for t in inputs)
    if not same_size or not supported(gm):
        log.debug("fxquant: round_elements(%s, %s) lowered op by op", element, rounding)
        return _lower_op_by_op(gm, inputs, lowerings)
    table = _ops_table()
    loaders = [t.make_loader() for t in inputs]
    nodes = list(gm.graph.nodes)

    def inner_fn(index):
        env: dict = {}
        inputs_left = iter(loaders)

        def value(a):
            if isinstance(a, torch.fx.Node):
                return env[a]
            return ops.constant(a, torch.float32)  # the arithmetic's scalars are float32 constants

        for node in nodes:
            if node.op == "placeholder":
                env[node] = next(inputs_left)(index)
            elif node.op == "call_function":
                if node.target is aten.scalar_tensor.default:
                    env[node] = ops.constant(node.args[0], node.kwargs.get("dtype") or torch.float32)
                else:
                    env[node] = table[node.target](*(value(a) for a in node.args))
            elif node.op == "output":
                (out,) = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
                return env[out]
        raise AssertionError("traced element graph without an output")  # pragma: no cover

    return ir.Pointwise.create(device=v.get_device(), dtype=torch.float32, inner_fn=inner_fn,
                               ranges=list(v.get_size()))


def _lower_op_by_op(gm: torch.fx.GraphModule, inputs: list, lowerings: dict):
    """The traced graph through Inductor's own lowerings (any op Inductor knows; inputs broadcast)."""
    env: dict = {}
    inputs_left = iter(inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(inputs_left)
        elif node.op == "call_function":
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
            env[node] = lowerings[node.target](*args, **kwargs)
        elif node.op == "output":
            (out,) = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
            return env[out]
    raise AssertionError("traced element graph without an output")  # pragma: no cover


@functools.lru_cache(maxsize=None)
def register() -> None:
    """Install the lowering of ``fxquant::round_elements`` in Inductor (once per process)."""
    from torch._inductor.lowering import register_lowering

    import fxquant.formats.element  # noqa: F401  (defines the op)

    register_lowering(torch.ops.fxquant.round_elements.default, type_promotion_kind=None)(_lower)
