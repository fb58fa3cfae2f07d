"""Site records and the matcher of GEMM-bearing ops in a Dynamo graph (torch IR, ARCHITECTURE.md).

What each op looks like in the graph Dynamo hands the backend, and the ``OpKind`` it is matched as:

    F.linear (nn.Linear)                                    LINEAR
    F.scaled_dot_product_attention                          SDPA
    higher_order.autograd_function_apply whose fwd_body     MEGATRON_LINEAR  (Column/RowParallelLinear)
        holds exactly one matmul
    torch.matmul directly inside a Column/RowParallelLinear  MODULE_MATMUL    (the same linear traced with grad
                                                                              disabled: Dynamo inlines the
                                                                              autograd.Function's forward)
    torch.addmm(bias, x, weight) inside an HF Conv1D         MODULE_MATMUL    (GPT-2's linear: weight [in, out]
                                                                              a parameter, 1-D bias)
    torch.baddbmm inside a core-attention module            UNFUSED_QK       (Megatron's unfused attention)
    torch.bmm inside a core-attention module                UNFUSED_PV
    wrappers.mha_attention_weights                          ATTENTION_WEIGHTS (nn.MultiheadAttention with
                                                                              need_weights=True, put there by
                                                                              decompose_mha, which also turns
                                                                              its projections into F.linear)

Every other matmul-like op (matmul, mm, bmm, baddbmm, addmm, einsum, @, _grouped_mm, ATen's mm/bmm/... called
directly) is reported as unmatched, and so is every opaque call (``passes.opaque``): one graph node that runs
GEMMs inside (torch's fused transformer fast paths, recurrent layers, ATen's SDPA kernels, an MHA call
``decompose_mha`` refused, a custom op given a >= 2-D parameter of the model, such as an MoE's grouped expert
GEMM); those carry a ``note``, and strict mode rejects them where the scheme quantizes (``strict.opaque_calls``).

An activation-checkpointed region (``torch.utils.checkpoint``, reentrant or not) reaches the backend as
``higher_order.tag_activation_checkpoint(body, *args)``: the ops of its body are matched as above and rewritten
in the body's graph (``Match.owner``), where AOT autograd traces them with the region's recompute tags, so the
quantizes of the region's forward run again in the backward instead of their results being kept. The ops in the
subgraphs of any other higher-order op are listed as unmatched with a note naming it.
This module only reads the graph; ``resolve`` attaches the scheme and the ``rewrite_*`` passes edit it.
"""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

from fxquant.passes.layers import LayerNumbering
from fxquant.passes.module_paths import ModuleNames
from fxquant.passes.opaque import CUSTOM_OP_NOTE, aten_matmul, custom_op, opaque_call
from fxquant.passes.wrappers import mha_attention_weights
from fxquant.schemes.model import AttentionQuant, LinearQuant, Site, SiteKind, layer_stack, site_kind_for

META_KEY = "fxquant"  # node.meta[META_KEY] is a SiteMeta (docs/compile.md)
REFUSED_KEY = "fxquant_mha_refused"  # node.meta: why decompose_mha left an MHA call opaque
KIND_KEY = "fxquant_site_kind"  # node.meta: a SiteKind set by decompose_mha, instead of one guessed from the path


class OpKind(str, enum.Enum):
    LINEAR = "linear"
    SDPA = "sdpa"
    MEGATRON_LINEAR = "megatron_linear"
    MODULE_MATMUL = "module_matmul"
    UNFUSED_QK = "unfused_qk"
    UNFUSED_PV = "unfused_pv"
    ATTENTION_WEIGHTS = "attention_weights"

    @property
    def is_attention(self) -> bool:
        return self in (OpKind.SDPA, OpKind.UNFUSED_QK, OpKind.UNFUSED_PV, OpKind.ATTENTION_WEIGHTS)


class Status(str, enum.Enum):
    REWRITTEN = "rewritten"  # quantized ops inserted
    HIGH_PRECISION = "high"  # the scheme keeps every operand of this site in high precision
    FAILED = "failed"  # selected by the scheme but the rewrite could not be applied (see SiteMeta.note)
    DRY_RUN = "dry_run"  # explain(): matched and resolved, graph left unchanged


@dataclass(frozen=True)
class SiteMeta:
    """What fxquant knows about one matched node; stored as ``node.meta["fxquant"]``.

    ``config`` is the resolved LinearQuant / AttentionQuant (None: high precision); ``quantize_calls`` the
    number of ``fxquant::quantize`` calls this node's rewrite makes per forward+backward (fwd, bwd).
    """

    site: Site
    op: OpKind
    node_name: str
    config: LinearQuant | AttentionQuant | None = None
    status: Status = Status.HIGH_PRECISION
    quantize_calls: tuple[int, int] = (0, 0)
    note: str = ""
    stack_line: str = ""

    @property
    def selected(self) -> bool:
        return self.config is not None


