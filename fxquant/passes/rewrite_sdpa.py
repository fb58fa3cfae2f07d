"""Pass: rewrite ``F.scaled_dot_product_attention`` sites into ``wrappers.fxquant_sdpa``.

Pre: ``resolve`` has put a SiteMeta with op SDPA on the node. Post: a selected site is one
``fxquant_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, specs)`` node computing the
torch reference attention (explicit math, float32 softmax) with QK^T and PV and their backward GEMMs
quantized per the AttentionQuant; causal, masks, scale, dropout and GQA keep SDPA's meaning.
"""
from __future__ import annotations

import dataclasses

from torch import fx

from fxquant.passes.graph_edit import node_arguments, replace_with_call
from fxquant.passes.sites import META_KEY, OpKind, SiteMeta, Status
from fxquant.passes.wrappers import attention_specs, fxquant_sdpa

_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def matmul_quantize_calls(*mqs) -> tuple[int, int]:
    count = lambda *gs: sum((g.a is not None) + (g.b is not None) for g in gs)  # noqa: E731
    return sum(count(m.forward) for m in mqs), sum(count(m.grad_a, m.grad_b) for m in mqs)


def rewrite_sdpa(graph: fx.Graph, node: fx.Node) -> SiteMeta:
    meta: SiteMeta = node.meta[META_KEY]
    if meta.op is not OpKind.SDPA or meta.config is None:
        return meta
    try:
        a = node_arguments(node, _NAMES, _DEFAULTS)
    except ValueError as exc:
        failed = dataclasses.replace(meta, status=Status.FAILED, note=str(exc))
        node.meta[META_KEY] = failed
        return failed
    args = tuple(a[n] for n in _NAMES) + (attention_specs(meta.config),)
    new = replace_with_call(graph, node, fxquant_sdpa, args)
    calls = matmul_quantize_calls(meta.config.qk, meta.config.pv)
    done = dataclasses.replace(meta, status=Status.REWRITTEN, quantize_calls=calls)
    new.meta[META_KEY] = done
    return done
