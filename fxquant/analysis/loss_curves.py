"""Training runs: loss curves across schemes and the mean relative error against the bf16 run.

Reads the metrics JSONL written by ``fxquant.megatron_glue.train`` (one record per iteration: iteration,
loss, lr, grad_norm, skipped, step_time_s, tokens_per_s). A run is a ``metrics.jsonl`` file or a run
directory holding one; its label is the ``scheme`` of the ``run_config.json`` beside it, else the
directory name. Mean relative error ``mean(|loss - loss_ref| / |loss_ref|)`` is taken over the
iterations both runs logged (all of them, and the last N of those).
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tabulate import tabulate

from fxquant.analysis import svg
from fxquant.analysis.outputs import Outputs, fmt_num

log = logging.getLogger(__name__)
SECTION = "Training runs"
SERIES = (("loss", "loss"), ("grad_norm", "grad norm"), ("tokens_per_s", "tokens / s"), ("step_time_s", "step time (s)"))


@dataclass(frozen=True)
class Run:
    label: str
    path: Path
    records: tuple[dict, ...]

    def series(self, key: str) -> dict[int, float]:
        return {int(r["iteration"]): float(r[key]) for r in self.records
                if r.get(key) is not None and isinstance(r.get(key), (int, float))}


def load_run(path: str | Path, label: str | None = None) -> Run:
    p = Path(path)
    f = p / "metrics.jsonl" if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"no metrics JSONL at {f} (pass a metrics.jsonl file or a run directory)")
    records, bad = [], 0
    for i, line in enumerate(f.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(r, dict) and "iteration" in r and "loss" in r:
            records.append(r)
    if bad:
        log.warning("%s: %d line(s) are not JSON and were skipped", f, bad)
    if label is None:
        cfg = f.parent / "run_config.json"
        try:
            label = json.loads(cfg.read_text()).get("scheme") if cfg.is_file() else None
        except json.JSONDecodeError:
            label = None
        label = label or f.parent.name
    return Run(str(label), f, tuple(records))


def mean_relative_error(run: Run, ref: Run, last_n: int | None = None) -> float | None:
    a, b = run.series("loss"), ref.series("loss")
    its = sorted(i for i in a.keys() & b.keys() if b[i] != 0 and math.isfinite(a[i]) and math.isfinite(b[i]))
    if last_n is not None:
        its = its[-last_n:]
    if not its:
        return None
    return float(np.mean([abs(a[i] - b[i]) / abs(b[i]) for i in its]))


def compare(runs: list[Run], reference: str = "bf16", last_n: int = 10) -> list[dict]:
    ref = next((r for r in runs if r.label == reference), None)
    rows = []
    for r in runs:
        loss = r.series("loss")
        final = loss[max(loss)] if loss else None
        rows.append({"run": r.label, "path": str(r.path), "iterations": len(loss), "final_loss": final,
                     "mre_all": None if ref is None or r is ref else mean_relative_error(r, ref),
                     f"mre_last_{last_n}": None if ref is None or r is ref else mean_relative_error(r, ref, last_n)})
    return rows


def write(runs: list[Run], out: Outputs, reference: str = "bf16", last_n: int = 10, plots: bool = True) -> dict:
    rows = compare(runs, reference, last_n)
    has_ref = any(r.label == reference for r in runs)
    out.json("training/loss_vs_reference.json", {"reference": reference if has_ref else None, "last_n": last_n,
                                                  "runs": rows}, SECTION, "Loss vs reference (JSON)")
    head = list(rows[0]) if rows else ["run"]
    txt = tabulate([[fmt_num(r[h]) if not isinstance(r[h], str) else r[h] for h in head if h != "path"] for r in rows],
                   headers=[h for h in head if h != "path"], disable_numparse=True)
    if not has_ref:
        txt = f"no run labelled {reference!r}: relative errors not computed\n\n" + txt
    out.text("training/loss_vs_reference.txt", txt, SECTION, f"Mean relative error vs {reference} (text)")
    if not runs or not plots:
        return {"runs": rows}
    fig, axes = svg.subplots(2, 2, panel=(400, 230), title="Training runs across schemes")
    for ax, (key, label) in zip(axes.ravel(), SERIES):
        for k, r in enumerate(runs):
            s = r.series(key)
            if s:
                its = sorted(s)
                ax.plot(its, [s[i] for i in its], color=svg.TAB10[k % len(svg.TAB10)], label=r.label,
                        lw=2.2 if r.label == reference else 1.3)
        ax.set_xlabel("iteration")
        ax.integer_x = True
        ax.set_ylabel(label)
        ax.set_title(label)
        ax.grid()
        if key in ("loss", "grad_norm"):
            vals = [v for r in runs for v in r.series(key).values() if v > 0]
            if vals and max(vals) / min(vals) > 20:
                ax.set_yscale("log")
    axes[0, 1].legend("outside")
    out.figure("training/curves.svg", fig, SECTION, "Loss, grad norm, throughput and step time")
    ref = next((r for r in runs if r.label == reference), None)
    if ref is not None and len(runs) > 1:
        fig, ax = svg.subplots(panel=(620, 260))
        b = ref.series("loss")
        for k, r in enumerate(runs):
            if r is ref:
                continue
            a = r.series("loss")
            its = sorted(i for i in a.keys() & b.keys() if b[i] != 0)
            ax.plot(its, [100 * abs(a[i] - b[i]) / abs(b[i]) for i in its], color=svg.TAB10[k % len(svg.TAB10)],
                    label=r.label)
        ax.set_xlabel("iteration")
        ax.set_ylabel(f"|loss - loss_{reference}| / loss_{reference} (%)")
        ax.set_title(f"Relative loss error against the {reference} run")
        ax.integer_x = True
        ax.grid()
        ax.legend("outside")
        out.figure("training/relative_error.svg", fig, SECTION, f"Relative loss error vs {reference}")
    return {"runs": rows}
