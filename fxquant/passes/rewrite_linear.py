"""Pass: rewrite linear sites given as one op: ``F.linear`` (nn.Linear) into ``wrappers.fxquant_linear``, a
Megatron linear's inlined ``torch.matmul(x, weight.t())`` (MODULE_MATMUL) into ``wrappers.fxquant_matmul``, and
an HF Conv1D's ``torch.addmm(bias, x, weight)`` (MODULE_MATMUL, weight [in, out]) into ``torch.t(weight)`` and
``wrappers.fxquant_linear`` on it.

Pre: ``resolve`` has put a SiteMeta with op LINEAR / MODULE_MATMUL on the node. Post: a selected site is
one call of the wrapper (fprop, dgrad and wgrad quantized per the LinearQuant, bias in high precision;
for the Megatron matmul per ``LinearQuant.as_matmul()``, the same operands along the same axes; for Conv1D
the linear with weight ``weight.t()``, a node of its own, so that capture taps see the [out, in] weight and its
gradient as at any linear site); an unselected site is left as it was.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import fx

from fxquant.passes.graph_edit import copy_meta, node_arguments, replace_with_call
from fxquant.passes.sites import META_KEY, OpKind, SiteMeta, Status, example_value
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
    elif node.target is torch.addmm:  # HF Conv1D (sites.is_conv1d_addmm): addmm(bias, x, weight [in, out])
        bias, x, weight = node.args
        new = replace_with_call(graph, node, fxquant_linear,
                                (x, transposed_weight(graph, node), bias, linear_specs(meta.config)))
    else:
        a, b = node.args[0], node.args[1]
        new = replace_with_call(graph, node, fxquant_matmul, (a, b, matmul_specs(meta.config.as_matmul())))
    done = dataclasses.replace(meta, status=Status.REWRITTEN, quantize_calls=linear_quantize_calls(meta.config))
    new.meta[META_KEY] = done
    return done


def transposed_weight(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """A ``torch.t(weight)`` node before an HF Conv1D's ``addmm(bias, x, weight)``: its weight as the linear's
    [out, in]."""
    weight = node.args[2]
    with graph.inserting_before(node):
        weight_t = graph.call_function(torch.t, (weight,))
    w = example_value(weight)
    copy_meta(node, weight_t, w.t() if isinstance(w, torch.Tensor) else None)
    return weight_t


def conv1d_as_linear(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """An HF Conv1D site kept in high precision, ``addmm(bias, x, weight)``, as ``F.linear(x, torch.t(weight),
    bias)``: the same product (``F.linear`` calls ``addmm(bias, x, weight.t().t())``), with the linear's operands
    for capture taps. The site's metadata moves to the new node."""
    bias, x, _ = node.args
    meta = node.meta[META_KEY]
    new = replace_with_call(graph, node, torch._C._nn.linear, (x, transposed_weight(graph, node), bias))
    new.meta[META_KEY] = meta
    return new
