"""Pass: insert capture taps around the sites the capture spec selects (issue 4, deliverable 2).

Pre: ``run_passes`` has run, so every matched site node carries ``node.meta["fxquant"]`` (a SiteMeta) and
is either the original op (``F.linear``, SDPA, ``torch.baddbmm`` / ``torch.bmm`` of unfused attention) or
fxquant's wrapper with the same leading operands. An HF Conv1D site is tapped as its linear: rewritten, it is
``fxquant_linear`` on ``torch.t(weight)``; kept in high precision (``addmm(bias, x, weight)``), this pass turns
it into ``F.linear(x, torch.t(weight), bias)`` where a tap goes (``rewrite_linear.conv1d_as_linear``). Post, per
selected point:

    forward, pre     fxquant::capture(operand, tap)                      before the site
    forward, post    fxquant::capture(site, tap)                         after the site
    backward, pre    site's users read capture_grad(site, taps)          (the gradient arriving at the output)
    backward, post   the site reads capture_grad(operand, taps)          (the gradient it produces for an operand)
    quantized copy   fxquant::capture(operand, tap with qspec + dim)     the op re-quantizes the operand, in its
                     window only, exactly as the GEMM does (fxquant::quantize, same format, options and
                     blocked dim; linear operands as the GEMM sees them, flattened to [M, K])

Effectful captures survive AOT/Inductor (trap 3); ``capture_grad`` is a module-level wrapper (trap 1)
whose backward runs the capture in the backward graph. Only nodes created here are added; nothing is
removed (trap 2). Attention ``scores`` (S = scale * Q K^T, before mask and softmax) are the QK^T site's result
in Megatron's unfused attention; at an SDPA site the reference attention (``wrappers.fxquant_sdpa``) captures
them itself, given the taps as its ``scores_tap`` keyword. Points a site does not materialise (attention
``probs`` and ``scores`` under torch's SDPA or the flash kernel, quantized
copies of operands the scheme keeps in high precision or rounds stochastically) are listed in the
returned report, never silently dropped; so are the points of sites inside an activation-checkpointed region
(``torch.utils.checkpoint``: the region's body is a subgraph whose forward runs again in the backward, where a
tap would capture twice). An nn.MultiheadAttention's attention with need_weights=True
(``attention_weights``, returning (O, P)) is tapped as SDPA on its q, k, v [B*H, L, d] and item 0 of its
result; its probs are not tapped. Each report records the sections that selected a site of its graph and the
graph's sites: ``unmatched_sections`` names, over the graphs of a compile, each section that selected none, with the
selector that left none and the nearest module paths (``fxquant.compile`` logs one WARNING per such section).

Megatron linear sites (``autograd_function_apply``; the quantize nodes live inside its bodies) are tapped
on the node's own operands, which the fwd_body's matmul identifies (``operand_positions``): input and
weight before the node, output after its ``getitem(.., 0)``, grad_output / grad_input / grad_weight by
``capture_grad`` around them, quantized copies re-quantized as for ``F.linear`` (the bodies quantize the
same [M, K] / [N, K] / [M, N] views along the same axes). At TP > 1 the captured values are this rank's:
a ColumnParallelLinear's output shard, a RowParallelLinear's partial output before its all-reduce (its
bias, if any, is added after), and grad_input after the linear's dgrad all-reduce. The output's
``capture_grad`` is a view of it, or a copy where a user of the output may change it in place (the
RowParallelLinear's all-reduce at TP > 1): autograd refuses in-place changes of a custom Function's view.
"""
from __future__ import annotations

import difflib
import logging
import operator
import re
from dataclasses import dataclass, field

import torch
from torch import fx

from fxquant.capture.runtime import capture_grad
from fxquant.capture.spec import GEMM_OPERANDS, CaptureSpec, Component, Copy, Direction, Gemm, ModuleKind, Role
from fxquant.capture.tap import Tap, encode_taps
from fxquant.passes.expected import attention_runs, gemm_runs, output_requires_grad
from fxquant.passes.graph_edit import copy_meta
from fxquant.passes.rewrite_linear import conv1d_as_linear
from fxquant.passes.rewrite_megatron_linear import operand_positions
from fxquant.passes.sites import META_KEY, OpKind, SiteMeta, body_modules, checkpointed_bodies, example_value
from fxquant.passes.wrappers import fxquant_linear, fxquant_matmul, fxquant_sdpa