@dataclass(frozen=True)
class UnmatchedOp:
    """A matmul-like op that no pattern matched (it runs in high precision). ``note`` is set for an opaque
    call (``passes.opaque``): what GEMMs it hides, and why it was not decomposed."""

    node_name: str
    target: str
    module_path: str
    shapes: tuple[str, ...]
    stack_line: str = ""
    note: str = ""

    @property
    def opaque(self) -> bool:
        return bool(self.note)


_SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_LINEAR_TARGETS = {F.linear, torch._C._nn.linear}
_MATMUL_FUNCTIONS = {
    torch.matmul: "matmul", torch.mm: "mm", torch.bmm: "bmm", torch.baddbmm: "baddbmm", torch.addmm: "addmm",
    torch.addbmm: "addbmm", torch.einsum: "einsum", torch.functional.einsum: "einsum", torch.tensordot: "tensordot",
    torch.functional.tensordot: "tensordot", torch.mv: "mv", torch.addmv: "addmv", torch.inner: "inner",
    torch.chain_matmul: "chain_matmul", torch.linalg.multi_dot: "multi_dot", torch.linalg.matmul: "matmul",
    torch.linalg.vecdot: "vecdot", operator.matmul: "@", F.bilinear: "bilinear", torch.bilinear: "bilinear",
}
for _name, _fn in (("_grouped_mm", getattr(torch, "_grouped_mm", None)), ("grouped_mm", getattr(F, "grouped_mm", None))):
    if _fn is not None:  # MoE grouped GEMMs, where this torch has them
        _MATMUL_FUNCTIONS[_fn] = _name
LINEAR_MODULE_CLASSES = ("ColumnParallelLinear", "RowParallelLinear")
CONV1D_MODULE_CLASSES = ("Conv1D",)  # HF transformers' GPT-2 linear: torch.addmm(bias, x, weight), weight [in, out]
# ops a weight passes through on its way into a call: views, transposes, indexing (one expert's matrix), casts
# (Dynamo's method and function names)
_WEIGHT_VIEWS = {"t", "transpose", "permute", "view", "reshape", "contiguous", "getitem", "__getitem__", "select",
                 "narrow", "to", "type_as", "float", "half", "bfloat16", "detach"}
