"""fxquant.passes: FX passes over the Dynamo graph (torch IR) that turn GEMM sites into quantized ops.

One pass per file, run in this order by ``run_passes`` (ARCHITECTURE.md "Where to rewrite"):

    decompose_mha                       F.multi_head_attention_forward -> F.linear, SDPA / mha_attention_weights
    sites.find_sites                    match F.linear, SDPA, Megatron linears, HF Conv1D, unfused attention GEMMs
    resolve.resolve_sites               the scheme's LinearQuant / AttentionQuant per site -> node.meta["fxquant"]
    rewrite_linear                      F.linear           -> wrappers.fxquant_linear
                                        a Megatron linear's inlined matmul -> wrappers.fxquant_matmul
                                        an HF Conv1D's addmm -> torch.t(weight), wrappers.fxquant_linear
    rewrite_sdpa                        SDPA               -> wrappers.fxquant_sdpa
                                        mha_attention_weights -> wrappers.fxquant_attention_weights
    rewrite_unfused_attention           baddbmm / bmm      -> wrappers.fxquant_baddbmm / fxquant_bmm
    rewrite_megatron_linear             quantize nodes inside autograd_function_apply's fwd/bwd bodies
    strict (checks)                     sites selected but not rewritten, coverage, graph breaks

``node.meta["fxquant"]`` (a ``sites.SiteMeta``) is the contract with later passes (capture taps): see
docs/compile.md. The passes never call ``graph.eliminate_dead_code()`` (trap 2).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import fx

from fxquant.passes.decompose_mha import decompose_mha
from fxquant.passes.expected import expected_calls, recomputes
from fxquant.passes.layers import LayerNumbering
from fxquant.passes.module_paths import ModuleNames
from fxquant.passes.resolve import resolve_sites
from fxquant.passes.rewrite_linear import rewrite_linear
from fxquant.passes.rewrite_megatron_linear import rewrite_megatron_linear
from fxquant.passes.rewrite_sdpa import rewrite_attention_weights, rewrite_sdpa
from fxquant.passes.rewrite_unfused_attention import rewrite_unfused_attention
from fxquant.formats.options import Rounding
from fxquant.formats.tensor_quant import TensorQuant
from fxquant.passes.sites import (META_KEY, Match, OpKind, SiteMeta, Status, UnmatchedOp, checkpointed_bodies,
                                  find_sites)
from fxquant.schemes.scheme import Scheme

__all__ = ["GraphReport", "LayerNumbering", "META_KEY", "ModuleNames", "OpKind", "SiteMeta", "Status", "UnmatchedOp", "run_passes"]


@dataclass
class GraphReport:
    """What the passes found and did in one Dynamo graph."""

    index: int
    sites: list[SiteMeta] = field(default_factory=list)
    unmatched: list[UnmatchedOp] = field(default_factory=list)
    expected_calls: tuple[int, int] = (0, 0)  # fxquant::quantize calls per (forward, backward), see expected.py
    graph_module: fx.GraphModule | None = field(default=None, repr=False)  # the rewritten Dynamo graph
    frame: int | None = None  # Dynamo's frame id of the graph (its recompiles share it); None when unknown
    grad_enabled: bool = True  # compiled under grad mode (Dynamo keeps a no_grad graph beside the training one)
    recomputes: bool = False  # sites in checkpointed regions: the backward runs more quantizes (expected.recomputes)
    modules: frozenset[str] = frozenset()  # every module path on a node's module stack (graph and nested bodies)
    # what pins the graph to one module instance (passes.instances): frame argument or parameter source -> module path
    instance: dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> list[SiteMeta]:
        return [s for s in self.sites if s.status is Status.FAILED]


SR_IN_REGION = ("stochastic rounding inside an activation-checkpointed region (torch.utils.checkpoint): the backward's "
                "recompute would draw other random numbers than the forward did, so its gradients would not belong to "
                "the forward; the site runs in high precision (round to nearest there, or checkpoint outside it)")


def stochastic(config: object) -> bool:
    """Whether a resolved LinearQuant / AttentionQuant rounds any operand stochastically."""
    if isinstance(config, TensorQuant):
        return config.options.rounding is Rounding.SR
    if dataclasses.is_dataclass(config):
        return any(stochastic(getattr(config, f.name)) for f in dataclasses.fields(config))
    return False


def _sr_in_region(match: Match, gm: fx.GraphModule) -> bool:
    """Mark a site inside a checkpointed region whose config rounds stochastically FAILED (``SR_IN_REGION``)."""
    meta = match.node.meta[META_KEY]
    if match.owner is gm or meta.config is None or not stochastic(meta.config):
        return False
    match.node.meta[META_KEY] = dataclasses.replace(meta, status=Status.FAILED, note=SR_IN_REGION)
    return True


def run_passes(
    gm: fx.GraphModule, scheme: Scheme, names: ModuleNames, *, layers: LayerNumbering | None = None,
    index: int = 0, dry_run: bool = False, dedupe: bool = True, attention: str | None = None,
) -> GraphReport:
    """Match, resolve and (unless ``dry_run``) rewrite ``gm`` in place; returns the report. ``dedupe``: count
    expected quantize calls as AOT autograd's CSE leaves them (False for the eager inner backend)."""
    for module in [gm, *checkpointed_bodies(gm)]:  # an MHA inside a checkpointed region too
        if decompose_mha(module, names):
            module.recompile()
    traced = frozenset(path for module in gm.modules() if isinstance(module, fx.GraphModule)
                       for node in module.graph.nodes for path, _ in names.node_stack(node))
    found = find_sites(gm, names, layers)
    resolve_sites(found, scheme)
    refused = {id(m) for m in found.matches if _sr_in_region(m, gm)}  # status FAILED
    if dry_run:  # what the rewrite below would do, without doing it
        metas = [m.node.meta[META_KEY] for m in found.matches]
        metas = [dataclasses.replace(meta, status=Status.DRY_RUN) if meta.selected and meta.status is not Status.FAILED
                 else meta for meta in metas]
        return GraphReport(index, metas, found.unmatched, graph_module=gm, modules=traced)
    done = []
    owners = {id(gm): gm}
    for match in found.matches:
        owner = match.owner  # gm, or the body of a checkpointed region (sites module docstring)
        owners[id(owner)] = owner
        if id(match) in refused:
            done.append(match.node.meta[META_KEY])
        elif match.op in (OpKind.LINEAR, OpKind.MODULE_MATMUL):
            done.append(rewrite_linear(owner.graph, match.node))
        elif match.op is OpKind.SDPA:
            done.append(rewrite_sdpa(owner.graph, match.node, attention))
        elif match.op is OpKind.ATTENTION_WEIGHTS:
            done.append(rewrite_attention_weights(owner.graph, match.node))
        elif match.op is OpKind.MEGATRON_LINEAR:
            done.append(rewrite_megatron_linear(owner, match.node))
        else:
            done.append(rewrite_unfused_attention(owner.graph, match.node))
    for owner in owners.values():  # bodies first: the frame's graph module's code refers to them
        if owner is not gm:
            owner.graph.lint()
            owner.recompile()
    gm.graph.lint()
    gm.recompile()
    return GraphReport(index, done, found.unmatched, expected_calls(gm, dedupe=dedupe), gm,
                       recomputes=recomputes(gm), modules=traced)