log = logging.getLogger(__name__)

CAPTURE = torch.ops.fxquant.capture.default

# Graph position of each role per op kind: ("arg", i) = i-th operand, ("out",) = the site's result.
_LINEAR_POSITIONS = {Role.INPUT: ("arg", 0), Role.WEIGHT: ("arg", 1), Role.OUTPUT: ("out",), Role.GRAD_OUTPUT: ("out",),
                     Role.GRAD_INPUT: ("arg", 0), Role.GRAD_WEIGHT: ("arg", 1)}
_SDPA_POSITIONS = {Role.QUERY: ("arg", 0), Role.KEY: ("arg", 1), Role.VALUE: ("arg", 2), Role.OUTPUT: ("out",),
                   Role.GRAD_OUTPUT: ("out",), Role.GRAD_QUERY: ("arg", 0), Role.GRAD_KEY: ("arg", 1),
                   Role.GRAD_VALUE: ("arg", 2)}
_POSITIONS: dict[OpKind, dict[Role, tuple]] = {
    OpKind.LINEAR: _LINEAR_POSITIONS,
    OpKind.MEGATRON_LINEAR: _LINEAR_POSITIONS,  # arg 0 / 1 = the apply node's input / weight (_site_nodes)
    # scores exist inside the reference attention only (wrappers.fxquant_sdpa): see _tap_sdpa_scores
    OpKind.SDPA: {**_SDPA_POSITIONS, Role.SCORES: ("scores",)},
    OpKind.ATTENTION_WEIGHTS: _SDPA_POSITIONS,  # "out" = item 0 of its (O, P) result (_site_nodes)
    # baddbmm(input, Q, K^T): the key is captured as the GEMM operand K^T [.., d, Lk]; its result is the scores
    # (alpha = the softmax scale; captured before Megatron's in-place mask)
    OpKind.UNFUSED_QK: {Role.QUERY: ("arg", 1), Role.KEY: ("arg", 2), Role.SCORES: ("out",),
                        Role.GRAD_QUERY: ("arg", 1), Role.GRAD_KEY: ("arg", 2), Role.GRAD_SCORES: ("out",)},
    OpKind.UNFUSED_PV: {Role.PROBS: ("arg", 0), Role.VALUE: ("arg", 1), Role.OUTPUT: ("out",),
                        Role.GRAD_OUTPUT: ("out",), Role.GRAD_PROBS: ("arg", 0), Role.GRAD_VALUE: ("arg", 1)},
}
_ARG_NAMES = {OpKind.LINEAR: ("input", "weight"), OpKind.SDPA: ("query", "key", "value"),
              OpKind.ATTENTION_WEIGHTS: ("query", "key", "value"),
              OpKind.UNFUSED_QK: ("input", "batch1", "batch2"), OpKind.UNFUSED_PV: ("input", "mat2")}


@dataclass
class TapReport:
    """What was tapped in one graph, and what the spec asked for but the graph does not offer."""

    taps: list[Tap] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)
    # points a site does not materialise, keyed by (module, component, role, copy): reported only when no
    # other site of the same module offers them (Megatron's unfused attention: probs exist at PV, not QK^T)
    absent: list[tuple[tuple, str]] = field(default_factory=list)
    offered: set[tuple] = field(default_factory=set)
    # the spec's sections that select some site of the graph (by index), and every site of the graph as
    # (module path, component, kind, layer): what ``unmatched_sections`` reads
    selected: set[int] = field(default_factory=set)
    sites: list[tuple] = field(default_factory=list)


@dataclass(frozen=True)
class _SiteNodes:
    """The graph nodes holding a site's operands (by position, as in _POSITIONS) and its result; ``readers[i]``
    reads operand i where it is not the site node itself (a Megatron matmul's weight reaches it through its
    transpose)."""

    operands: tuple[fx.Node | None, ...]
    output: fx.Node | None
    readers: tuple[fx.Node | None, ...] = ()

    def reader(self, i: int, node: fx.Node) -> fx.Node:
        return self.readers[i] if i < len(self.readers) and self.readers[i] is not None else node


_MATMULS = (torch.matmul, operator.matmul, fxquant_matmul)


