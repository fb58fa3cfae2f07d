"""Checks that no selected GEMM silently stays in high precision (issue item 5), and bad-input errors.

``QuantizationError`` is raised in strict mode; otherwise the same text is logged at WARNING. Checked:

- per graph: a site the scheme selects whose rewrite could not be applied (``Status.FAILED``);
- per call that compiled something (``coverage``): every nn.Linear / Megatron Column/RowParallelLinear / HF
  Conv1D and every ``core_attention`` / ``nn.MultiheadAttention`` module that the scheme selects must have been
  rewritten in some graph; one that was not ran outside the compiled graphs (a graph break split it, or
  its frame was skipped / fell back to eager), and the graph-break reasons Dynamo reported during the
  call are listed with it. Modules inside a ``fxquant.compile``'d submodule are not expected (``traced_modules``):
  it runs its own graphs;
- a frame that hit Dynamo's recompile limit and therefore runs eagerly from then on;
- per graph: an opaque call that runs GEMMs inside one node (``passes.opaque``: torch's fused
  transformer fast paths, recurrent layers, an nn.MultiheadAttention call ``decompose_mha`` refused, a custom
  op given a weight parameter) at a module path where the scheme quantizes a linear or an attention site
  (``opaque_calls``);
- once: a scheme that quantizes attention on graphs with no attention op but unmatched matmuls inside an
  attention module (``attention_not_found``: attention written out as matmul + softmax).

Bad input (``ValueError`` in both modes): a model in which no linear or attention op was found, and a
scheme rule with a selector (modules, layers or kinds) that matches no site (the error lists the nearest
paths; docs/schemes.md "Rules that match nothing").
"""
from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from fxquant.passes.decompose_mha import MHA_LINEAR_SITES
from fxquant.passes.layers import LayerNumbering
from fxquant.passes.sites import LINEAR_MODULE_CLASSES, SiteMeta, Status, UnmatchedOp, is_hf_conv1d
from fxquant.schemes.model import Component, Site, SiteKind, site_kind_for
from fxquant.schemes.scheme import Scheme

log = logging.getLogger(__name__)

RECOMPILE_LIMIT_KEY = "Dynamo recompile limit exceeded"


class QuantizationError(RuntimeError):
    """A site the scheme selects would run (or ran) unquantized; raised by ``fxquant.compile(strict=True)``."""


def report(issues: list[str], strict: bool) -> None:
    if not issues:
        return
    text = "fxquant: " + "\n  ".join(issues)
    if strict:
        raise QuantizationError(text)
    log.warning("%s", text)


def failed_sites(sites: Iterable[SiteMeta]) -> list[str]:
    return [
        f"selected {s.site.kind.value} site {s.site.module_path!r} ({s.op.value}, {s.node_name}) was not rewritten: "
        f"{s.note}" + (f" [{s.stack_line}]" if s.stack_line else "")
        for s in sites
        if s.status is Status.FAILED
    ]


def opaque_calls(unmatched: Iterable[UnmatchedOp], scheme: Scheme, layers: LayerNumbering) -> list[str]:
    """Opaque GEMM-containing calls at a module path whose linear or attention site the scheme would quantize."""
    out = []
    for u in unmatched:
        if not u.opaque:
            continue
        sites = (layers.site(u.module_path), layers.site(u.module_path, SiteKind.ATTENTION))
        if any(selected(scheme, s) for s in sites):
            where = f" [{u.stack_line}]" if u.stack_line else ""
            out.append(f"{u.target} in {u.module_path or '<root>'!r} ({u.node_name}) runs its GEMMs unquantized, one "
                       f"opaque call the scheme cannot reach: {u.note}{where}")
    return out


def _names_attention(path: str) -> bool:
    """Whether a module path names an attention module (Hugging Face's ``self_attn``, ``attn``, ``attention``,
    T5's ``SelfAttention``...): an unmatched matmul there is attention's, not a token-mixing or state-space GEMM."""
    return any("attn" in part.lower() or "attention" in part.lower() for part in path.split("."))


