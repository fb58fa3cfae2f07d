"""Pass: rewrite ``F.linear`` sites (nn.Linear) into ``wrappers.fxquant_linear``.

Pre: ``resolve`` has put a SiteMeta with op LINEAR on the node. Post: a selected site is one
``fxquant_linear(x, weight, bias, specs)`` node (fprop, dgrad and wgrad quantized per the LinearQuant,
bias in high precision); an unselected site is left as it was.
"""
from __future__ import annotations

import dataclasses

from torch import fx

from fxquant.passes.graph_edit import node_arguments, replace_with_call
from fxquant.passes.sites import META_KEY, OpKind, SiteMeta, Status
from fxquant.passes.wrappers import fxquant_linear, linear_specs


def linear_quantize_calls(lq) -> tuple[int, int]:
    count = lambda *gs: sum((g.a is not None) + (g.b is not None) for g in gs)  # noqa: E731
    return count(lq.fprop), count(lq.dgrad, lq.wgrad)


def rewrite_linear(graph: fx.Graph, node: fx.Node) -> SiteMeta:
    meta: SiteMeta = node.meta[META_KEY]
    if meta.op is not OpKind.LINEAR or meta.config is None:
        return meta
    args = node_arguments(node, ("input", "weight", "bias"), {"bias": None})
    specs = linear_specs(meta.config)
    new = replace_with_call(graph, node, fxquant_linear, (args["input"], args["weight"], args["bias"], specs))
    done = dataclasses.replace(meta, status=Status.REWRITTEN, quantize_calls=linear_quantize_calls(meta.config))
    new.meta[META_KEY] = done
    return done