def _transposed(node: object) -> fx.Node | None:
    """The 2-D tensor a ``w.t()`` / ``torch.t(w)`` node transposes, else None."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    is_t = (node.op == "call_method" and node.target == "t") or (node.op == "call_function" and node.target is torch.t)
    value = example_value(node.args[0])
    return node.args[0] if is_t and isinstance(value, torch.Tensor) and value.dim() == 2 else None


def _megatron_matmul(node: fx.Node, meta: SiteMeta) -> bool:
    """A Megatron linear traced with grad disabled: ``matmul(x, weight.t())`` (or its rewrite, ``fxquant_matmul``)."""
    return (meta.op is OpKind.MODULE_MATMUL and node.target in _MATMULS and len(node.args) >= 2
            and _transposed(node.args[1]) is not None)


def _site_nodes(gm: fx.GraphModule, node: fx.Node, op: OpKind) -> _SiteNodes:
    meta = node.meta.get(META_KEY)
    if isinstance(meta, SiteMeta) and _megatron_matmul(node, meta):  # tapped as the linear it is: weight [out, in]
        return _SiteNodes((node.args[0], _transposed(node.args[1])), node, (None, node.args[1]))
    if op is OpKind.ATTENTION_WEIGHTS:  # returns (O, P): the output is its getitem 0
        firsts = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
        return _SiteNodes(tuple(_operand(node, op, i) for i in range(3)), firsts[0] if len(firsts) == 1 else None)
    if op is not OpKind.MEGATRON_LINEAR:
        return _SiteNodes(tuple(_operand(node, op, i) for i in range(len(_ARG_NAMES[op]))), node)
    bodies = body_modules(gm, node)
    positions = None if bodies is None else operand_positions(bodies[0])
    if positions is None:
        return _SiteNodes((None, None), None)
    tensors = node.args[2:]
    operands = tuple(tensors[i] if i < len(tensors) and isinstance(tensors[i], fx.Node) else None for i in positions)
    firsts = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    return _SiteNodes(operands, firsts[0] if len(firsts) == 1 else None)


def _operand(node: fx.Node, op: OpKind, i: int) -> fx.Node | None:
    if i < len(node.args):
        a = node.args[i]
    else:
        a = node.kwargs.get(_ARG_NAMES[op][i]) if i < len(_ARG_NAMES[op]) else None
        if a is None and op is OpKind.LINEAR and i == 0:
            a = node.kwargs.get("x")
    return a if isinstance(a, fx.Node) else None


def _layout(node: fx.Node, meta: SiteMeta) -> OpKind:
    """The op kind whose operand positions and GEMM axes a site node has: an HF Conv1D site (``module_matmul``) is
    tapped as the linear it is, rewritten into ``fxquant_linear`` on ``torch.t(weight)`` (``rewrite_linear``) or,
    kept in high precision, into ``F.linear`` on it where a tap is inserted (``conv1d_as_linear``); so is a
    Megatron linear traced with grad disabled, ``matmul(x, weight.t())``, its weight taken before the transpose."""
    conv1d = meta.op is OpKind.MODULE_MATMUL and node.target is torch.addmm
    return OpKind.LINEAR if node.target is fxquant_linear or conv1d or _megatron_matmul(node, meta) else meta.op


def _quant_operands(meta: SiteMeta, role: Role, op: OpKind) -> list[tuple[Gemm, object, int]]:
    """(gemm, TensorQuant, dim) for each GEMM that consumes ``role`` quantized (module docstring of schemes.model)."""
    c = meta.config
    if c is None:
        return []
    if op in (OpKind.LINEAR, OpKind.MEGATRON_LINEAR):  # dims of the [M, K] / [N, K] / [M, N] GEMM views
        table = {Role.INPUT: [(Gemm.FPROP, c.fprop.a, 1), (Gemm.WGRAD, c.wgrad.b, 0)],
                 Role.WEIGHT: [(Gemm.FPROP, c.fprop.b, 1), (Gemm.DGRAD, c.dgrad.b, 0)],
                 Role.GRAD_OUTPUT: [(Gemm.DGRAD, c.dgrad.a, 1), (Gemm.WGRAD, c.wgrad.a, 0)]}
    else:
        qk, pv = c.qk, c.pv
        # K [.., Lk, d] under SDPA and MHA's attention; K^T [.., d, Lk] in Megatron's baddbmm
        sdpa = op in (OpKind.SDPA, OpKind.ATTENTION_WEIGHTS)
        table = {Role.QUERY: [(Gemm.QK, qk.forward.a, -1), (Gemm.DK, qk.grad_b.a, -2)],
                 Role.KEY: [(Gemm.QK, qk.forward.b, -1 if sdpa else -2), (Gemm.DQ, qk.grad_a.b, -2 if sdpa else -1)],
                 Role.GRAD_SCORES: [(Gemm.DQ, qk.grad_a.a, -1), (Gemm.DK, qk.grad_b.b, -2)],
                 Role.PROBS: [(Gemm.PV, pv.forward.a, -1), (Gemm.DV, pv.grad_b.a, -2)],
                 Role.VALUE: [(Gemm.PV, pv.forward.b, -2), (Gemm.DP, pv.grad_a.b, -1)],
                 Role.GRAD_OUTPUT: [(Gemm.DP, pv.grad_a.a, -1), (Gemm.DV, pv.grad_b.b, -2)]}
    return [(g, tq, d) for g, tq, d in table.get(role, []) if tq is not None]


_BACKWARD_GEMMS = frozenset({Gemm.DGRAD, Gemm.WGRAD, Gemm.DQ, Gemm.DK, Gemm.DP, Gemm.DV})


def _gemms_run(node: fx.Node, op: OpKind) -> frozenset[Gemm] | None:
    """The backward GEMMs of site ``node`` that autograd runs (None: all of them), by the counters' rules
    (``passes.expected``): none where the site's output does not require grad (a graph compiled under no_grad, an
    evaluation's), at a linear no dgrad / wgrad for an input / weight without gradient, at attention dQ / dK / dV
    for the operand that has none, dP where neither Q nor K has one."""
    if op in (OpKind.LINEAR, OpKind.SDPA, OpKind.ATTENTION_WEIGHTS) and node.target is not torch.addmm:
        operands = [_operand(node, op, i) for i in range(len(_ARG_NAMES[op]))]
        if op is OpKind.LINEAR:
            runs = gemm_runs(node, *operands)
            return frozenset(g for g, i in ((Gemm.DGRAD, 2), (Gemm.WGRAD, 4)) if runs[i])
        runs = attention_runs(node, *operands)
        return frozenset(g for g, i in ((Gemm.DQ, 2), (Gemm.DK, 4), (Gemm.DP, 8), (Gemm.DV, 10)) if runs[i])
    return None if output_requires_grad(node) else frozenset()


def _kind(meta: SiteMeta) -> ModuleKind | None:
    try:
        return ModuleKind(meta.site.kind.value)
    except ValueError:
        return None


def _site_taps(meta: SiteMeta, op: OpKind, spec: CaptureSpec, report: TapReport,
               runs: frozenset[Gemm] | None = None) -> list[tuple[Tap, tuple]]:
    """Every (tap, graph position) the spec selects at this site; a quantized copy only for a GEMM that runs
    (``runs``: the backward GEMMs autograd runs there, None for all)."""
    site, kind = meta.site, _kind(meta)
    component = Component.ATTENTION if meta.op.is_attention else Component.LINEAR
    chosen: dict[tuple[Role, Copy], list[int]] = {}
    report.sites.append((site.module_path, component, kind, site.layer))
    for i in spec.sections_for(site.module_path, kind, site.layer):
        for p in spec.sections[i].points:
            if p.component is component:
                chosen.setdefault((p.role, p.copy), []).append(i)
                report.selected.add(i)
    positions = _POSITIONS.get(op)
    out: list[tuple[Tap, tuple]] = []
    for (role, copy), secs in chosen.items():
        where = None if positions is None else positions.get(role)
        what = f"{site.module_path} ({meta.op.value}): {component.value}.{role.value}[{copy.value}]"
        if where is not None:
            report.offered.add((site.module_path, component, role, copy))
        if where is None:
            report.absent.append(((site.module_path, component, role, copy),
                                  f"{what}: not materialised at a {meta.op.value} site"))
            continue
        base = dict(component=component, role=role, module=site.module_path, sections=tuple(secs), kind=kind,
                    layer=site.layer, placement=spec.placement_digest(), shard_dim=_tp_split(meta, kind, role))
        if copy is Copy.HP:
            out.append((Tap(**base), where))
            continue
        if role not in GEMM_OPERANDS[component]:
            continue
        quants = _quant_operands(meta, role, op)
        if not quants:
            report.unavailable.append(f"{what}: {KEPT_HIGH}")
        if runs is not None:  # not for a GEMM autograd never runs here (no_grad, frozen weight, ...)
            quants = [(g, tq, d) for g, tq, d in quants if g not in _BACKWARD_GEMMS or g in runs]
        for gemm, tq, dim in quants:
            if tq.options.rounding.value == "sr":
                report.unavailable.append(f"{what} for {gemm.value}: stochastic rounding cannot be re-quantized "
                                          "identically; not captured")
                continue
            out.append((Tap(**base, copy=Copy.QUANTIZED, gemm=gemm, qspec=tq.spec(), dim=dim), where))
    return out


# Megatron's tensor-parallel linears by kind: column-parallel (qkv, fc1, the output layer) split the weight's output
# rows and their output's last dim; row-parallel (proj, fc2) the weight's input columns and their input's last dim
# (their output is all-reduced, whole). Negative: from the end, resolved against the captured tensor's rank.
_COLUMN_PARALLEL = {Role.WEIGHT: 0, Role.GRAD_WEIGHT: 0, Role.OUTPUT: -1, Role.GRAD_OUTPUT: -1}
_ROW_PARALLEL = {Role.WEIGHT: 1, Role.GRAD_WEIGHT: 1, Role.INPUT: -1, Role.GRAD_INPUT: -1}
_TP_SPLITS = {ModuleKind.QKV: _COLUMN_PARALLEL, ModuleKind.FC1: _COLUMN_PARALLEL, ModuleKind.LM_HEAD: _COLUMN_PARALLEL,
              ModuleKind.PROJ: _ROW_PARALLEL, ModuleKind.FC2: _ROW_PARALLEL}


def _tp_split(meta: SiteMeta, kind: ModuleKind | None, role: Role) -> int | None:
    """The dim along which tensor parallelism splits this tensor of a Megatron linear site (None: not split, or not
    a Megatron linear; MoE experts, which expert parallelism splits instead, are left out). The runtime records it
    only when the rank's ``tp_size`` > 1."""
    if meta.op is not OpKind.MEGATRON_LINEAR or ".experts." in f".{meta.site.module_path}.":
        return None
    return _TP_SPLITS.get(kind, {}).get(role)


