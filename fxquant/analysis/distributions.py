"""Distributions against each format's representable values: the predecessor's "HiFP8 distribution
analysis", generalised to every format in ``fxquant.formats``.

For each format the high-precision tensors are shown in the format's *element domain*: the values
themselves for element formats (HiF8, FP8), the block-scaled values ``x / 2**s`` (OCP floor rule) for
MX formats, so the limits drawn are the ones the elements actually meet. Limits, subnormal range,
representable values and, for HiF8, the 3/2/1-bit mantissa regions and the denormal range all come
from the format objects (``element.max_normal``, ``decode_table()``, ``mantissa_bits``), never from a
second table. Per format: overall density, per-layer and per-rank densities, per-layer
mean/std/min/max, a layer x rank heatmap of flushed and saturated %, and quantiles per layer.

Each scheme's tensors are shown apart (``Scope``): a report over several schemes writes every page once per
scheme, under ``distributions/<scheme>/``; a report over one scheme writes them under ``distributions/``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fxquant import formats
from fxquant.analysis import bins
from fxquant.analysis.aggregate import FLOW_KEY, Aggregator, counts_exact, format_thresholds
from fxquant.analysis import svg
from fxquant.analysis.outputs import Job, Outputs, scheme_label, slug, sort_key
from fxquant.formats.element import HiF8

SECTION = "Distributions per format"


@dataclass(frozen=True)
class Scope:
    """The tensors a distribution page shows: one scheme's high-precision tensors (its quantized copies when it
    has none). ``several``: the report holds several schemes, so files and titles name this one."""

    scheme: object
    copy: str
    several: bool = False

    @property
    def dir(self) -> str:
        return f"distributions/{slug(self.scheme)}" if self.several else "distributions"

    @property
    def tensors(self) -> str:
        """``hp tensors``, or with several schemes ``hp tensors of bf16``."""
        return f"{self.copy} tensors" + (f" of {scheme_label(self.scheme)}" if self.several else "")

    def title(self, text: str) -> str:
        """An index title, naming the scheme when there are several."""
        return f"{scheme_label(self.scheme)}: {text}" if self.several else text


def element_mag(g, name: str) -> np.ndarray | None:
    """Magnitude bins of a group's elements in format ``name``'s element domain."""
    _, _, emax = format_thresholds(name)
    if emax is not None:
        return None if g.rel is None else bins.element_domain(g.rel, emax)
    return None if g.signed is None else bins.magnitude(g.signed)


def mantissa_regions(elem) -> list[tuple[float, float, int]]:
    """(lo, hi, mantissa bits) ranges of a tapered format's normal binades, from ``elem.mantissa_bits``."""
    e = torch.arange(int(math.log2(elem.min_normal)), elem.emax + 1, dtype=torch.int32)
    m = torch.as_tensor(elem.mantissa_bits(e)).expand_as(e).tolist()
    regions: list[tuple[float, float, int]] = []
    for ei, mi in zip(e.tolist(), m):
        if regions and regions[-1][2] == mi and regions[-1][1] == 2.0**ei:
            regions[-1] = (regions[-1][0], 2.0 ** (ei + 1), mi)
        else:
            regions.append((2.0**ei, 2.0 ** (ei + 1), mi))
    return regions


