"""Writing the MX scaling study (mx_study.py): tables (json, csv, txt), a recommendation, and SQNR plots."""
from __future__ import annotations

import dataclasses

import numpy as np
from tabulate import tabulate

from fxquant.analysis import mx_study, svg
from fxquant.analysis.aggregate import Aggregator
from fxquant.analysis.outputs import Outputs, fmt_num, slug, sort_key

SECTION = "MX scaling study"
COLUMNS = [f.name for f in dataclasses.fields(mx_study.StudyRow)]


def rows_of(agg: Aggregator) -> list[mx_study.StudyRow]:
    rows = [mx_study.metrics(fmt, mode, k, grp, sums, agg.study_peak.get((fmt, grp), 0.0))
            for (fmt, mode, k, grp), sums in agg.study.items()]
    order = {m.value: i for i, m in enumerate(mx_study.MODES)}
    return sorted(rows, key=lambda r: (r.format, r.group != "all", r.group, order[r.scale_mode], r.offset))


def write(agg: Aggregator, out: Outputs, plots: bool = True, sample_blocks: int = 128) -> dict:
    rows = rows_of(agg)
    if not rows:
        why = ("the MX study is turned off (--sample-blocks 0)" if sample_blocks == 0 else
               "no high-precision GEMM operands with stored values: no MX study")
        out.text("mx_study/study.txt", why, SECTION, "Study (text)")
        return {}
    best = mx_study.recommend(rows)
    rec = {f"{f}/{g}": {"scale_mode": r.scale_mode, "offset": r.offset, "sqnr_db": r.sqnr_db,
                        "floor_offset0_sqnr_db": next((x.sqnr_db for x in rows if (x.format, x.group, x.scale_mode,
                                                                                   x.offset) == (f, g, "floor", 0)), None)}
           for (f, g), r in sorted(best.items())}
    out.json("mx_study/study.json", {"rows": [dataclasses.asdict(r) for r in rows], "recommendation": rec,
                                     "note": "offset k: shared exponent s = s_mode + k (larger k: coarser scale, "
                                             "fewer saturations, more flushes)"}, SECTION, "Study (JSON)")
    out.csv("mx_study/study.csv", COLUMNS, [[getattr(r, c) for c in COLUMNS] for r in rows], SECTION, "Study (CSV)")
    head = ["format", "group", "scale_mode", "offset", "sqnr_db", "mse", "cosine", "max_err", "saturated_pct",
            "flushed_pct"]
    main = [r for r in rows if r.group == "all"]
    lines = ["Recommendation (highest SQNR; ties prefer floor, then the smallest |offset|):"]
    for (f, g), r in sorted(best.items()):
        if g == "all":
            lines.append(f"  {f}: scale_mode={r.scale_mode}, offset={r.offset:+d} "
                         f"(SQNR {fmt_num(r.sqnr_db)} dB vs floor/0 {fmt_num(rec[f'{f}/{g}']['floor_offset0_sqnr_db'])} dB)")
    lines.append("")
    lines.append(tabulate([[fmt_num(getattr(r, h)) if not isinstance(getattr(r, h), str) else getattr(r, h)
                            for h in head] for r in main], headers=head, disable_numparse=True))
    per_role = sorted(((f, g), r) for (f, g), r in best.items() if g != "all")
    if per_role:
        lines += ["", "Best per group:", tabulate([[f, g, r.scale_mode, r.offset, fmt_num(r.sqnr_db)]
                                                  for (f, g), r in per_role],
                                                 headers=["format", "group", "scale_mode", "offset", "sqnr_db"],
                                                 disable_numparse=True)]
    out.text("mx_study/study.txt", "\n".join(lines), SECTION, "Study and recommendation (text)")
    if plots:
        _plots(main, out)
    return {"recommendation": rec, "rows": len(rows)}


def _plots(rows: list[mx_study.StudyRow], out: Outputs) -> None:
    for fmt in sorted({r.format for r in rows}):
        mine = [r for r in rows if r.format == fmt]
        offsets = sorted({r.offset for r in mine})
        fig, axes = svg.subplots(1, 2, panel=(340, 250))
        for mode in mx_study.MODES:
            pts = {r.offset: r for r in mine if r.scale_mode == mode.value}
            ys = [pts[k].sqnr_db if k in pts and pts[k].sqnr_db is not None else np.nan for k in offsets]
            colour = svg.TAB10[list(mx_study.MODES).index(mode) % len(svg.TAB10)]
            axes[0].plot(offsets, np.minimum(ys, 200), color=colour, marker="o", label=mode.value)
            sat = [pts[k].saturated_pct if k in pts else np.nan for k in offsets]
            fl = [pts[k].flushed_pct if k in pts else np.nan for k in offsets]
            axes[1].plot(offsets, sat, color=colour, marker="o", label=f"{mode.value} saturated")
            axes[1].plot(offsets, fl, color=colour, ls="--", marker="x", label=f"{mode.value} flushed")
        axes[0].set_xlabel("shared-exponent offset k (s = s_mode + k)")
        axes[0].set_ylabel("SQNR (dB)")
        axes[0].set_title(f"{fmt}: SQNR per scale rule and offset")
        axes[1].set_xlabel("shared-exponent offset k")
        axes[1].set_ylabel("% of elements")
        axes[1].set_yscale("symlog", linthresh=1e-3)
        axes[1].set_title("saturated % / flushed % (of non-zero)")
        for ax in axes:
            ax.set_xticks(offsets)
            ax.grid()
            ax.legend("outside")
        out.figure(f"mx_study/{slug(fmt)}.svg", fig, SECTION, f"{fmt}: SQNR, saturation and flushes per scale rule")


def study_table(rows: list[mx_study.StudyRow]) -> str:
    head = ["format", "group", "scale_mode", "offset", "sqnr_db", "mse", "cosine", "saturated_pct", "flushed_pct"]
    return tabulate([[fmt_num(getattr(r, h)) if not isinstance(getattr(r, h), str) else getattr(r, h) for h in head]
                     for r in sorted(rows, key=lambda r: tuple(sort_key(getattr(r, h)) for h in head[:4]))],
                    headers=head, disable_numparse=True)
