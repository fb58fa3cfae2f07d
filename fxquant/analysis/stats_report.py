"""Global statistics (JSON + tabulate text), exponent (binade) histograms, and cross-scheme comparisons.

Statistics per scheme, quant type (format of a quantized copy; "-" for high-precision tensors), layer,
rank, component, module kind, role, direction (forward/backward), phase and copy, each with quantiles
from the fixed-bin sketch (bins.py: exact in rank, within 6.25 % in value for normal float32 magnitudes,
within 2**-130 absolute for subnormals), over the stored elements (``quantile_coverage``).
"""
from __future__ import annotations

import numpy as np
from tabulate import tabulate

from fxquant.analysis import bins, svg
from fxquant.analysis.aggregate import COMPARE_GROUPING, STAT_GROUPINGS, Aggregator
from fxquant.analysis.outputs import Outputs, fmt_num, slug, sort_key

SECTION = "Global statistics"
QUANTILE_ACCURACY = ("exact in rank and within one histogram bin in value: relative error <= 6.25% for normal "
                     "float32 magnitudes (>= 2**-126); float32 subnormals share 16 bins of equal width 2**-130, "
                     "so below 2**-126 the error is up to 2**-130 absolute (any relative error)")
QUANTILE_COVERAGE = ("over the histogram_numel elements of stored tensors: the moments (numel, min, max, mean, "
                     "std, amax) cover whole tensors, capture-time statistics included, while a record stored "
                     "as sampled rows adds only those rows to the histogram (sampled_tensors counts them) and a "
                     "statistics-only record adds none")


def group_stats(agg: Aggregator, grouping: tuple[str, ...]) -> list[dict]:
    rows = []
    for key in sorted(agg.groups[grouping], key=lambda k: tuple(sort_key(v) for v in k)):
        g = agg.groups[grouping][key]
        d = {"group": dict(zip(grouping, key)), **g.moments.to_dict()}
        d["quantiles"] = bins.quantiles(g.signed, agg.config.quantiles) if g.signed is not None else None
        d["histogram_numel"] = int(g.signed.sum()) if g.signed is not None else 0
        d["sampled_tensors"] = g.sampled
        rows.append(d)
    return rows


def write(agg: Aggregator, out: Outputs, plots: bool = True) -> dict:
    result = {"/".join(g) or "overall": group_stats(agg, g) for g in STAT_GROUPINGS}
    out.json("stats/global_stats.json", {"groupings": result, "quantile_accuracy": QUANTILE_ACCURACY,
                                         "quantile_coverage": QUANTILE_COVERAGE},
             SECTION, "Global statistics (JSON)")
    qs = agg.config.quantiles
    show_q = [q for q in qs if q in (0.01, 0.5, 0.99)] or list(qs[:3])
    parts = []
    for grouping in STAT_GROUPINGS:
        name = "/".join(grouping) or "overall"
        rows = []
        for d in result[name]:
            label = "/".join("-" if v is None else str(v) for v in d["group"].values()) or "all"
            qd = d["quantiles"] or {}
            mark = "*" if d["sampled_tensors"] else ""
            rows.append([label, d["tensors"], d["numel"], d["nan"], d["inf"], fmt_num(d["zero_fraction"]),
                         fmt_num(d["min"]), fmt_num(d["max"]), fmt_num(d["mean"]), fmt_num(d["std"]),
                         fmt_num(d["amax"]), d["histogram_numel"],
                         *[fmt_num(qd.get(f"q{q:g}")) + mark for q in show_q]])
        parts.append(f"== by {name} ==\n" + tabulate(
            rows, headers=[name, "tensors", "numel", "nan", "inf", "zero frac", "min", "max", "mean", "std", "amax",
                           "hist numel", *[f"q{q:g}" for q in show_q]], disable_numparse=True))
    if any(d["sampled_tensors"] for rows in result.values() for d in rows):
        parts.append("* quantiles over stored sampled rows (see quantile_coverage in global_stats.json)")
    parts.append(f"quantiles: {QUANTILE_ACCURACY}; {QUANTILE_COVERAGE}")
    out.text("stats/global_stats.txt", "\n\n".join(parts), SECTION, "Global statistics (text)")
    if plots:
        _binade_plots(agg, out)
        _compare(agg, out)
    return result