KEPT_HIGH = "kept in high precision by the scheme (no quantized copy)"
CHECKPOINTED = ("inside an activation-checkpointed region (torch.utils.checkpoint): no taps there (its forward runs "
                "again in the backward)")


def insert_capture_taps(gm: fx.GraphModule, spec: CaptureSpec) -> TapReport:
    """Insert the taps ``spec`` selects at every site of ``gm`` carrying ``node.meta["fxquant"]``; recompiles."""
    if not isinstance(spec, CaptureSpec):
        raise TypeError(f"spec must be a CaptureSpec (fxquant.capture.load_spec), got {type(spec).__name__}")
    report = TapReport()
    graph = gm.graph
    forward: dict[fx.Node, list[_Pending]] = {}  # tensor -> its forward taps, one call per tensor at the end
    for node in list(graph.nodes):
        meta = node.meta.get(META_KEY)
        if not isinstance(meta, SiteMeta):
            continue
        op = _layout(node, meta)
        taps = _site_taps(meta, op, spec, report, _gemms_run(node, op))
        if not taps:
            continue
        if node.target is torch.addmm:
            node = conv1d_as_linear(graph, node)
        nodes = _site_nodes(gm, node, op)
        grad_out: list[Tap] = []
        grad_args: dict[int, list[Tap]] = {}
        scores = [tap for tap, where in taps if where[0] == "scores"]
        if scores:
            _tap_sdpa_scores(node, meta, scores, report)
            taps = [(tap, where) for tap, where in taps if where[0] != "scores"]
        for tap, where in taps:
            target = nodes.output if where[0] == "out" else nodes.operands[where[1]]
            if target is None:
                report.unavailable.append(f"{meta.site.module_path} ({meta.op.value}): {tap.component.value}."
                                          f"{tap.role.value}[{tap.copy.value}]: tensor not found in the graph")
                continue
            report.taps.append(tap)
            backward = tap.direction is Direction.BACKWARD and tap.copy is Copy.HP
            backward |= tap.copy is Copy.QUANTIZED and tap.role in (Role.GRAD_OUTPUT, Role.GRAD_SCORES)
            if backward:
                (grad_out if where[0] == "out" else grad_args.setdefault(where[1], [])).append(tap)
            else:
                forward.setdefault(target, []).append(_Pending(tap, node, where[0] == "out"))
        for i, grad_taps in grad_args.items():  # one gradient per (site, operand): one call for all its taps
            operand, reader = nodes.operands[i], nodes.reader(i, node)
            with graph.inserting_before(reader):
                wrapped = _new(graph, node, capture_grad, (operand, encode_taps(grad_taps)))
            reader.replace_input_with(operand, wrapped)
        if grad_out:
            out = nodes.output
            users = list(out.users)
            copy = any(_may_mutate(u) for u in users)  # e.g. the in-place all-reduce after a TP>1 row-parallel linear
            with graph.inserting_after(out):
                wrapped = _new(graph, node, capture_grad, (out, encode_taps(grad_out), copy))
            for user in users:
                user.replace_input_with(out, wrapped)
    _insert_forward(graph, forward)
    for body in checkpointed_bodies(gm):  # not tapped there: each selected point is said
        for node in body.graph.nodes:
            meta = node.meta.get(META_KEY)
            if isinstance(meta, SiteMeta):
                for tap, _ in _site_taps(meta, _layout(node, meta), spec, report):
                    report.unavailable.append(f"{meta.site.module_path} ({meta.op.value}): {tap.component.value}."
                                              f"{tap.role.value}[{tap.copy.value}]: {CHECKPOINTED}")
    report.unavailable.extend(msg for key, msg in report.absent if key not in report.offered)
    _say_unavailable(report.unavailable)
    graph.lint()
    gm.recompile()
    return report


