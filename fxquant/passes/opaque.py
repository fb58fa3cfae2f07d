"""Graph nodes that run GEMMs fxquant cannot see into or does not rewrite, beyond the torch-level matmuls
``sites`` lists (docs/compile.md "Opaque calls that hide GEMMs").

    opaque_call(target)   (name, what it hides) for one node that runs several GEMMs inside: torch's fused
                          transformer fast paths, recurrent layers, ``F.multi_head_attention_forward`` (when
                          ``decompose_mha`` refused it), ATen's SDPA kernels called directly
    aten_matmul(target)   the name of an ATen matmul called directly (``torch.ops.aten.mm.default``, ...)
    custom_op(target)     ``namespace::name`` of a custom op (outside ATen, prims, fxquant and collectives); ``sites``
                          lists a call of one that takes a >= 2-D parameter of the model (``CUSTOM_OP_NOTE``),
                          e.g. transformers' ``grouped_mm_fallback`` running an MoE's experts

The first two are declared lists: an op missing from them is not detected. Convolutions are not GEMM sites
and are not listed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_RNN = "recurrent layer: input and hidden GEMMs of every step"
_SDPA = "attention kernel: QK^T and PV"
OPAQUE_GEMM_CALLS = {
    F.multi_head_attention_forward: ("multi_head_attention_forward", "nn.MultiheadAttention: in/out projections and "
                                     "attention"),
    torch._native_multi_head_attention: ("_native_multi_head_attention", "MultiheadAttention fast path: projections "
                                         "and attention"),
    torch._transformer_encoder_layer_fwd: ("_transformer_encoder_layer_fwd", "TransformerEncoderLayer fast path "
                                           "(eval, no grad): projections, attention and MLP"),
    torch.lstm: ("lstm", _RNN), torch.gru: ("gru", _RNN), torch.rnn_tanh: ("rnn_tanh", _RNN),
    torch.rnn_relu: ("rnn_relu", _RNN), torch.lstm_cell: ("lstm_cell", _RNN), torch.gru_cell: ("gru_cell", _RNN),
    torch.rnn_tanh_cell: ("rnn_tanh_cell", _RNN), torch.rnn_relu_cell: ("rnn_relu_cell", _RNN),
}
if hasattr(torch.ops.higher_order, "flex_attention"):  # F.flex_attention, as Dynamo traces it
    OPAQUE_GEMM_CALLS[torch.ops.higher_order.flex_attention] = ("flex_attention", _SDPA)
_ATEN_OPAQUE = {
    "_scaled_dot_product_flash_attention": _SDPA, "_scaled_dot_product_flash_attention_for_cpu": _SDPA,
    "_scaled_dot_product_efficient_attention": _SDPA, "_scaled_dot_product_cudnn_attention": _SDPA,
    "_scaled_dot_product_attention_math": _SDPA, "scaled_dot_product_attention": _SDPA,
    "_native_multi_head_attention": OPAQUE_GEMM_CALLS[torch._native_multi_head_attention][1],
    "_transformer_encoder_layer_fwd": OPAQUE_GEMM_CALLS[torch._transformer_encoder_layer_fwd][1],
    "lstm": _RNN, "gru": _RNN, "rnn_tanh": _RNN, "rnn_relu": _RNN,
}
_ATEN_MATMULS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "einsum", "dot",
                 "_addmm_activation", "_scaled_mm", "_int_mm", "_grouped_mm", "_scaled_grouped_mm"}
# namespaces whose ops are no hidden GEMMs: ATen's (listed above), fxquant's own, collectives (an FSDP
# all-gather of a weight shard)
_OWN_NAMESPACES = ("aten", "prims", "fxquant", "_c10d_functional", "c10d_functional", "c10d", "_dtensor")
CUSTOM_OP_NOTE = "custom op with a weight parameter: may hide GEMMs"


def _qualified_name(target: object) -> tuple[str, str] | None:
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if not isinstance(target, torch._ops.OpOverloadPacket):
        return None
    namespace, _, name = target._qualified_op_name.partition("::")
    return namespace, name


def _aten_name(target: object) -> str | None:
    qualified = _qualified_name(target)
    return qualified[1] if qualified is not None and qualified[0] == "aten" else None


def custom_op(target: object) -> str | None:
    """``"namespace::name"`` when ``target`` is an op registered outside ``_OWN_NAMESPACES``, else None."""
    qualified = _qualified_name(target)
    if qualified is None or qualified[0] in _OWN_NAMESPACES:
        return None
    return "::".join(qualified)


def opaque_call(target: object) -> tuple[str, str] | None:
    """(name, what GEMMs it hides) when ``target`` is an opaque GEMM-containing call, else None."""
    try:
        if target in OPAQUE_GEMM_CALLS:
            return OPAQUE_GEMM_CALLS[target]
    except TypeError:  # an unhashable target
        return None
    name = _aten_name(target)
    return (f"aten.{name}", _ATEN_OPAQUE[name]) if name in _ATEN_OPAQUE else None


def aten_matmul(target: object) -> str | None:
    """``"aten.mm"`` etc. when ``target`` is an ATen matmul-like op called directly, else None."""
    name = _aten_name(target)
    return f"aten.{name}" if name in _ATEN_MATMULS else None
