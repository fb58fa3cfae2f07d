"""Pass: decompose ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, hence
``nn.TransformerEncoderLayer`` / ``nn.Transformer`` and many encoders) into the ops the site matcher knows.

Dynamo hands the backend the whole of ``nn.MultiheadAttention`` as one call of
``F.multi_head_attention_forward`` (time-first [L, B, E]; with ``batch_first`` the module's transposes
sit around the call). This pass runs before ``sites.find_sites`` and replaces that node by the same
computation spelled with the ops fxquant rewrites, each stamped with a module path of its own so that
scheme rules and ``fxquant explain`` see them as sites (``<mha>`` is the MultiheadAttention's path; the
in-projections have kind qkv and out_proj kind proj, set in ``node.meta[sites.KIND_KEY]``, not guessed
from the names):

    in-projection, packed weight [3E, E] (torch's ``_in_projection_packed``):
        query is key is value:   F.linear(x, W)        -> q, k, v          site <mha>.in_proj
        key is value:            F.linear(query, W_q)                      site <mha>.in_proj_q
                                 F.linear(key, W_kv)   -> k, v             site <mha>.in_proj_kv
        otherwise:               three F.linear with W_q, W_k, W_v         sites <mha>.in_proj_q/_k/_v
    in-projection, separate weights (kdim / vdim != embed_dim):
                                 q_proj_weight, k_proj_weight, v_proj_weight  sites <mha>.q_proj/k_proj/v_proj
    attention  need_weights=False: F.scaled_dot_product_attention over [B, H, L, d]   site <mha> (SDPA)
               need_weights=True:  wrappers.mha_attention_weights -> (O, P)          site <mha> (ATTENTION_WEIGHTS)
                                   torch's own math; quantized it becomes wrappers.fxquant_attention_weights
                                   and the returned weights are the quantized path's P (averaged over heads
                                   when ``average_attn_weights``)
    out-projection:              F.linear(o, out_proj.weight, out_proj.bias)  site <mha>.out_proj

Masks as torch canonicalises them: a bool ``attn_mask`` / ``key_padding_mask`` (True = masked) becomes an
additive float mask (-inf), a 2-D attn_mask is broadcast over batch and heads, a 3-D one is
[B*H, L, S]; key_padding_mask [B, S] is added per batch; ``is_causal`` (with its attn_mask) runs SDPA's
causal mode when no key_padding_mask is given and weights are not needed. Dropout applies only when
``training``, with ``dropout_p`` as the call has it: a constant, or a node (Dynamo's symbolic float under
``dynamic=True``) passed on to the attention op as it is. Unbatched inputs ([L, E]) are handled as torch does
(a batch of one, squeezed; q, k and v then count as distinct).

Refused (the node is left as it is and reported as an opaque GEMM call, which ``strict`` rejects, see
``passes.opaque``): ``add_bias_kv`` (bias_k / bias_v), ``add_zero_attn``, ``static_k`` /
``static_v``, non-constant flags other than ``dropout_p``, a result used other than by indexing. The reason is
kept in ``node.meta[REFUSED_KEY]``. Every inserted node carries the MHA node's ``stack_trace`` and
``source_fn_stack`` and an ``example_value`` computed under the graph's fake mode; the pass never runs
``eliminate_dead_code`` (trap 2): only the MHA node and its getitem users are erased.
"""
from __future__ import annotations

import inspect
import logging
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._dispatch.python import enable_python_dispatcher

from fxquant.passes.graph_edit import copy_meta, node_arguments
from fxquant.passes.module_paths import ModuleNames
from fxquant.passes.sites import KIND_KEY, REFUSED_KEY, example_value
from fxquant.passes.wrappers import mha_attention_weights
from fxquant.schemes.model import SiteKind

# The linear sites of an nn.MultiheadAttention at ``<mha>``: ``<mha>.<suffix>`` and its kind. Which of them a call
# shows depends on the call (query is key is value, key is value, separate projection weights); the strict
# checks list them all as sites a later graph may show (``strict.possible_sites``).
MHA_LINEAR_SITES: dict[str, SiteKind] = {
    **dict.fromkeys(("in_proj", "in_proj_q", "in_proj_kv", "in_proj_k", "in_proj_v", "q_proj", "k_proj", "v_proj"),
                    SiteKind.QKV),
    "out_proj": SiteKind.PROJ,
}

