"""After AOT autograd, for aot_eager only: ``with_effects(token, fxquant::capture, ...)`` -> a direct call.

The capture op is effectful (ORDERED) so that AOT autograd and Inductor keep it (ARCHITECTURE.md trap 3).
AOT autograd threads an effect token through it: ``with_effects(token, op, *args)`` returning a new token.
Inductor compiles that wrapper away; aot_eager runs it as a Python higher-order op, 55-170 us per call on
the 2-core CI box, against ~5 us for the op itself: most of a configured-but-inactive capture's cost in
aot_eager graphs (docs/capture.md). The final forward/backward graphs are not transformed any further, so
the wrapper has done its job there: this rewrite calls the op directly, at the same place in node order
(FX runs nodes in order, so the effects keep their order), and hands the incoming token on unchanged
wherever the wrapper's token was used.
"""
from __future__ import annotations

import operator

import torch
from torch import fx


def direct_capture_calls(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place; returns how many calls were rewritten."""
    wrapper = torch.ops.higher_order.with_effects
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not wrapper:
            continue
        capture = node.args[1]
        if not isinstance(capture, torch._ops.OpOverload) or capture.name() != "fxquant::capture":
            continue
        users = list(node.users)
        if not all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0 for u in users):
            continue  # something other than the token is read: leave this call as it is
        token = node.args[0]
        with gm.graph.inserting_before(node):
            gm.graph.call_function(capture, tuple(node.args[2:]), dict(node.kwargs))
        for u in users:
            u.replace_all_uses_with(token)
            gm.graph.erase_node(u)
        gm.graph.erase_node(node)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


__all__ = ["direct_capture_calls"]
