"""Over/underflow summary across formats (txt, csv, json) and underflow by layer x direction x role.

For each format, of the high-precision tensors: *saturated* = finite elements whose magnitude after the
format's scaling exceeds its max normal; *flushed* = non-zero elements that round to zero (magnitude at
most half the smallest subnormal). Element formats are taken unscaled; MX formats after their OCP
``floor`` block scale; both are read exactly off the fixed-bin histograms (a value exactly at HiF8's
2**-23 tie counts as flushed), except where a threshold is no bin edge (MXINT8's 127/64, fp16's 65504):
there the count is an upper bound, the threshold's bin counted whole, and ``method`` says so; and except for MX
blocks whose amax lies below 2**(emax - 127), whose E8M0 scale is clamped at 2**-127: where a tensor has
elements in that range, the flushed count is a lower bound (``flushed_at_most`` adds them). NVFP4 comes
from the sampled blocks (its block scales are not powers of two): marked ``sampled``. In block formats a
block holding a NaN or an Inf quantizes to NaN: its elements are counted apart (``nonfinite_blocks``), in
``numel`` but not in ``nonzero``, flushed or saturated.

The summary counts every analysed scheme's tensors together (``by_layer_direction_role`` apart per scheme); the
underflow heatmaps are drawn per scheme: in a report over several schemes under ``overflow/<scheme>/``.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
from tabulate import tabulate

from fxquant.analysis.aggregate import FLOW_KEY, Aggregator, clamp_threshold, counts_exact, format_thresholds
from fxquant.analysis import svg
from fxquant.analysis.outputs import Outputs, fmt_num, scheme_label, slug, sort_key

SECTION = "Over/underflow across formats"


def _method(name: str, c: np.ndarray) -> str:
    if name == "nvfp4":
        return "sampled blocks"
    sat_t, flush_t, emax = format_thresholds(name)
    sat_exact, flush_exact = counts_exact(name)
    base = "floor block scale" if emax is not None else "unscaled"
    bounds = [f"{what} is an upper bound ({t:.10g} lies inside a histogram bin, counted whole)"
              for what, t, exact in (("saturated", sat_t, sat_exact), ("flushed", flush_t, flush_exact)) if not exact]
    if emax is not None and len(c) > 5 and c[5]:
        bounds.append(f"flushed is a lower bound, at most {int(c[5])} more ({int(c[5])} element(s) below "
                      f"{clamp_threshold(emax):.3g}, where a block's E8M0 scale may be clamped at 2^-127)")
    return f"{base}, {'; '.join(bounds) if bounds else 'exact'}"


def _nonfinite_blocks(name: str, c: np.ndarray) -> int | None:
    """Elements of blocks holding a NaN or an Inf; None for element formats (no blocks)."""
    return int(c[4]) if name == "nvfp4" or format_thresholds(name)[2] is not None else None


def _pct(c: np.ndarray) -> tuple[float | None, float | None]:
    return (100.0 * c[2] / c[1] if c[1] else None, 100.0 * c[3] / c[0] if c[0] else None)


def rollup(agg: Aggregator, copy: str, by: tuple[str, ...]) -> dict[tuple, dict[str, np.ndarray]]:
    idx = [FLOW_KEY.index(b) for b in by]
    ci = FLOW_KEY.index("copy")
    out: dict[tuple, dict[str, np.ndarray]] = defaultdict(dict)
    for key, per in agg.flows.items():
        if key[ci] != copy:
            continue
        k = tuple(key[i] for i in idx)
        for name, c in per.items():
            out[k][name] = c + out[k].get(name, 0)
    return out


def write(agg: Aggregator, out: Outputs, plots: bool = True) -> dict:
    copies = {k[FLOW_KEY.index("copy")] for k in agg.flows}
    copy = "hp" if "hp" in copies else ("quantized" if copies else None)
    if copy is None:
        out.text("overflow/summary.txt", "no tensors with stored values: nothing to summarise", SECTION, "Summary")
        return {}
    total = rollup(agg, copy, ())
    rows = []
    for name in agg.config.formats:
        c = total.get((), {}).get(name)
        if c is None:
            continue
        fl, sat = _pct(c)
        rows.append({"format": name, "numel": int(c[0]), "nonzero": int(c[1]), "flushed": int(c[2]),
                     "flushed_pct": fl, "saturated": int(c[3]), "saturated_pct": sat,
                     "nonfinite_blocks": _nonfinite_blocks(name, c), "method": _method(name, c),
                     **({"flushed_at_most": int(c[2] + c[5])} if len(c) > 5 and c[5] else {})})
    detail = []
    by = ("scheme", "layer", "direction", "role")
    for key, per in sorted(rollup(agg, copy, by).items(), key=lambda kv: tuple(sort_key(v) for v in kv[0])):
        for name in agg.config.formats:
            c = per.get(name)
            if c is None:
                continue
            fl, sat = _pct(c)
            detail.append({**dict(zip(by, key)), "format": name, "numel": int(c[0]), "nonzero": int(c[1]),
                           "flushed": int(c[2]), "flushed_pct": fl, "saturated": int(c[3]), "saturated_pct": sat,
                           "nonfinite_blocks": _nonfinite_blocks(name, c)})
    result = {"copy": copy, "summary": rows, "by_layer_direction_role": detail}
    out.json("overflow/summary.json", result, SECTION, "Summary (JSON)")
    head = ["format", "numel", "nonzero", "flushed", "flushed_pct", "saturated", "saturated_pct", "nonfinite_blocks",
            "method"]
    out.csv("overflow/summary.csv", head, [[r[h] for h in head] for r in rows], SECTION, "Summary (CSV)")
    dhead = [*by, "format", "numel", "nonzero", "flushed", "flushed_pct", "saturated", "saturated_pct",
             "nonfinite_blocks"]
    out.csv("overflow/by_layer_direction_role.csv", dhead, [[r[h] for h in dhead] for r in detail], SECTION,
            "Per layer x direction x role (CSV)")
    schemes = len({k[FLOW_KEY.index("scheme")] for k in agg.flows})
    together = f" of {schemes} schemes together (per scheme: by_layer_direction_role.csv)" if schemes > 1 else ""
    txt = (f"Over/underflow of {copy} tensors{together} per format (flushed % of non-zero elements, saturated % of "
           "all; block formats: nonfinite_blocks = elements of blocks holding a NaN or an Inf, NaN after quantization, "
           "which are neither flushed nor saturated nor counted as non-zero)\n\n"
           + tabulate([[r[h] if isinstance(r[h], str) else fmt_num(r[h]) for h in head] for r in rows], headers=head,
                      disable_numparse=True))
    out.text("overflow/summary.txt", txt, SECTION, "Summary (text)")
    if plots:
        _plots(agg, out, copy, rows)
    return result


def _plots(agg: Aggregator, out: Outputs, copy: str, rows: list[dict]) -> None:
    if not rows:
        return
    fig, ax = svg.subplots(panel=(max(320.0, 64.0 * len(rows)), 260))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["flushed_pct"] or 0 for r in rows], 0.4, label="flushed to zero (% of non-zero)")
    ax.bar(x + 0.2, [r["saturated_pct"] or 0 for r in rows], 0.4, label="saturated (% of elements)")
    ax.set_xticks(x, [r["format"] for r in rows], rotation=30)
    ax.set_ylabel("% of elements")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_title(f"Over/underflow of {copy} tensors per format")
    ax.legend("outside")
    ax.grid("y")
    out.figure("overflow/summary.svg", fig, SECTION, "Flushed and saturated % per format")
    by_scheme: dict[object, dict[tuple, dict[str, np.ndarray]]] = defaultdict(dict)
    for (scheme, *key), fm in rollup(agg, copy, ("scheme", "layer", "direction", "role")).items():
        by_scheme[scheme][tuple(key)] = fm
    several = agg.several_schemes()
    for scheme in sorted(by_scheme, key=sort_key):
        per = by_scheme[scheme]
        d = f"overflow/{slug(scheme)}" if several else "overflow"
        of = f" ({scheme_label(scheme)})" if several else ""
        layers = sorted({k[0] for k in per}, key=sort_key)
        cols = sorted({(k[1], k[2]) for k in per}, key=lambda c: tuple(sort_key(v) for v in c))
        for r in rows:
            name = r["format"]
            data = np.full((len(layers), len(cols)), np.nan)
            for (layer, direction, role), fm in per.items():
                c = fm.get(name)
                if c is not None and c[1]:
                    data[layers.index(layer), cols.index((direction, role))] = 100.0 * c[2] / c[1]
            if np.isnan(data).all():
                continue
            fig, ax = svg.subplots(panel=(max(160.0, 60.0 * len(cols)), max(140.0, 16.0 * len(layers))))
            ax.heatmap(data, ["-" if v is None else v for v in layers], [f"{dr}/{ro}" for dr, ro in cols],
                       label="flushed to zero (% of non-zero)", cmap="magma", vmin=0.0)
            ax.set_xlabel("direction / role")
            ax.set_ylabel("layer")
            ax.set_title(f"{name}{of}: underflow by layer x direction x role")
            title = f"{name}: underflow by layer x direction x role"
            out.figure(f"{d}/underflow_{slug(name)}.svg", fig, SECTION,
                       f"{scheme_label(scheme)}: {title}" if several else title)