log = logging.getLogger(__name__)

MHA_FUNCTION = F.multi_head_attention_forward
_PARAMS = inspect.signature(MHA_FUNCTION).parameters
_NAMES = tuple(_PARAMS)
_DEFAULTS = {n: p.default for n, p in _PARAMS.items() if p.default is not inspect.Parameter.empty}
_FLAGS = ("embed_dim_to_check", "num_heads", "add_zero_attn", "training", "need_weights", "is_causal",
          "use_separate_proj_weight", "average_attn_weights")  # dropout_p may be a node: passed through


class Refused(ValueError):
    """This MHA call cannot be decomposed; the message says why."""


@dataclass(frozen=True)
class _Call:
    """The MHA node's arguments (fx.Nodes or constants) and what is static about them."""

    args: dict
    batched: bool
    mask_dim: int | None  # attn_mask's dim (2 or 3), None without one

    def __getitem__(self, name: str) -> object:
        return self.args[name]


def _read_call(node: fx.Node) -> _Call:
    try:
        args = node_arguments(node, _NAMES, _DEFAULTS)
    except ValueError as exc:
        raise Refused(str(exc)) from exc
    for name in _FLAGS:
        if isinstance(args[name], fx.Node):
            raise Refused(f"{name} is not a constant ({args[name].name})")
    unsupported = [n for n in ("bias_k", "bias_v", "static_k", "static_v") if args[n] is not None]
    if unsupported:
        raise Refused(f"{'/'.join(unsupported)} not supported (nn.MultiheadAttention(add_bias_kv=True) or static "
                      f"keys/values)")
    if args["add_zero_attn"]:
        raise Refused("add_zero_attn=True not supported")
    if args["is_causal"] and args["attn_mask"] is None:
        raise Refused("is_causal=True without attn_mask (torch raises on it)")
    query = example_value(args["query"])
    if not isinstance(query, torch.Tensor) or query.dim() not in (2, 3):
        raise Refused(f"query example value {type(query).__name__} is not a 2-D or 3-D tensor")
    embed, heads = args["embed_dim_to_check"], args["num_heads"]
    if embed % heads:
        raise Refused(f"embed_dim {embed} is not divisible by num_heads {heads}")
    mask = example_value(args["attn_mask"]) if args["attn_mask"] is not None else None
    for name in ("attn_mask", "key_padding_mask"):
        m = example_value(args[name]) if args[name] is not None else None
        if m is not None and m.dtype != torch.bool and not m.dtype.is_floating_point:
            raise Refused(f"{name} of dtype {m.dtype}: only bool and floating masks are supported")
    return _Call(args, query.dim() == 3, None if mask is None else mask.dim())


class _Emitter:
    """Appends torch ops to the graph before the MHA node through fx Proxies; linears get a site path."""

    def __init__(self, graph: fx.Graph) -> None:
        self.tracer = fx.proxy.GraphAppendingTracer(graph)
        self.paths: dict[fx.Node, str] = {}  # linear node -> suffix of its site path

    def proxy(self, value: object) -> object:
        return fx.Proxy(value, self.tracer) if isinstance(value, fx.Node) else value

    def linear(self, x, weight, bias, suffix: str):
        y = F.linear(x, weight, bias)
        self.paths[y.node] = suffix
        return y

    def call(self, target, *args):
        return self.tracer.create_proxy("call_function", target, args, {})


def _parts(proxy, n: int) -> list:
    """The ``n`` items of a tuple-valued proxy (``chunk``, ``split``), each a getitem node."""
    return [proxy[i] for i in range(n)]


def _canonical_mask(mask, dtype: torch.dtype, is_bool: bool):
    """torch's ``_canonical_mask``: a bool mask (True = masked) as an additive float mask."""
    if not is_bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill(mask, float("-inf"))