def _tap_sdpa_scores(node: fx.Node, meta: SiteMeta, taps: list[Tap], report: TapReport) -> None:
    """The scores of an SDPA site exist only inside the reference attention (``quantized_sdpa``): hand it the
    taps as its ``scores_tap`` keyword. torch's SDPA and the flash kernel never materialise them."""
    if node.target is not fxquant_sdpa:
        name = getattr(node.target, "__name__", str(node.target))
        report.unavailable.extend(
            f"{meta.site.module_path} ({meta.op.value}): attention.scores[hp]: not materialised by {name} (only "
            "the reference attention fxquant.qfunctions.quantized_sdpa, used where the scheme quantizes attention "
            "and the flash kernel is off, and Megatron's unfused attention compute QK^T)" for _ in taps[:1])
        return
    node.kwargs = {**node.kwargs, "scores_tap": encode_taps(taps)}
    report.taps.extend(taps)


@dataclass(frozen=True)
class _Pending:
    """A forward tap waiting for insertion: after its tensor (``after``) or just before its ``site``."""

    tap: Tap
    site: fx.Node
    after: bool


_INPLACE_OPERATORS = frozenset({operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                                operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                                operator.ixor, operator.ilshift, operator.irshift, operator.imatmul})


def _may_mutate(node: fx.Node) -> bool:
    """Conservatively: can this Dynamo-graph node change a tensor in place? (sites never do)."""
    if node.op == "call_module":
        return True
    if node.op not in ("call_function", "call_method") or isinstance(node.meta.get(META_KEY), SiteMeta):
        return False
    target = node.target
    if target in _INPLACE_OPERATORS or "out" in node.kwargs:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if name.endswith("__"):  # dunders: only item assignment and the augmented assignments mutate
        return name == "__setitem__" or (name.startswith("__i") and name not in ("__init__", "__iter__", "__index__"))
    return name.endswith("_")