def _decorate(ax, name: str) -> None:
    """Limits, subnormal range, mantissa regions and representable values of format ``name`` (log2 axis)."""
    fmt = formats.get(name)
    elem = fmt.element
    sat_t, flush_t, _ = format_thresholds(name)
    lo_x, hi_x = ax.get_xlim()
    ax.axvspan(lo_x, math.log2(flush_t), color="tab:red", alpha=0.08, label="flushed to 0")
    ax.axvspan(math.log2(sat_t), hi_x, color="tab:red", alpha=0.15, label="saturated")
    if elem.min_subnormal < elem.min_normal:
        ax.axvspan(math.log2(elem.min_subnormal), math.log2(elem.min_normal), color="tab:orange", alpha=0.12,
                   label="denormal range" if isinstance(elem, HiF8) else "subnormal range")
    if isinstance(elem, HiF8):
        colours = {3: "tab:green", 2: "tab:blue", 1: "tab:purple", 0: "tab:gray"}
        seen: set[int] = set()
        for lo, hi, m in mantissa_regions(elem):
            ax.axvspan(math.log2(lo), math.log2(hi), color=colours.get(m, "tab:gray"), alpha=0.07,
                       label=None if m in seen else f"{m}-bit mantissa")
            seen.add(m)
    for v, ls, lab in ((sat_t, "-", f"max normal {sat_t:g}"), (elem.min_normal, "--", f"min normal {elem.min_normal:g}"),
                       (elem.min_subnormal, ":", f"min subnormal {elem.min_subnormal:g}")):
        ax.axvline(math.log2(v), color="black", ls=ls, lw=0.9, label=lab)
    if elem.bits <= 8:
        table = elem.decode_table()
        pos = table[torch.isfinite(table) & (table > 0)].unique().double().log2().numpy()
        ax.rug(pos, color="black", alpha=0.6, label="representable values")
    ax.set_xlim(lo_x, hi_x)