_MATMUL_METHODS = {"matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "mv", "addmv", "__matmul__", "__rmatmul__"}
AUTOGRAD_FUNCTION_APPLY = torch.ops.higher_order.autograd_function_apply
CHECKPOINT_REGION = torch.ops.higher_order.tag_activation_checkpoint  # torch.utils.checkpoint, as Dynamo traces it


def matmul_name(node: fx.Node) -> str | None:
    """The name of the matmul-like op ``node`` calls (``"bmm"``, ``"@"``, ``"linear"``...), else None."""
    if node.op == "call_function":
        if node.target in _LINEAR_TARGETS:
            return "linear"
        if node.target in _SDPA_TARGETS:
            return "scaled_dot_product_attention"
        return _MATMUL_FUNCTIONS.get(node.target)
    if node.op == "call_method" and node.target in _MATMUL_METHODS:
        return str(node.target)
    return None


def is_matmul(node: fx.Node) -> bool:
    name = matmul_name(node)
    return name is not None and name not in ("linear", "scaled_dot_product_attention")


def stack_line(node: fx.Node) -> str:
    """The innermost ``File "...", line N, in f`` of the node's user stack trace ('' if none)."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
    return lines[-1] if lines else ""


def shape_str(value: object) -> str:
    shape = getattr(value, "shape", None)
    if shape is None:
        return "?"
    return "[" + ", ".join(str(s) for s in shape) + "]"


def example_value(node: object) -> object:
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def body_modules(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.GraphModule, fx.GraphModule] | None:
    """(fwd_body, bwd_body) of an ``autograd_function_apply`` node, or None."""
    if node.op != "call_function" or node.target is not AUTOGRAD_FUNCTION_APPLY:
        return None
    fwd, bwd = node.args[0], node.args[1]
    if not (isinstance(fwd, fx.Node) and isinstance(bwd, fx.Node) and fwd.op == bwd.op == "get_attr"):
        return None
    return getattr(gm, fwd.target), getattr(gm, bwd.target)


def _is_linear_apply(gm: fx.GraphModule, node: fx.Node) -> bool:
    bodies = body_modules(gm, node)
    if bodies is None:
        return False
    mms = [n for n in bodies[0].graph.nodes if is_matmul(n) or matmul_name(n) == "linear"]
    return len(mms) == 1


@dataclass(frozen=True)
class Match:
    node: fx.Node
    op: OpKind
    site: Site
    owner: fx.GraphModule  # the module whose graph holds ``node``: the frame's, or a checkpointed region's body


@dataclass
class FoundSites:
    matches: list[Match]
    unmatched: list[UnmatchedOp]


def _site_path(names: ModuleNames, node: fx.Node, root: str | None) -> str:
    path = names.node_path(node)
    if path is not None:
        return path
    # a linear's weight also through a cast or view (F.linear(h, weight=self.emb.weight.to(h.dtype)))
    owner = names.param_owner(node, extra=(_weight_source(node),) if matmul_name(node) == "linear" else ())
    if owner is not None:
        return owner
    return root or ""


def find_sites(gm: fx.GraphModule, names: ModuleNames, layers: LayerNumbering | None = None) -> FoundSites:
    """Match the GEMM-bearing ops of a Dynamo graph (module docstring); nothing is modified. ``layers`` numbers
    the sites' layers (global across pipeline stages, passes.layers); default: the local ``layers.N``."""
    layers = layers or LayerNumbering()
    found = FoundSites([], [])
    _find(gm, names, layers, names.frame_root(gm.graph), found)
    return found


def _find(gm: fx.GraphModule, names: ModuleNames, layers: LayerNumbering, root: str | None,
          found: FoundSites) -> None:
    """``find_sites`` over the nodes of ``gm``'s graph, and of the bodies of the checkpointed regions in it."""
    unmatched = found.unmatched

    def match(node: fx.Node, op: OpKind, site: Site) -> None:
        found.matches.append(Match(node, op, site, gm))

    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if node.target is CHECKPOINT_REGION:  # its body's ops are rewritten in place (module docstring)
            for body in region_bodies(gm, node):
                _find(body, names, layers, root, found)
            continue
        path = _site_path(names, node, root)
        name = matmul_name(node)
        if name == "linear":
            kind = node.meta.get(KIND_KEY)
            if kind is None and layer_stack(path) is None and names.is_embedding_weight(_weight_source(node)):
                kind = SiteKind.LM_HEAD  # a tied head written F.linear(h, self.<embedding>.weight), outside the layers
            match(node, OpKind.LINEAR, layers.site(path, kind))
        elif name == "scaled_dot_product_attention":
            match(node, OpKind.SDPA, layers.site(path, SiteKind.ATTENTION))
        elif node.op == "call_function" and node.target is mha_attention_weights:
            match(node, OpKind.ATTENTION_WEIGHTS, layers.site(path, SiteKind.ATTENTION))
        elif node.op == "call_function" and opaque_call(node.target) is not None:
            unmatched.append(_opaque(node, path))
        elif node.op == "call_function" and custom_op(node.target) is not None:
            if any(_is_weight(a) for a in _tensor_args(node)):
                unmatched.append(_unmatched(node, path, custom_op(node.target), CUSTOM_OP_NOTE))
        elif node.op == "call_function" and node.target is AUTOGRAD_FUNCTION_APPLY:
            bodies = body_modules(gm, node)
            if _is_linear_apply(gm, node) and site_kind_for(path) is not SiteKind.ATTENTION:
                match(node, OpKind.MEGATRON_LINEAR, layers.site(path))
            elif bodies is not None:
                for body in bodies:
                    for sub in body.graph.nodes:
                        if matmul_name(sub) is not None:
                            unmatched.append(_unmatched(sub, _site_path(names, sub, root) or path))
        elif node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            unmatched.extend(_in_region(gm, node, names, root, path))
        elif name in ("matmul", "@") and _innermost_class(names, node) in LINEAR_MODULE_CLASSES:
            match(node, OpKind.MODULE_MATMUL, layers.site(path))
        elif name == "addmm" and is_conv1d_addmm(names, node):
            match(node, OpKind.MODULE_MATMUL, layers.site(path))
        elif name in ("baddbmm", "bmm") and site_kind_for(path) is SiteKind.ATTENTION:
            op = OpKind.UNFUSED_QK if name == "baddbmm" else OpKind.UNFUSED_PV
            match(node, op, layers.site(path, SiteKind.ATTENTION))
        elif name is not None or (node.op == "call_function" and aten_matmul(node.target) is not None):
            unmatched.append(_unmatched(node, path))


def checkpointed_bodies(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The bodies of the checkpointed regions of ``gm``, nested ones included."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is CHECKPOINT_REGION:
            for body in region_bodies(gm, node):
                out += [body] + checkpointed_bodies(body)
    return out


def region_bodies(gm: fx.GraphModule, node: fx.Node) -> list[fx.GraphModule]:
    """The subgraphs (GraphModules reached through ``get_attr`` arguments) a higher-order op ``node`` runs."""
    out = []
    for arg in node.args:
        body = getattr(gm, arg.target, None) if isinstance(arg, fx.Node) and arg.op == "get_attr" else None
        if isinstance(body, fx.GraphModule):
            out.append(body)
    return out


def _in_region(gm: fx.GraphModule, node: fx.Node, names: ModuleNames, root: str | None,
               path: str) -> list[UnmatchedOp]:
    """The GEMM-bearing ops in the subgraphs a higher-order op other than a checkpointed region runs (a wrapped
    function, a branch of cond...), nested ones included: the passes do not rewrite them, so each is listed as
    unmatched (strict refuses it) with a note naming the op."""
    hop = getattr(node.target, "__name__", str(node.target))
    note = f"inside the subgraph of higher-order op {hop}: fxquant does not rewrite ops there"
    out: list[UnmatchedOp] = []
    for body in region_bodies(gm, node):
        for sub in body.graph.nodes:
            if sub.op == "call_function" and isinstance(sub.target, torch._ops.HigherOrderOperator):
                out.extend(_in_region(body, sub, names, root, path))
            elif sub.op in ("call_function", "call_method") and (
                    matmul_name(sub) is not None or (sub.op == "call_function" and aten_matmul(sub.target))):
                out.append(_unmatched(sub, _site_path(names, sub, root) or path, note=note))
    return out


def _opaque(node: fx.Node, path: str) -> UnmatchedOp:
    name, hides = opaque_call(node.target)
    refused = node.meta.get(REFUSED_KEY)
    return _unmatched(node, path, name, f"opaque call ({hides})" + (f"; not decomposed: {refused}" if refused else ""))


def parameter(node: object) -> torch.nn.Parameter | None:
    """The model parameter a graph input ``node`` stands for (Dynamo's placeholder of it), else None."""
    if not isinstance(node, fx.Node) or node.op != "placeholder":
        return None
    example = getattr(node.meta.get("grapharg"), "example", None)
    return example if isinstance(example, torch.nn.Parameter) else None


def _through_views(node: object) -> object:
    """The node a chain of views, transposes and casts (``_WEIGHT_VIEWS``, a few steps) starts from."""
    for _ in range(8):
        if not isinstance(node, fx.Node) or parameter(node) is not None:
            return node
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.op not in ("call_method", "call_function") or name not in _WEIGHT_VIEWS or not node.args:
            return node
        node = node.args[0]
    return node


def _is_weight(node: fx.Node) -> bool:
    """Whether ``node`` is a >= 2-D parameter, or a view, transpose or cast of one (a few steps back)."""
    p = parameter(_through_views(node))
    return p is not None and p.dim() >= 2


def _weight_source(node: fx.Node) -> object:
    """The weight of a linear call (positional or ``weight=``), looked through views and casts
    (``F.linear(h, weight=self.emb.weight.to(h.dtype))``)."""
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    return _through_views(weight)


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), out.append)
    return out


