"""Quantization error per site: every quantized GEMM operand against its high-precision value.

One row per captured quantized copy: SQNR (dB), MSE, cosine similarity and max |error| computed from the
two stored tensors (``source = tensors``), or the capture-time statistics when the high-precision
partner was not stored (``source = manifest``: no max error); saturated % and flushed % after the
format's block scaling. Each row also carries the sums of squares of the error and of the reference
(``err_sq``, ``ref_sq``; from the tensors, or implied by the capture-time MSE and SQNR). Aggregates per
(scheme, format, role, gemm) and heatmaps over layer x role pool the sites' SQNR,
``10 log10(sum ref_sq / sum err_sq)``: a lossless site (SQNR inf) adds its energy and no error, rather than
being left out of a mean; ``lossless_sites`` counts those.
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
from tabulate import tabulate

from fxquant.analysis.aggregate import Aggregator
from fxquant.analysis import svg
from fxquant.analysis.outputs import Outputs, fmt_num, slug, sort_key

SECTION = "Quantization error"
COLUMNS = ("scheme", "format", "component", "module", "layer", "role", "gemm", "direction", "rank", "iteration",
           "micro_batch", "sqnr_db", "mse", "cosine", "max_err", "saturated_pct", "flushed_pct", "source")
METRICS = (("sqnr_db", "SQNR (dB)", "viridis"), ("saturated_pct", "saturated (%)", "magma"),
           ("flushed_pct", "flushed to zero (%)", "magma"))


def _mean(vals: list) -> float | None:
    v = [x for x in vals if isinstance(x, (int, float)) and not math.isnan(x)]
    if not v:
        return None
    return math.inf if any(math.isinf(x) for x in v) and all(math.isinf(x) for x in v) else \
        sum(x for x in v if not math.isinf(x)) / max(1, sum(1 for x in v if not math.isinf(x)))


def pooled_sqnr(sites: list[dict]) -> float | None:
    """10 log10(sum ref_sq / sum err_sq) over the sites that carry both sums (inf when no site has an error;
    None without a site or without reference energy)."""
    pairs = [(s["ref_sq"], s["err_sq"]) for s in sites
             if isinstance(s.get("ref_sq"), (int, float)) and isinstance(s.get("err_sq"), (int, float))]
    r2, e2 = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    if not pairs or not r2 > 0:
        return None
    return 10 * math.log10(r2 / e2) if e2 > 0 else math.inf


def summary_rows(sites: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for s in sites:
        groups[(s["scheme"], s["format"], s["component"], s["role"], s["gemm"])].append(s)
    rows = []
    for key in sorted(groups, key=lambda k: tuple(sort_key(v) for v in k)):
        g = groups[key]
        maxes = [s["max_err"] for s in g if s.get("max_err") is not None]
        rows.append({"scheme": key[0], "format": key[1], "component": key[2], "role": key[3], "gemm": key[4],
                     "operands": len(g), "sqnr_db_pooled": pooled_sqnr(g),
                     "lossless_sites": sum(1 for s in g if s["sqnr_db"] == math.inf),
                     "sqnr_db_min": min((s["sqnr_db"] for s in g if s["sqnr_db"] is not None), default=None),
                     "mse_mean": _mean([s["mse"] for s in g]), "cosine_mean": _mean([s["cosine"] for s in g]),
                     "max_err": max(maxes) if maxes else None,
                     "saturated_pct_mean": _mean([s["saturated_pct"] for s in g]),
                     "flushed_pct_mean": _mean([s["flushed_pct"] for s in g])})
    return rows


def write(agg: Aggregator, out: Outputs, plots: bool = True) -> dict:
    sites = sorted(agg.sites, key=lambda s: tuple(sort_key(s.get(k)) for k in
                                                 ("scheme", "rank", "iteration", "micro_batch", "layer", "module",
                                                  "role", "gemm", "seq")))
    summary = summary_rows(sites)
    out.json("quant_error/sites.json", {"sites": sites, "summary": summary}, SECTION, "Per-site errors (JSON)")
    out.csv("quant_error/sites.csv", list(COLUMNS), [[s.get(c) for c in COLUMNS] for s in sites], SECTION,
            "Per-site errors (CSV)")
    heads = list(summary[0]) if summary else ["scheme", "format", "role", "gemm", "operands"]
    text = tabulate([[fmt_num(r[h]) if not isinstance(r[h], str) else r[h] for h in heads] for r in summary],
                    headers=heads, disable_numparse=True)
    if not sites:
        text = "no quantized GEMM operand copies in the selected records (capture them with copy: quantized)"
    out.text("quant_error/summary.txt", text, SECTION, "Error summary per scheme, format, role and GEMM")
    if plots:
        _heatmaps(sites, out)
    return {"sites": len(sites), "summary": summary}


def _heatmaps(sites: list[dict], out: Outputs) -> None:
    if not sites:
        return
    for scheme in sorted({s["scheme"] for s in sites}, key=sort_key):
        mine = [s for s in sites if s["scheme"] == scheme]
        layers = sorted({s["layer"] for s in mine}, key=sort_key)
        roles = sorted({f"{s['role']}/{s['gemm']}" if s.get("gemm") else s["role"] for s in mine}, key=sort_key)
        for metric, label, cmap in METRICS:
            cells: dict[tuple, list] = defaultdict(list)
            for s in mine:
                role = f"{s['role']}/{s['gemm']}" if s.get("gemm") else s["role"]
                if s.get(metric) is not None:
                    cells[(s["layer"], role)].append(s)
            if not cells:
                continue
            data = np.full((len(layers), len(roles)), np.nan)
            for (layer, role), cell in cells.items():
                if metric == "sqnr_db":  # pooled as in the summary; lossless cells drawn at 200 dB
                    v = pooled_sqnr(cell)
                    v = np.nan if v is None else min(v, 200.0)
                else:
                    v = float(np.mean([s[metric] for s in cell]))
                data[layers.index(layer), roles.index(role)] = v
            fig, ax = svg.subplots(panel=(max(200.0, 64.0 * len(roles)), max(160.0, 16.0 * len(layers))))
            ax.heatmap(data, ["-" if v is None else v for v in layers], roles, label=label, cmap=cmap,
                       vmin=None if metric == "sqnr_db" else 0.0)
            ax.set_xlabel("operand role / GEMM")
            ax.set_ylabel("layer")
            how = "pooled over captures (lossless: 200 dB)" if metric == "sqnr_db" else "mean over captures"
            ax.set_title(f"{label} of quantized operands\nscheme {scheme}, {how}")
            out.figure(f"quant_error/heatmap_{metric}_{slug(scheme)}.svg", fig, SECTION,
                       f"{label}: layer x role, scheme {scheme}")