def _in_projection(e: _Emitter, call: _Call, a: dict, inputs: tuple, same: tuple[bool, bool]) -> list:
    """q, k, v [L, B, E] as torch's ``_in_projection_packed`` / ``_in_projection`` compute them."""
    E = call["embed_dim_to_check"]
    query, key, value = inputs
    self_attn, key_is_value = same
    w, b = a["in_proj_weight"], a["in_proj_bias"]
    if not call["use_separate_proj_weight"] and self_attn:
        return _parts(e.linear(query, w, b, "in_proj").chunk(3, -1), 3)
    if not call["use_separate_proj_weight"] and key_is_value:
        w_q, w_kv = _parts(w.split([E, 2 * E]), 2)
        b_q, b_kv = (None, None) if b is None else _parts(b.split([E, 2 * E]), 2)
        q = e.linear(query, w_q, b_q, "in_proj_q")
        return [q, *_parts(e.linear(key, w_kv, b_kv, "in_proj_kv").chunk(2, -1), 2)]
    b_q, b_k, b_v = (None,) * 3 if b is None else _parts(b.chunk(3), 3)
    if call["use_separate_proj_weight"]:
        return [e.linear(query, a["q_proj_weight"], b_q, "q_proj"), e.linear(key, a["k_proj_weight"], b_k, "k_proj"),
                e.linear(value, a["v_proj_weight"], b_v, "v_proj")]
    w_q, w_k, w_v = _parts(w.chunk(3), 3)
    return [e.linear(query, w_q, b_q, "in_proj_q"), e.linear(key, w_k, b_k, "in_proj_k"),
            e.linear(value, w_v, b_v, "in_proj_v")]


def _masks(call: _Call, a: dict) -> tuple[object, bool, bool]:
    """(additive mask [1 | B*H, L | 1, S] or None, is_causal, whether the mask is one [1, L, S] for all)."""
    H, dtype = call["num_heads"], example_value(call["query"]).dtype
    kpm, mask, is_causal = a["key_padding_mask"], a["attn_mask"], call["is_causal"]
    if kpm is not None:
        kpm_bool = example_value(call["key_padding_mask"]).dtype == torch.bool
        kpm = _canonical_mask(kpm if call.batched else kpm.unsqueeze(0), dtype, kpm_bool)
    if is_causal and kpm is None and not call["need_weights"]:
        return None, True, False
    if mask is not None:
        mask = _canonical_mask(mask, dtype, example_value(call["attn_mask"]).dtype == torch.bool)
        mask = mask.unsqueeze(0) if call.mask_dim == 2 else mask  # [1 | B*H, L, S]
    if kpm is None:
        return mask, False, mask is not None and call.mask_dim == 2
    kpm = kpm.unsqueeze(1).unsqueeze(1).expand(-1, H, -1, -1).flatten(0, 1)  # [B*H, 1, S]
    return (kpm if mask is None else mask + kpm), False, False


def _emit(e: _Emitter, call: _Call, same: tuple[bool, bool]) -> tuple[object, object]:
    """The decomposed MHA (module docstring) on proxies; returns (output, weights or None)."""
    a = {k: e.proxy(v) for k, v in call.args.items()}
    E, H = call["embed_dim_to_check"], call["num_heads"]
    d = E // H
    inputs = (a["query"], a["key"], a["value"])
    if not call.batched:  # three new tensors: torch's identity tests then see distinct q, k, v
        inputs, same = tuple(t.unsqueeze(1) for t in inputs), (False, False)
    q, k, v = _in_projection(e, call, a, inputs, same)
    mask, is_causal, broadcast_mask = _masks(call, a)
    dropout_p = a["dropout_p"] if call["training"] else 0.0  # a proxy where it is a node
    if call["need_weights"]:
        heads_first = [t.unflatten(-1, (H, d)).flatten(1, 2).transpose(0, 1) for t in (q, k, v)]  # [B*H, L, d]
        both = e.call(mha_attention_weights, *heads_first, mask, dropout_p)
        o = both[0].transpose(0, 1).unflatten(1, (-1, H)).flatten(2)  # [L, B, E]
        weights = both[1].unflatten(0, (-1, H))  # [B, H, L, S]
        if call["average_attn_weights"]:
            weights = weights.mean(dim=1)
    else:
        q, k, v = [t.unflatten(-1, (H, d)).permute(1, 2, 0, 3) for t in (q, k, v)]  # [B, H, L, d]
        if mask is not None:
            mask = mask.unsqueeze(0) if broadcast_mask else mask.unflatten(0, (-1, H))
        o = F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal)
        o = o.permute(2, 0, 1, 3).flatten(2)  # [L, B, E]
        weights = None
    out = e.linear(o, a["out_proj_weight"], a["out_proj_bias"], "out_proj")
    if not call.batched:
        out = out.squeeze(1)
        weights = None if weights is None else weights.squeeze(0)
    return out, weights


