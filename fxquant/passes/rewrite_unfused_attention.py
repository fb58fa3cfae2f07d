"""Pass: rewrite Megatron's unfused core attention (``DotProductAttention``) GEMMs.

In the Dynamo graph it is ``baddbmm(buffer, q, k^T, beta=0, alpha=scale) -> view -> masked_fill_ ->
softmax -> dropout -> bmm(P, v)``. Pre: ``resolve`` has put SiteMetas with op UNFUSED_QK (the baddbmm) and
UNFUSED_PV (the bmm) on those nodes. Post: a selected baddbmm is ``fxquant_baddbmm`` with the scheme's qk
MatmulQuant, a selected bmm ``fxquant_bmm`` with its pv MatmulQuant; the mask, softmax and dropout
between them are left untouched (the in-place ``masked_fill_`` has no users: nothing here deletes it).
"""
from __future__ import annotations

import dataclasses

from torch import fx

from fxquant.passes.graph_edit import node_arguments, replace_with_call
from fxquant.passes.rewrite_sdpa import matmul_quantize_calls
from fxquant.passes.sites import META_KEY, OpKind, SiteMeta, Status
from fxquant.passes.wrappers import fxquant_baddbmm, fxquant_bmm, matmul_specs


def rewrite_unfused_attention(graph: fx.Graph, node: fx.Node) -> SiteMeta:
    meta: SiteMeta = node.meta[META_KEY]
    if meta.op not in (OpKind.UNFUSED_QK, OpKind.UNFUSED_PV) or meta.config is None:
        return meta
    mq = meta.config.qk if meta.op is OpKind.UNFUSED_QK else meta.config.pv
    if not mq.quantized:
        return dataclasses.replace(meta, status=Status.HIGH_PRECISION)
    try:
        if meta.op is OpKind.UNFUSED_QK:
            a = node_arguments(node, ("input", "batch1", "batch2", "beta", "alpha"), {"beta": 1.0, "alpha": 1.0})
            args = (a["input"], a["batch1"], a["batch2"], a["beta"], a["alpha"], matmul_specs(mq))
            target = fxquant_baddbmm
        else:
            a = node_arguments(node, ("input", "mat2"), {})
            args, target = (a["input"], a["mat2"], matmul_specs(mq)), fxquant_bmm
    except ValueError as exc:
        failed = dataclasses.replace(meta, status=Status.FAILED, note=str(exc))
        node.meta[META_KEY] = failed
        return failed
    new = replace_with_call(graph, node, target, args)
    done = dataclasses.replace(meta, status=Status.REWRITTEN, quantize_calls=matmul_quantize_calls(mq))
    new.meta[META_KEY] = done
    return done
