"""Per-layer / per-rank / per-tensor-type pages (the predecessor's ``layer_{L}_rank_{R}_{type}_analysis``).

For every (layer, rank) of the analysed records one figure overlays the exponent (binade) histograms of each
tensor type there (component, direction, role, and for quantized copies their format), and one table lists
each type's moments: tensors, elements, NaN/Inf, zero fraction, min, max, mean, std, amax; for every tensor
type one figure follows it across layers (amax and std per layer, one line per rank). Files:
``layers/layer_{L}_rank_{R}_analysis.svg`` (L = ``X`` for records without a layer),
``layers/type_{component}_{direction}_{role}[_quantized_{format}].svg`` and ``layers/layers.{csv,txt}`` (every layer,
rank and type). The numbers come from the same merged moments and
histograms as the global statistics (aggregate.LAYER_PAGE_GROUPING).

Each scheme's tensors are shown apart: in a report over several schemes the figures of scheme S go under
``layers/<S>/``, the tables gain a leading ``scheme`` column and the titles name the scheme.
"""
from __future__ import annotations

import numpy as np
from tabulate import tabulate

from fxquant.analysis import bins, svg
from fxquant.analysis.aggregate import LAYER_PAGE_GROUPING, Aggregator
from fxquant.analysis.distributions import _thin_layers
from fxquant.analysis.outputs import Outputs, fmt_num, scheme_label, slug, sort_key

SECTION = "Per layer and rank"
STATS = ("tensors", "numel", "nan", "inf", "zero_fraction", "min", "max", "mean", "std", "amax")


def type_label(key: dict) -> str:
    """``attention forward query``, ``linear backward grad_output [quantized mxfp8_e5m2]``."""
    label = f"{key['component']} {key['direction']} {key['role']}"
    return label + (f" [quantized {key['format']}]" if key.get("copy") == "quantized" else "")


def pages(agg: Aggregator) -> dict[tuple, list[tuple[dict, object]]]:
    """(scheme, layer, rank) -> [(type key, Group)], types in a fixed order."""
    out: dict[tuple, list] = {}
    table = agg.groups[LAYER_PAGE_GROUPING]
    for k in sorted(table, key=lambda k: tuple(sort_key(v) for v in k)):
        key = dict(zip(LAYER_PAGE_GROUPING, k))
        out.setdefault((key["scheme"], key["layer"], key["rank"]), []).append((key, table[k]))
    return out


def write(agg: Aggregator, out: Outputs, plots: bool = True) -> dict:
    by_page = pages(agg)
    several = agg.several_schemes()
    lead = 1 if several else 0  # the scheme column, with several schemes only
    rows = []
    for (scheme, layer, rank), types in by_page.items():
        for key, g in types:
            st = g.moments.to_dict()
            rows.append([*([scheme] if several else []), layer, rank, type_label(key), *[st[c] for c in STATS]])
    if not rows:
        return {}
    header = [*(["scheme"] if several else []), "layer", "rank", "tensor type", *STATS]
    out.csv("layers/layers.csv", header, rows, SECTION, "Every layer, rank and tensor type (CSV)")
    out.text("layers/layers.txt", tabulate([[("-" if v is None else v) if i < lead + 3 else fmt_num(v)
                                             for i, v in enumerate(r)] for r in rows], headers=header,
                                           disable_numparse=True),
             SECTION, "Every layer, rank and tensor type (table)")
    if plots:
        def place(scheme) -> tuple[str, str, str | None]:
            """(directory, index title prefix, figure title scheme) of one scheme's figures."""
            if not several:
                return "layers", "", None
            return f"layers/{slug(scheme)}", f"{scheme_label(scheme)}: ", scheme_label(scheme)

        for (scheme, layer, rank), types in by_page.items():
            d, prefix, named = place(scheme)
            fig = _figure(layer, rank, types, named)
            if fig is not None:
                out.figure(f"{d}/layer_{'X' if layer is None else layer}_rank_{rank}_analysis.svg", fig, SECTION,
                           f"{prefix}layer {'-' if layer is None else layer}, rank {rank}")
        for (scheme, label), per in _by_type(by_page).items():
            d, prefix, named = place(scheme)
            fig = _type_figure(label, per, named)
            if fig is not None:
                name = slug("_".join(label.replace("[", " ").replace("]", " ").split()))
                out.figure(f"{d}/type_{name}.svg", fig, SECTION, f"{prefix}{label} across layers")
    return {"/".join(map(str, page if several else page[1:])): [type_label(k) for k, _ in types]
            for page, types in by_page.items()}


def _by_type(by_page: dict) -> dict[tuple, dict[int, list[tuple[object, dict]]]]:
    """(scheme, type label) -> rank -> [(layer, moments)] in layer order (records without a layer left out)."""
    out: dict[tuple, dict] = {}
    for (scheme, layer, rank), types in by_page.items():
        if layer is None:
            continue
        for key, g in types:
            out.setdefault((scheme, type_label(key)), {}).setdefault(rank, []).append((layer, g.moments.to_dict()))
    return out


def _type_figure(label: str, per_rank: dict, scheme: str | None = None) -> svg.Figure | None:
    layers = sorted({layer for rows in per_rank.values() for layer, _ in rows}, key=sort_key)
    if not layers:
        return None
    pos = {layer: i for i, layer in enumerate(layers)}
    title = f"{label}{f' ({scheme})' if scheme else ''}: per layer, one line per rank"
    fig, axes = svg.subplots(1, 2, panel=(380, 240), title=title)
    for ax, stat in zip(axes, ("amax", "std")):
        positive = False
        for rank in sorted(per_rank, key=sort_key):
            rows = per_rank[rank]
            ys = [np.nan if st[stat] is None or st[stat] <= 0 else st[stat] for _, st in rows]
            positive |= any(np.isfinite(y) for y in ys)
            ax.plot([pos[layer] for layer, _ in rows], ys, marker="o", ms=3, label=f"rank {rank}")
        if positive:
            ax.set_yscale("log")
        ax.set_xticks(*_thin_layers(layers))
        ax.set_xlabel("layer")
        ax.set_ylabel(stat)
        ax.grid()
    if len(per_rank) > 1:
        axes[1].legend("outside")
    return fig


def _figure(layer, rank, types, scheme: str | None = None) -> svg.Figure | None:
    exps = np.arange(bins.NBINADE) - 127
    fig, ax = svg.subplots(panel=(620, 300))
    drawn, hists = 0, []
    for key, g in types:
        if g.binade is None or g.binade.sum() == 0:
            continue
        h = g.binade[1:255].astype(float)  # normal binades; zero/subnormal and Inf/NaN apart
        if h.sum() == 0:
            continue
        hists.append(g.binade)
        ax.plot(exps[1:255], np.where(h > 0, 100 * h / g.binade.sum(), np.nan), steps=True, label=type_label(key),
                ls="--" if key["direction"] == "backward" else "-")
        drawn += 1
    if not drawn:
        return None
    nz = np.flatnonzero(np.sum(hists, axis=0)[1:255])
    ax.set_xlim(nz[0] - 127, nz[-1] + 2 - 127)
    ax.set_yscale("log")
    ax.integer_x = True
    ax.set_xlabel("binary exponent floor(log2|x|)")
    ax.set_ylabel("% of elements")
    ax.set_title(f"Layer {'-' if layer is None else layer}, rank {rank}{f' ({scheme})' if scheme else ''}: "
                 "every tensor type (solid forward, dashed backward)")
    ax.legend("outside")
    ax.grid()
    return fig