def is_conv1d_addmm(names: ModuleNames, node: fx.Node) -> bool:
    """``torch.addmm(bias, x, weight)`` run by an HF ``Conv1D`` (``CONV1D_MODULE_CLASSES``): ``weight`` [in, out] a
    parameter, ``x`` 2-D, ``bias`` 1-D, beta = alpha = 1: the linear ``x @ weight + bias``."""
    if node.op != "call_function" or node.target is not torch.addmm or len(node.args) != 3:
        return False
    if any(key not in ("beta", "alpha") or value != 1 for key, value in node.kwargs.items()):
        return False
    if _innermost_class(names, node) not in CONV1D_MODULE_CLASSES or parameter(node.args[2]) is None:
        return False
    dims = [getattr(example_value(a), "ndim", None) for a in node.args]
    return dims == [1, 2, 2]


def is_hf_conv1d(module: torch.nn.Module) -> bool:
    """Whether ``module`` is Hugging Face's ``Conv1D`` (a linear with weight [nx, nf] and ``nf`` outputs), not any
    module of that class name (a 1-D convolution block)."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ in CONV1D_MODULE_CLASSES and isinstance(weight, torch.nn.Parameter)
            and weight.dim() == 2 and getattr(module, "nf", None) == weight.shape[1])


def _innermost_class(names: ModuleNames, node: fx.Node) -> str:
    stack = names.node_stack(node)
    return getattr(stack[-1][1], "__name__", "") if stack else ""


def _unmatched(node: fx.Node, path: str, name: str | None = None, note: str = "") -> UnmatchedOp:
    name = name or matmul_name(node) or aten_matmul(node.target) or str(node.target)
    shapes = tuple(shape_str(example_value(a)) for a in node.args if isinstance(a, fx.Node))
    return UnmatchedOp(node.name, name, path, shapes, stack_line(node), note)
