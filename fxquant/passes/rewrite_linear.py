"""Pass: rewrite linear sites given as one op: ``F.linear`` (nn.Linear) into ``wrappers.fxquant_linear``, and
a Megatron linear's inlined ``torch.matmul(x, weight.t())`` (MODULE_MATMUL) into ``wrappers.fxquant_matmul``.

Pre: ``resolve`` has put a SiteMeta with op LINEAR / MODULE_MATMUL on the node. Post: a selected site is
one call of the wrapper (fprop, dgrad and wgrad quantized per the LinearQuant, bias in high precision;
for MODULE_MATMUL per ``LinearQuant.as_matmul()``, the same operands along the same axes); an unselected
site is left as it was.
"""
from __future__ import annotations

import dataclasses

from torch import fx

from fxquant.passes.graph_edit import node_arguments, replace_with_call
from fxquant.passes.sites import META_KEY, OpKind, SiteMeta, Status
from fxquant.passes.wrappers import fxquant_linear, fxquant_matmul, linear_specs, matmul_specs


def linear_quantize_calls(lq) -> tuple[int, int]:
    count = lambda *gs: sum((g.a is not None) + (g.b is not None) for g in gs)  # noqa: E731
    return count(lq.fprop), count(lq.dgrad, lq.wgrad)


def rewrite_linear(graph: fx.Graph, node: fx.Node) -> SiteMeta:
    meta: SiteMeta = node.meta[META_KEY]
    if meta.op not in (OpKind.LINEAR, OpKind.MODULE_MATMUL) or meta.config is None:
        return meta
    if meta.op is OpKind.LINEAR:
        args = node_arguments(node, ("input", "weight", "bias"), {"bias": None})
        specs = linear_specs(meta.config)
        new = replace_with_call(graph, node, fxquant_linear, (args["input"], args["weight"], args["bias"], specs))
    else:
        a, b = node.args[0], node.args[1]
        new = replace_with_call(graph, node, fxquant_matmul, (a, b, matmul_specs(meta.config.as_matmul())))
    done = dataclasses.replace(meta, status=Status.REWRITTEN, quantize_calls=linear_quantize_calls(meta.config))
    new.meta[META_KEY] = done
    return done
