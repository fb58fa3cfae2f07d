"""Pass: rewrite ``F.scaled_dot_product_attention`` sites into the flash kernel or the explicit-math reference.

Pre: ``resolve`` has put a SiteMeta with op SDPA on the node. Post: a selected site is one call of

    wrappers.fxquant_flash_sdpa(q, k, v, is_causal, scale, enable_gqa, specs)
        the custom op ``fxquant::flash_attention`` (qfunctions.flash_sdpa): Triton kernels on CUDA, the torch
        flash reference elsewhere; P is the unnormalised probability tile (docs/flash_attention.md)
    wrappers.fxquant_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, specs)
        ``quantized_sdpa``: explicit math, float32 softmax, P the normalised softmax; masks, dropout, any
        format (stochastic rounding, NVFP4, per-tensor scaling)

with QK^T and PV and their backward GEMMs quantized per the AttentionQuant. Which one: ``AttentionImpl``,
from the environment variable ``FXQUANT_ATTENTION`` read when a graph is compiled (docs/compile.md):

    auto  (default) flash where the kernel runs natively (CUDA inputs, Triton importable) and the site is
          supported; math otherwise, on CPU always (the CPU path keeps quantized_sdpa's semantics)
    flash flash wherever the site is supported, on CPU too (the flash reference: the GPU's semantics)
    math  quantized_sdpa everywhere

A site the flash op does not support (``flash_sdpa.unsupported_reason``: a mask, dropout, a format the
kernel cannot compute per tile, head dim > 128, ...) falls back to math with the reason logged and kept
in ``SiteMeta.note``; a flash site's note says "flash". Flash sites make no ``fxquant::quantize`` calls
(the kernel quantizes inside), so their ``quantize_calls`` are (0, 0).

``rewrite_attention_weights``: an ATTENTION_WEIGHTS site (``wrappers.mha_attention_weights``, an
nn.MultiheadAttention with need_weights=True, see ``decompose_mha``) becomes
``wrappers.fxquant_attention_weights(q, k, v, attn_mask, dropout_p, specs)``: ``quantized_attention``, the
same math as ``quantized_sdpa`` returning (O, P), so the weights the module returns are the quantized P.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import os

import torch
from torch import fx

from fxquant.formats.options import parse_enum
from fxquant.passes.graph_edit import node_arguments, replace_with_call
from fxquant.passes.sites import META_KEY, OpKind, SiteMeta, Status, example_value
from fxquant.passes.wrappers import attention_specs, fxquant_attention_weights, fxquant_flash_sdpa, fxquant_sdpa
from fxquant.qfunctions.flash_sdpa import unsupported_reason

log = logging.getLogger(__name__)

ENV = "FXQUANT_ATTENTION"
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
FLASH_NOTE = "flash"


class AttentionImpl(str, enum.Enum):
    AUTO = "auto"
    FLASH = "flash"
    MATH = "math"


def attention_impl(choice: "AttentionImpl | str | None" = None) -> AttentionImpl:
    """``choice`` (``fxquant.compile(attention=...)``) when given, else what ``FXQUANT_ATTENTION`` asks for
    (unset: auto); a bad value raises ValueError with a did-you-mean."""
    if choice is not None:
        return parse_enum(AttentionImpl, choice, "attention")
    return parse_enum(AttentionImpl, os.environ.get(ENV, AttentionImpl.AUTO.value), ENV)


def matmul_quantize_calls(*mqs) -> tuple[int, int]:
    count = lambda *gs: sum((g.a is not None) + (g.b is not None) for g in gs)  # noqa: E731
    return sum(count(m.forward) for m in mqs), sum(count(m.grad_a, m.grad_b) for m in mqs)


AUTO_OFF_CUDA = "attention=auto runs the flash kernel on CUDA only"


def _native_flash(device: object) -> bool:
    from fxquant import kernels

    return isinstance(device, torch.device) and device.type == "cuda" and kernels.available()


def flash_blocker(a: dict[str, object], meta: SiteMeta, impl: AttentionImpl) -> str | None:
    """Why this site runs ``quantized_sdpa`` rather than the flash op under ``impl`` (None: it runs flash)."""
    if impl is AttentionImpl.MATH:
        return "attention=math"
    q = example_value(a["query"])
    if impl is AttentionImpl.AUTO and not _native_flash(getattr(q, "device", None)):
        return f"{AUTO_OFF_CUDA} (inputs on {getattr(q, 'device', '?')})"
    if not isinstance(a["is_causal"], bool):
        return f"is_causal is not a constant bool ({a['is_causal']!r})"
    if a["scale"] is not None and (not isinstance(a["scale"], (int, float)) or isinstance(a["scale"], bool)):
        return f"scale is not a constant number ({a['scale']!r})"
    k, v = example_value(a["key"]), example_value(a["value"])
    return unsupported_reason(q, k, v, a["attn_mask"], a["dropout_p"], a["enable_gqa"], meta.config)


def rewrite_sdpa(graph: fx.Graph, node: fx.Node, attention: AttentionImpl | str | None = None) -> SiteMeta:
    meta: SiteMeta = node.meta[META_KEY]
    if meta.op is not OpKind.SDPA or meta.config is None:
        return meta
    try:
        a = node_arguments(node, _NAMES, _DEFAULTS)
    except ValueError as exc:
        failed = dataclasses.replace(meta, status=Status.FAILED, note=str(exc))
        node.meta[META_KEY] = failed
        return failed
    impl = attention_impl(attention)
    specs = attention_specs(meta.config)
    blocker = flash_blocker(a, meta, impl)
    if blocker is None:
        args = (a["query"], a["key"], a["value"], a["is_causal"], a["scale"], a["enable_gqa"], specs)
        new = replace_with_call(graph, node, fxquant_flash_sdpa, args)
        done = dataclasses.replace(meta, status=Status.REWRITTEN, quantize_calls=(0, 0), note=FLASH_NOTE)
    else:
        # The choice itself (math, or auto off CUDA) is expected: DEBUG. A site flash cannot run although
        # flash was possible (an attn_mask, dropout, ...): WARNING.
        expected = impl is AttentionImpl.MATH or blocker.startswith(AUTO_OFF_CUDA)
        level = logging.DEBUG if expected else logging.WARNING
        log.log(level, "fxquant: %s runs quantized_sdpa, not the flash kernel: %s", meta.site.module_path, blocker)
        args = tuple(a[n] for n in _NAMES) + (specs,)
        new = replace_with_call(graph, node, fxquant_sdpa, args)
        calls = matmul_quantize_calls(meta.config.qk, meta.config.pv)
        done = dataclasses.replace(meta, status=Status.REWRITTEN, quantize_calls=calls, note=f"math: {blocker}")
    new.meta[META_KEY] = done
    return done


def rewrite_attention_weights(graph: fx.Graph, node: fx.Node) -> SiteMeta:
    meta: SiteMeta = node.meta[META_KEY]
    if meta.op is not OpKind.ATTENTION_WEIGHTS or meta.config is None:
        return meta
    q, k, v, mask, dropout_p = node.args
    args = (q, k, v, mask, dropout_p, attention_specs(meta.config))
    new = replace_with_call(graph, node, fxquant_attention_weights, args)
    calls = matmul_quantize_calls(meta.config.qk, meta.config.pv)
    done = dataclasses.replace(meta, status=Status.REWRITTEN, quantize_calls=calls, note="math")
    new.meta[META_KEY] = done
    return done
