"""Small graph-editing helpers shared by the rewrite passes.

Rules they keep (ARCHITECTURE.md, STYLE.md): every inserted node gets the replaced node's metadata
(``stack_trace``, ``nn_module_stack``, ``source_fn_stack``) so errors point back at user code; only nodes
we created or replaced are erased (never ``graph.eliminate_dead_code()``, trap 2); shapes are read as
they are, SymInts included (trap 9).
"""
from __future__ import annotations

import torch
from torch import fx

from fxquant.passes.sites import example_value

_COPIED_META = ("stack_trace", "nn_module_stack", "source_fn_stack")


def copy_meta(src: fx.Node, dst: fx.Node, example: object = None) -> None:
    for key in _COPIED_META:
        if key in src.meta:
            dst.meta[key] = src.meta[key]
    if example is not None:
        dst.meta["example_value"] = example


def node_arguments(node: fx.Node, names: tuple[str, ...], defaults: dict[str, object]) -> dict[str, object]:
    """``node``'s arguments by parameter name (positional first, then keywords, then ``defaults``);
    for ``call_method`` nodes ``names[0]`` is the receiver. Raises ValueError on an unknown keyword."""
    out: dict[str, object] = dict(defaults)
    for name, value in zip(names, node.args):
        out[name] = value
    for key, value in node.kwargs.items():
        if key not in names:
            raise ValueError(f"unexpected keyword {key!r} in {node.format_node()}")
        out[key] = value
    missing = [n for n in names if n not in out]
    if missing:
        raise ValueError(f"{node.name}: missing arguments {missing}")
    return out


def replace_with_call(graph: fx.Graph, old: fx.Node, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` before ``old``, move ``old``'s users and metadata to it, erase ``old``."""
    with graph.inserting_before(old):
        new = graph.call_function(target, args, kwargs or {})
    copy_meta(old, new, example_value(old))
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    return new


def insert_quantize(graph: fx.Graph, before: fx.Node, operand: fx.Node, spec: str, dim: int) -> fx.Node:
    """Insert ``fxquant::quantize(operand, spec, dim, None)`` before ``before``; return the new node."""
    with graph.inserting_before(before):
        q = graph.call_function(torch.ops.fxquant.quantize.default, (operand, spec, dim, None))
    copy_meta(before, q, _fake_quantize(operand, spec, dim))
    return q


def _fake_quantize(operand: fx.Node, spec: str, dim: int) -> object:
    ev = example_value(operand)
    if not isinstance(ev, torch.Tensor):
        return None
    mode = getattr(ev, "fake_mode", None)  # the body's own fake mode, not the tracing context's
    if mode is None:
        return None
    with mode:
        return torch.ops.fxquant.quantize.default(ev, spec, dim, None)