def _binade_plots(agg: Aggregator, out: Outputs) -> None:
    for grouping, title in ((("direction",), "forward vs backward"), (("role",), "tensor role")):
        table = {k: g for k, g in agg.groups[grouping].items() if g.binade is not None and g.binade.sum()}
        if not table:
            continue
        fig, ax = svg.subplots(panel=(620, 300))
        exps = np.arange(bins.NBINADE) - 127
        for key in sorted(table, key=lambda k: tuple(sort_key(v) for v in k)):
            h = table[key].binade[1:255].astype(float)  # normal binades; zero/subnormal and Inf/NaN apart
            if h.sum() == 0:
                continue
            ax.plot(exps[1:255], np.where(h > 0, 100 * h / table[key].binade.sum(), np.nan), steps=True, label=str(key[0]))
        _tight_xlim(ax, [g.binade for g in table.values()])
        ax.set_yscale("log")
        ax.set_xlabel("binary exponent floor(log2|x|)")
        ax.integer_x = True  # log2 axes: whole binades
        ax.set_ylabel("% of elements")
        ax.set_title(f"Exponent (binade) histogram by {title}")
        ax.legend("outside")
        ax.grid()
        out.figure(f"stats/binades_by_{grouping[0]}.svg", fig, SECTION, f"Exponent histogram by {title}")


def _tight_xlim(ax, hists) -> None:
    total = np.sum([h for h in hists], axis=0)
    nz = np.flatnonzero(total[1:255])
    if nz.size:
        ax.set_xlim(nz[0] + 1 - 127 - 1, nz[-1] + 1 - 127 + 1)


def _compare(agg: Aggregator, out: Outputs) -> None:
    """Per (component, role, copy): the log2|x| density of each scheme's run, overlaid."""
    table = agg.groups[COMPARE_GROUPING]
    schemes = sorted({k[0] for k in table}, key=sort_key)
    if len(schemes) < 2:
        return
    sites = sorted({k[1:] for k in table}, key=lambda k: tuple(sort_key(v) for v in k))
    centres = bins.mag_bin_centres_log2()
    rows = []
    for copy, comp, role in sites:
        fig, ax = svg.subplots(panel=(560, 280))
        drawn = 0
        for sch in schemes:
            g = table.get((sch, copy, comp, role))
            if g is None:
                continue
            st = g.moments.to_dict()
            rows.append([sch, comp, role, copy, st["tensors"], fmt_num(st["mean"]), fmt_num(st["std"]),
                         fmt_num(st["amax"]), fmt_num(st["zero_fraction"])])
            if g.signed is None:
                continue
            mag = bins.magnitude(g.signed)[1:bins.INF_BIN].astype(float)
            if mag.sum() == 0:
                continue
            ax.plot(_coarse(centres), _coarse_sum(mag) / mag.sum(), label=str(sch))
            drawn += 1
        if not drawn:
            continue
        ax.set_xlabel("log2 |x|")
        ax.integer_x = True  # log2 axes: whole binades
        ax.set_ylabel("fraction of non-zero elements per binade")
        ax.set_title(f"{comp} {role} ({copy}) across schemes")
        ax.legend("outside")
        ax.grid()
        _focus(ax, [table[k].signed for k in table if k[1:] == (copy, comp, role) and table[k].signed is not None])
        out.figure(f"compare/{slug(f'{comp}_{role}_{copy}')}.svg", fig, "Comparison across schemes",
                   f"{comp} {role} ({copy})")
    out.text("compare/schemes.txt", tabulate(rows, headers=["scheme", "component", "role", "copy", "tensors", "mean",
                                                            "std", "amax", "zero frac"], disable_numparse=True),
             "Comparison across schemes", "Statistics per scheme and site")


def _coarse(centres: np.ndarray) -> np.ndarray:
    """One point per binade (the mean of its 16 bin centres' log2)."""
    n = centres.size // bins.SUB * bins.SUB
    return centres[:n].reshape(-1, bins.SUB).mean(axis=1)


def _coarse_sum(h: np.ndarray) -> np.ndarray:
    n = h.size // bins.SUB * bins.SUB
    return h[:n].reshape(-1, bins.SUB).sum(axis=1)


def _focus(ax, signed_hists) -> None:
    if not signed_hists:
        return
    mag = np.sum([bins.magnitude(h) for h in signed_hists], axis=0)[1:bins.INF_BIN]
    nz = np.flatnonzero(mag)
    if nz.size:
        c = bins.mag_bin_centres_log2()
        ax.set_xlim(c[nz[0]] - 1, c[nz[-1]] + 1)