def _stamp(node: fx.Node, mha: fx.Node, names: ModuleNames, suffix: str | None) -> None:
    """The MHA node's metadata on ``node``; a linear's module stack gains an entry naming its site path."""
    copy_meta(mha, node)
    if suffix is None:
        return
    stack = dict(mha.meta.get("nn_module_stack") or {})
    parent = names.node_path(mha) or ""
    path = f"{parent}.{suffix}" if parent else suffix
    stack[f"fxquant.mha:{path}"] = (path, nn.Linear)  # an unknown key: ModuleNames reads the spelled path
    node.meta["nn_module_stack"] = stack
    node.meta[KIND_KEY] = MHA_LINEAR_SITES[suffix]  # not guessed from the name


def _fake_run(node: fx.Node, mode: object) -> None:
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), example_value)
    with mode, enable_python_dispatcher():  # symbolic shapes need the Python dispatcher (as Dynamo runs them)
        if node.op == "call_method":
            value = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            value = node.target(*args, **kwargs)
    node.meta["example_value"] = value


def _decompose(graph: fx.Graph, node: fx.Node, names: ModuleNames) -> None:
    call = _read_call(node)
    users = list(node.users)
    for u in users:
        if u.op != "call_function" or u.target is not operator.getitem or u.args[1] not in (0, 1):
            raise Refused(f"its result is used by {u.format_node()}, not indexed")
        if u.args[1] == 1 and not call["need_weights"]:
            raise Refused("the attention weights are read although need_weights=False")
    modes = [getattr(example_value(n), "fake_mode", None) for n in node.all_input_nodes]
    mode = next((m for m in modes if m is not None), None)  # the example values' own mode (graph_edit)
    if mode is None:
        raise Refused("no fake mode on its inputs' example values")
    same = (call["query"] is call["key"] is call["value"], call["key"] is call["value"])
    before = set(graph.nodes)
    emitter = _Emitter(graph)
    with graph.inserting_before(node):
        out, weights = _emit(emitter, call, same)
    new = [n for n in graph.nodes if n not in before]
    try:
        for n in new:
            _stamp(n, node, names, emitter.paths.get(n))
            _fake_run(n, mode)
    except (RuntimeError, TypeError, ValueError) as exc:  # shapes torch itself would reject: leave the call
        for n in reversed(new):
            graph.erase_node(n)
        raise Refused(f"its decomposition does not trace on the example values: {exc}") from exc
    results = (out.node, None if weights is None else weights.node)
    for u in users:
        u.replace_all_uses_with(results[u.args[1]])
        graph.erase_node(u)
    graph.erase_node(node)


def decompose_mha(gm: fx.GraphModule, names: ModuleNames) -> int:
    """Decompose every ``F.multi_head_attention_forward`` call of ``gm`` in place; returns how many were.
    A refused call stays, with the reason in ``node.meta[REFUSED_KEY]`` (logged at WARNING)."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not MHA_FUNCTION:
            continue
        try:
            _decompose(gm.graph, node, names)
        except Refused as exc:
            node.meta[REFUSED_KEY] = str(exc)
            log.info("fxquant: %s (%s) stays one opaque call, unquantized: %s",
                        names.node_path(node) or "<root>", node.name, exc)
            continue
        done += 1
    return done