def attention_not_found(scheme: Scheme, sites: Iterable[SiteMeta], unmatched: Iterable[UnmatchedOp]) -> list[str]:
    """A scheme that quantizes attention, compiled graphs without any attention op, and plain matmul-like ops left
    unmatched in an attention module (``_names_attention``): attention written out as matmul + softmax (Hugging
    Face's attn_implementation="eager"), which runs unquantized."""
    if not any(r.attention is not None and r.attention.quantized for r in scheme.rules):
        return []
    if any(s.site.kind is SiteKind.ATTENTION for s in sites):
        return []
    matmuls = [u for u in unmatched if not u.opaque and _names_attention(u.module_path)]
    if not matmuls:
        return []
    first = matmuls[0]
    return [f"scheme {scheme.name} quantizes attention, but the compiled graphs hold no attention op "
            f"(F.scaled_dot_product_attention, nn.MultiheadAttention, Megatron's core attention) and "
            f"{len(matmuls)} matmul-like op(s) left unmatched (e.g. {first.target} in "
            f"{first.module_path or '<root>'!r}): attention written as explicit matmuls and softmax is not "
            f"recognised and runs unquantized; use SDPA (Hugging Face: attn_implementation=\"sdpa\")"]


def runs_apart(module: nn.Module) -> bool:
    """Whether an enclosing Dynamo trace leaves calls of ``module`` out of its graph: a compiled module whose
    forward is ``torch.compiler.disable``d, as ``fxquant.compile`` returns (it runs its own graphs, its own
    scheme); Dynamo inlines any other module."""
    return (isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
            and bool(inspect.getattr_static(module.forward, "_torchdynamo_disable", False)))