def _thin_layers(keys: list) -> tuple[list[int], list[str]]:
    """x tick positions and labels for layers: every one up to 24, else every k-th."""
    k = max(1, -(-len(keys) // 24))
    idx = list(range(0, len(keys), k))
    return idx, ["-" if keys[i] is None else str(keys[i]) for i in idx]


def _density(mag: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log2 bin centres, fraction of all elements) over finite non-zero bins, one point per binade."""
    h = mag[1:bins.INF_BIN].astype(float)
    total = mag.sum()
    c = bins.mag_bin_centres_log2()
    n = h.size // bins.SUB * bins.SUB
    return c[:n].reshape(-1, bins.SUB).mean(axis=1), h[:n].reshape(-1, bins.SUB).sum(axis=1) / max(total, 1)


def _xrange(mags: list[np.ndarray], name: str) -> tuple[float, float]:
    sat_t, flush_t, _ = format_thresholds(name)
    lo, hi = math.log2(flush_t) - 2, math.log2(sat_t) + 2
    total = np.sum(mags, axis=0)[1:bins.INF_BIN]
    nz = np.flatnonzero(total)
    if nz.size:
        c = bins.mag_bin_centres_log2()
        lo, hi = min(lo, c[nz[0]] - 1), max(hi, c[nz[-1]] + 1)
    return lo, hi


def scopes(agg: Aggregator) -> list[Scope]:
    """One ``Scope`` per scheme of the analysed records, in scheme order."""
    by_copy = agg.groups[("scheme", "copy")]
    out, several = [], agg.several_schemes()
    for scheme in sorted({k[0] for k in by_copy}, key=sort_key):
        copy = "hp" if (scheme, "hp") in by_copy else ("quantized" if (scheme, "quantized") in by_copy else None)
        if copy is not None:
            out.append(Scope(scheme, copy, several))
    return out


def jobs(agg: Aggregator) -> list[Job]:
    """The distribution pages as report jobs: per scheme the per-layer moments (the same for every format)
    once, then per format one page per scheme."""
    names = [n for n in agg.config.formats if n != "nvfp4"]  # NVFP4: no element domain from histograms
    sc = scopes(agg)
    def prefix(s: Scope) -> str:
        return f"{slug(s.scheme)}/" if s.several else ""

    return ([Job(f"{prefix(s)}per_layer", layer_moments, (agg, s)) for s in sc]
            + [Job(f"{prefix(s)}{n}", format_page, (agg, n, s)) for n in names for s in sc])


def _groups(agg: Aggregator, by: str, scope: Scope) -> dict:
    """``by`` ("layer" or "rank") -> Group of the scope's tensors."""
    return {k[2]: g for k, g in agg.groups[("scheme", "copy", by)].items() if k[:2] == (scope.scheme, scope.copy)}


def layer_moments(agg: Aggregator, scope: Scope, out: Outputs) -> dict:
    """Per-layer mean / std / min / max of the raw values (format-independent): one figure."""
    layers = _groups(agg, "layer", scope)
    lay_keys = sorted(layers, key=sort_key)
    stats = {k: layers[k].moments.to_dict() for k in lay_keys}
    if not lay_keys:
        return stats
    fig, axes = svg.subplots(2, 2, panel=(440, 210), sharex=True,
                             title=f"Per-layer mean / std / min / max of {scope.tensors} (raw values)")
    xs = np.arange(len(lay_keys))
    labels = _thin_layers(lay_keys)
    for ax, key in zip(axes.ravel(), ("mean", "std", "min", "max")):
        ys = [stats[k][key] if stats[k][key] is not None else np.nan for k in lay_keys]
        ax.plot(xs, ys, marker="o", ms=4)
        ax.set_ylabel(f"{key} (value)")
        ax.grid()
        if key == "std" and all(np.isfinite(y) and y > 0 for y in ys) and ys:
            ax.set_yscale("log")
        ax.set_xticks(*labels)
    for ax in axes[1]:
        ax.set_xlabel("layer")
    out.figure(f"{scope.dir}/per_layer_moments.svg", fig, SECTION,
               scope.title("Per-layer mean/std/min/max (every format)"))
    return stats


def format_page(agg: Aggregator, name: str, scope: Scope, out: Outputs) -> dict:
    """One format's page of one scope: densities against its representable values, layer x rank heatmap,
    quantiles."""
    copy, tensors = scope.copy, scope.tensors
    layers = _groups(agg, "layer", scope)
    d = f"{scope.dir}/{slug(name)}"
    sec = f"{SECTION}: {name}"
    domain = "block-scaled elements x/2^s (floor)" if format_thresholds(name)[2] is not None else "values"
    whole = agg.groups[("scheme", "copy")][(scope.scheme, copy)]
    overall = element_mag(whole, name)
    info = {**({"scheme": scope.scheme} if scope.several else {}), "copy": copy, "domain": domain}
    if overall is None or overall.sum() == 0:
        return info
    ranks = _groups(agg, "rank", scope)
    lay_keys = sorted(layers, key=sort_key)
    rank_keys = sorted(ranks, key=sort_key)
    xr = _xrange([overall], name)

    fig, ax = svg.subplots(panel=(860, 320))
    fine = overall[1:bins.INF_BIN] / max(overall.sum(), 1)
    ax.plot(bins.mag_bin_centres_log2(), np.where(fine > 0, fine, np.nan), steps=True, color="tab:blue", lw=1,
            label=f"{tensors} (1/16-binade bins)")
    ax.set_yscale("log")
    ax.set_xlim(*xr)
    ax.set_xlabel(f"log2 |{domain}|")
    ax.integer_x = True  # log2 axes: whole binades
    ax.set_ylabel("fraction of elements")
    ax.set_title(f"{name}: overall density of {tensors} vs the format's representable range")
    _decorate(ax, name)
    ax.legend("outside")
    ax.grid()
    out.figure(f"{d}/overall_density.svg", fig, sec, scope.title(f"{name}: overall density vs representable values"))

    pages = [("layer", lay_keys, layers, "per_layer_density")]
    if len(rank_keys) > 1:  # one rank: its density is the overall density above
        pages.append(("rank", rank_keys, ranks, "per_rank_density"))
    for label, keys, table, fname in pages:
        fig, ax = svg.subplots(panel=(860, 320))
        cmap = svg.cmap("viridis")
        for i, k in enumerate(keys):
            m = element_mag(table[k], name)
            if m is None or m.sum() == 0:
                continue
            x, y = _density(m)
            ax.plot(x, np.where(y > 0, y, np.nan), color=cmap(i / max(len(keys) - 1, 1)), lw=1.2,
                    label=f"{label} {'-' if k is None else k}")
        ax.set_yscale("log")
        ax.set_xlim(*xr)
        ax.set_xlabel(f"log2 |{domain}|")
        ax.integer_x = True  # log2 axes: whole binades
        ax.set_ylabel("fraction of elements per binade")
        ax.set_title(f"{name}: density per {label} ({tensors})")
        _decorate(ax, name)
        ax.legend("outside", ncol=1 + len(keys) // 22)
        ax.grid()
        out.figure(f"{d}/{fname}.svg", fig, sec, scope.title(f"{name}: density per {label}"))

    _layer_rank(agg, out, name, scope, d, sec)
    quant = {str(k): bins.quantiles(layers[k].signed, agg.config.quantiles) for k in lay_keys
             if layers[k].signed is not None}
    quant["overall"] = bins.quantiles(whole.signed, agg.config.quantiles)
    sat_t, flush_t, _ = format_thresholds(name)
    sat_exact, flush_exact = counts_exact(name)
    below = _below_clamp(agg, name, scope)
    flushed = ("exact" if flush_exact else "upper bound (threshold inside a bin)") if not below else (
        f"lower bound: {below} element(s) lie where a block's E8M0 scale may be clamped at 2^-127")
    info.update({"max_normal": sat_t, "flush_threshold": flush_t, "quantiles": quant,
                 "counts": {"saturated": "exact" if sat_exact else "upper bound (max normal inside a bin)",
                            "flushed": flushed}})
    if isinstance(formats.get(name).element, HiF8):
        info["mantissa_regions"] = [{"lo": lo, "hi": hi, "mantissa_bits": m}
                                    for lo, hi, m in mantissa_regions(formats.get(name).element)]
    out.json(f"{d}/summary.json", info, sec, scope.title(f"{name}: per-layer statistics and quantiles"))
    return info


def _below_clamp(agg: Aggregator, name: str, scope: Scope) -> int:
    """The scope's elements below ``aggregate.clamp_threshold`` of MX format ``name`` (``flow_counts``' last field):
    where non-zero, its flushed counts are lower bounds."""
    si, ci = FLOW_KEY.index("scheme"), FLOW_KEY.index("copy")
    return sum(int(per[name][5]) for key, per in agg.flows.items()
               if (key[si], key[ci]) == (scope.scheme, scope.copy) and name in per and len(per[name]) > 5)


def _layer_rank(agg: Aggregator, out: Outputs, name: str, scope: Scope, d: str, sec: str) -> None:
    li, ri = FLOW_KEY.index("layer"), FLOW_KEY.index("rank")
    si, ci = FLOW_KEY.index("scheme"), FLOW_KEY.index("copy")
    cells: dict[tuple, np.ndarray] = {}
    for key, per_fmt in agg.flows.items():
        if (key[si], key[ci]) != (scope.scheme, scope.copy) or name not in per_fmt:
            continue
        k = (key[li], key[ri])
        cells[k] = per_fmt[name] + cells.get(k, 0)
    if not cells:
        return
    layers = sorted({k[0] for k in cells}, key=sort_key)
    ranks = sorted({k[1] for k in cells}, key=sort_key)
    fig, axes = svg.subplots(1, 2, panel=(max(90.0, 70.0 * len(ranks)), max(160.0, 16.0 * len(layers))),
                             title=f"{name}: layer x rank, {scope.tensors}")
    sat_exact, flush_exact = counts_exact(name)
    bound = " (upper bound)"
    flush_bound = " (lower bound)" if any(len(c) > 5 and c[5] for c in cells.values()) else (
        "" if flush_exact else bound)
    for ax, col, label in ((axes[0], 2, "flushed to zero (% of non-zero)" + flush_bound),
                           (axes[1], 3, "saturated (% of elements)" + ("" if sat_exact else bound))):
        data = np.full((len(layers), len(ranks)), np.nan)
        for (l, r), c in cells.items():
            denom = c[1] if col == 2 else c[0]
            data[layers.index(l), ranks.index(r)] = 100.0 * c[col] / denom if denom else np.nan
        ax.heatmap(data, ["-" if v is None else v for v in layers], [f"rank {r}" for r in ranks], label=label,
                   cmap="magma", vmin=0.0)
        ax.set_xlabel("rank")
        ax.set_ylabel("layer")
        ax.set_title(label)
    out.figure(f"{d}/layer_rank_heatmap.svg", fig, sec, scope.title(f"{name}: layer x rank flushed/saturated %"))