def _insert_forward(graph: fx.Graph, forward: dict[fx.Node, list[_Pending]]) -> None:
    """One ``fxquant::capture`` per tapped tensor, carrying all its taps (the input q, k and v projections share
    is captured, and stored, once), at the first tap's position: right after the tensor, or before the first
    site reading it. A node that may mutate tensors in place between two positions starts a new call there."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    for target, pending in forward.items():
        def position(p: _Pending) -> int:  # index of the node the capture goes before
            return order[target] + 1 if p.after else order[p.site]

        groups: list[list[_Pending]] = []
        for p in sorted(pending, key=position):
            if groups and not any(_may_mutate(n) for n in nodes[position(groups[-1][0]):position(p)]):
                groups[-1].append(p)
            else:
                groups.append([p])
        for group in groups:
            first = group[0]
            point = graph.inserting_after(target) if first.after else graph.inserting_before(first.site)
            with point:
                _new(graph, first.site, CAPTURE, (target, encode_taps([p.tap for p in group])))


def _say_unavailable(unavailable: list[str]) -> None:
    """One WARNING per graph for the points it cannot offer, the full list at DEBUG. Quantized copies of operands
    the scheme keeps in high precision are expected wherever a spec asks for every quantized copy (the shipped
    ``predecessor`` spec under a scheme that quantizes some operands only): counted in the WARNING when there is
    one, else said at INFO."""
    if not unavailable:
        return
    notable = [u for u in unavailable if not u.endswith(KEPT_HIGH)]
    kept = len(unavailable) - len(notable)
    if notable:
        more = f" (+{len(notable) - 3} more; -vv or logging DEBUG lists them)" if len(notable) > 3 else ""
        also = f"; and {kept} quantized copies of operands the scheme keeps in high precision" if kept else ""
        log.warning("capture: %d selected points cannot be captured in this graph: %s%s%s", len(notable),
                    "; ".join(notable[:3]), more, also)
    else:
        log.info("capture: %d selected quantized copies do not exist in this graph: the scheme keeps those operands in "
                 "high precision", kept)
    for line in unavailable:
        log.debug("capture: %s", line)


def unmatched_sections(spec: CaptureSpec, reports: list[TapReport]) -> list[tuple[str, str]]:
    """(section name, line) per section of ``spec`` that selects no site of the graphs ``reports`` describe (a
    section selecting a site in any of them, through a forward or a backward point, is not listed): which of its
    selectors left no site, and the module paths nearest to what it asked for (as
    ``fxquant.schemes.rules.explain_unmatched`` does for scheme rules)."""
    selected = set().union(*(r.selected for r in reports))
    sites = list(dict.fromkeys(site for r in reports for site in r.sites))
    return [(sec.name, f"section {sec.name!r} selects no site of the compiled graphs, so it captures nothing: "
                       f"{_why_unmatched(sec, sites)}") for i, sec in enumerate(spec.sections) if i not in selected]


def _why_unmatched(section, sites: list[tuple]) -> str:
    """Why ``section`` selects none of ``sites`` ((path, component, kind, layer)), with the nearest module paths."""
    sel = section.layers
    comps = sorted({p.component.value for p in section.points})
    relevant = [s for s in sites if s[1].value in comps]
    if not relevant:
        return f"the graph has no {' or '.join(comps)} sites"
    paths = list(dict.fromkeys(s[0] for s in relevant))
    if sel.module is not None and not any(re.search(sel.module, p) for p in paths):
        near = difflib.get_close_matches(sel.module, paths, n=3, cutoff=0.3) or difflib.get_close_matches(
            sel.module.replace("\\", ""), paths, n=3, cutoff=0.0)
        return f"no {'/'.join(comps)} module path matches module {sel.module!r}; nearest module paths: {', '.join(near)}"
    found = [s for s in relevant if sel.module is None or re.search(sel.module, s[0])]
    if sel.kinds is not None and not any(s[2] in sel.kinds for s in found):
        present = sorted({s[2].value for s in found if s[2] is not None})
        return (f"no site of kind {', '.join(sorted(k.value for k in sel.kinds))}; the graph's "
                f"{'/'.join(comps)} sites{' matching module' if sel.module is not None else ''} are of kind "
                f"{', '.join(present) or 'none'}")
    found = [s for s in found if sel.kinds is None or s[2] in sel.kinds]
    layers = sorted({s[3] for s in found if s[3] is not None})
    span = f"{layers[0]}..{layers[-1]}" if layers else "none"
    return (f"no site in layers.indices {sorted(sel.layers or ())}; the layers of the sites the other selectors keep are "
            f"{span}; nearest module paths: {', '.join(dict.fromkeys(s[0] for s in found[:3]))}")


def _new(graph: fx.Graph, site: fx.Node, target, args: tuple) -> fx.Node:
    new = graph.call_function(target, args)
    copy_meta(site, new, example_value(args[0]) if target is capture_grad else None)
    return new


__all__ = ["TapReport", "insert_capture_taps", "unmatched_sections"]