def traced_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` but a module that ``runs_apart`` and everything in it: what a compile of ``model``
    traces. The sites of a ``fxquant.compile``'d submodule are its own compile's, not the enclosing one's."""
    apart: list[str] = []
    out = []
    for name, mod in model.named_modules():
        if any(name.startswith(f"{p}.") for p in apart):
            continue
        if name and runs_apart(mod):
            apart.append(name)
            continue
        out.append((name, mod))
    return out


def model_sites(model: nn.Module, layers: LayerNumbering) -> list[Site]:
    """The sites the model's module structure implies: linear modules (HF Conv1D included), ``core_attention``
    modules and ``nn.MultiheadAttention`` modules (their attention; their out_proj is an nn.Linear); none inside
    a ``fxquant.compile``'d submodule (``traced_modules``)."""
    out = []
    for name, mod in traced_modules(model):
        if not name:
            continue
        if isinstance(mod, nn.Linear) or type(mod).__name__ in LINEAR_MODULE_CLASSES or is_hf_conv1d(mod):
            out.append(layers.site(name))
        elif site_kind_for(name) is SiteKind.ATTENTION or isinstance(mod, nn.MultiheadAttention):
            out.append(layers.site(name, SiteKind.ATTENTION))
    return out


def possible_sites(model: nn.Module, layers: LayerNumbering) -> list[Site]:
    """Every site the model could still show in a graph not compiled yet: each module path (root included), as
    a linear site of the kind its name gives and as an attention site, and for each nn.MultiheadAttention the
    linear sites ``decompose_mha`` creates (``MHA_LINEAR_SITES``; its in-projections are no modules). A rule
    that matches none of these and none of the sites compiled so far cannot match anything
    (``FxquantBackend.unmatched_rules``). A ``fxquant.compile``'d submodule's modules are not among them
    (``traced_modules``)."""
    out = []
    for name, mod in traced_modules(model):
        out += [layers.site(name), layers.site(name, SiteKind.ATTENTION)]
        if isinstance(mod, nn.MultiheadAttention):
            out += [layers.site(f"{name}.{suffix}" if name else suffix, kind)
                    for suffix, kind in MHA_LINEAR_SITES.items()]
    return out


def selected(scheme: Scheme, site: Site) -> bool:
    if site.kind.component is Component.ATTENTION:
        return scheme.attention_for(site) is not None
    return scheme.linear_for(site) is not None


def coverage(expected: list[Site], scheme: Scheme, seen: list[SiteMeta], graph_breaks: list[str],
             traced: frozenset[str]) -> list[str]:
    """Selected modules of the model that no compiled graph rewrote nor refused (a refused site, status
    ``failed``, was reported with its reason when its graph compiled): one whose code a graph traced (``traced``:
    the module paths of the compiled graphs' nodes) holds an op that was not recognised; one no graph traced ran
    outside torch.compile if this call broke a graph (``graph_breaks``), and was not called otherwise (with no
    graph break, everything the call ran was traced), which is no issue. Coverage is per module: one rewritten call
    covers a module whose other call ran eagerly (that graph break is logged by Dynamo)."""
    done = {s.site.module_path for s in seen if s.status in (Status.REWRITTEN, Status.DRY_RUN, Status.FAILED)}
    missing = [s for s in expected if selected(scheme, s) and s.module_path not in done]
    out = []
    for s in missing:
        what = f"selected {s.kind.value} site {s.module_path!r} was not rewritten in any compiled graph"
        if s.module_path in traced:
            out.append(f"{what}: a graph traced its code, but no linear or attention op of it was recognised")
        elif graph_breaks:
            out.append(f"{what}: it ran outside torch.compile (or was not called) around graph breaks during this "
                       f"call: {' | '.join(graph_breaks)}")
    return out


def check_model_has_sites(sites: list[SiteMeta], unmatched: list[UnmatchedOp], model_name: str) -> None:
    """ValueError when the compiled graphs hold no site: nothing to quantize. Not when an opaque call hides the
    GEMMs (a TransformerEncoderLayer's fast path in eval): that was reported as such (``opaque_calls``), a
    WARNING, or strict's error, and a later call may trace the decomposable path."""
    if sites or any(u.opaque for u in unmatched):
        return
    other = (
        "; matmul-like ops left unmatched: " + ", ".join(f"{u.target} in {u.module_path or '<root>'}" for u in unmatched[:8])
        if unmatched else ""
    )
    raise ValueError(
        f"model {model_name}: no linear (F.linear / nn.Linear, Megatron Column/RowParallelLinear) or attention "
        f"(F.scaled_dot_product_attention, Megatron core attention) op was found in the compiled graphs, so "
        f"there is nothing to quantize{other}"
    )


def unmatched_rule_error(scheme: Scheme, sites: Iterable[Site], layers: LayerNumbering | None = None
                         ) -> ValueError | None:
    """The error for rules with a selector (modules, layers or kinds) that match none of ``sites``; None if
    there are none. A rule without a selector (a preset's "every attention site") may match nothing. With the
    model's ``layers`` numbering, on a pipeline stage the other stages' layers count too
    (``LayerNumbering.other_stages``), and a rule with a ``modules`` regex may match nothing: the module may exist
    on another stage only."""
    sites = list(sites)
    stage = layers is not None and layers.is_stage(sites)
    if stage:
        sites += layers.other_stages(sites)
    unmatched = [u for u in scheme.unmatched_rules(sites) if any(u.rule.selector.specificity)
                 and not (stage and u.rule.selector.modules is not None)]
    if not unmatched:
        return None
    where = f" (scheme {scheme.name}" + (f", {scheme.source}" if scheme.source else "") + ")"
    return ValueError(f"scheme rules match no site of the model{where}:\n  " + "\n  ".join(map(str, unmatched)))


def check_rules_match(scheme: Scheme, sites: list[SiteMeta], layers: LayerNumbering | None = None,
                      elsewhere: Iterable[Site] = ()) -> None:
    """Raise ``unmatched_rule_error`` for the sites seen (and, on a pipeline stage, the other stages' layers:
    ``LayerNumbering.other_stages``), and ``elsewhere``: sites of the model that ran outside the compiled graphs
    (after a graph break; ``coverage`` reports them)."""
    error = unmatched_rule_error(scheme, [s.site for s in sites] + list(elsewhere), layers)
    if error is not None:
        raise error


def no_graph_compiled(model: str, before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The issue when a model's first call compiled no graph at all (Dynamo skipped the frame and ran it eagerly,
    unquantized), with the reasons Dynamo counted during the call."""
    reasons = [key.splitlines()[0] for key, n in after.items() if n > before.get(key, 0)]
    return [f"the call of {model} compiled no graph: Dynamo ran it eagerly, so nothing in it is quantized"
            + (f" (Dynamo: {'; '.join(reasons[:3])})" if reasons else "")
            + "; compile the modules it can trace (e.g. the part after the unsupported op) instead"]


def recompile_limit_hits(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The issue per recompile-limit fallback Dynamo counted during a call, naming the limit it hit (the counter's
    text says ``Limit type: recompile_limit`` or ``accumulated_recompile_limit``)."""
    issues = []
    for key, n in after.items():
        if not key.startswith(RECOMPILE_LIMIT_KEY) or n <= before.get(key, 0):
            continue
        found = re.search(r"Limit type: (\w+)", key)
        limit = found.group(1) if found else "recompile_limit"
        advice = f"raise torch._dynamo.config.{limit}, or mark the varying dimension dynamic"
        if limit == "accumulated_recompile_limit":
            advice += ("; a layer compiled as a frame of its own compiles once per layer, grad mode and shape "
                       "(docs/compile.md, 'Layers compiled as frames of their own')")
        issues.append(f"a frame hit Dynamo's {limit} and now runs eagerly, unquantized ({advice}): "
                      + key.splitlines()[0])
    return issues
