"""Training runs: loss curves across schemes and the mean relative error against the bf16 run.

Reads the metrics JSONL written by ``fxquant.megatron_glue.train`` (one record per iteration: iteration,
loss, lr, grad_norm, skipped, step_time_s, tokens_per_s). A run is a ``metrics.jsonl`` file or a run
directory holding one; its label is the ``scheme`` of the ``run_config.json`` beside it, else the
directory name. Runs that would share a label (one scheme on two models) are labelled
``<model>/<dataset>/<scheme>`` from their ``run_config.json``, else by their directory (``unique_labels``).
Each run is compared with the reference run (label or scheme ``reference``) of its own model and dataset;
a run with no such reference is not compared, and ``problems`` says so. Mean relative error
``mean(|loss - loss_ref| / |loss_ref|)`` is taken over the iterations both runs logged (all of them, and
the last N of those), except where the reference's loss is zero or not finite; a run whose loss is NaN or
Inf where the reference's is finite (a diverged run) gets ``inf``, and ``nonfinite_loss`` counts those
iterations (``loss_error``).
"""
from __future__ import annotations

import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, replace
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
    label: str  # unique among the runs of one report (unique_labels)
    path: Path
    records: tuple[dict, ...]
    name: str = ""  # the scheme (or directory name) the label was made from; "" = the label
    setup: str | None = None  # "<model>/<dataset>" from run_config.json; None when unknown

    @property
    def scheme(self) -> str:
        return self.name or self.label

    def series(self, key: str) -> dict[int, float]:
        return {int(r["iteration"]): float(r[key]) for r in self.records
                if r.get(key) is not None and isinstance(r.get(key), (int, float))}


def metrics_file(path: str | Path) -> Path:
    """The metrics JSONL of ``path``: the file itself, or ``metrics.jsonl`` of a run directory."""
    p = Path(path)
    return p / "metrics.jsonl" if p.is_dir() else p


def _run_config(f: Path) -> dict:
    cfg = f.parent / "run_config.json"
    try:
        data = json.loads(cfg.read_text()) if cfg.is_file() else {}
    except (json.JSONDecodeError, OSError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _setup(cfg: dict) -> str | None:
    """``<model>/<dataset>`` of a run_config.json (RunConfig.to_dict): model name, and the dataset's kind
    (mock) or indexed prefix names."""
    model, data = cfg.get("model"), cfg.get("data")
    if not isinstance(model, dict) or not model.get("name") or not isinstance(data, dict):
        return None
    prefixes = data.get("prefixes") or []
    dataset = "+".join(Path(str(x)).name for x in prefixes) if prefixes else str(data.get("kind", "?"))
    return f"{model['name']}/{dataset}"


def metric_records(f: Path) -> list[dict]:
    """The JSON objects of a metrics JSON-lines file in order; lines that are not JSON (the torn last line of a
    run killed while writing) are skipped with a warning."""
    records, bad = [], 0
    for line in f.read_text().splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(r, dict):
            records.append(r)
    if bad:
        log.warning("%s: %d line(s) are not JSON and were skipped", f, bad)
    return records


def load_run(path: str | Path, label: str | None = None) -> Run:
    f = metrics_file(path)
    if not f.is_file():
        raise FileNotFoundError(f"no metrics JSONL at {f} (pass a metrics.jsonl file or a run directory)")
    records = [r for r in metric_records(f) if "iteration" in r and "loss" in r]
    cfg = _run_config(f)
    if label is None:
        label = cfg.get("scheme") or f.parent.name
    return Run(str(label), f, tuple(records), setup=_setup(cfg))


def unique_labels(runs: list[Run]) -> list[Run]:
    """``runs`` with every label unique: a label shared by several runs becomes ``<model>/<dataset>/<label>``
    where the run_config.json says, else the metrics file's directory (and ``#k`` if that still repeats)."""
    count = Counter(r.label for r in runs)
    out = []
    for r in runs:
        if count[r.label] > 1:
            r = replace(r, label=f"{r.setup}/{r.label}" if r.setup else str(r.path.parent), name=r.scheme)
        out.append(r)
    seen: Counter = Counter()
    for i, r in enumerate(out):
        seen[r.label] += 1
        if seen[r.label] > 1:
            out[i] = replace(r, label=f"{r.label} #{seen[r.label]}", name=r.scheme)
    return out


def _first_reference(run: Run, runs: list[Run], reference: str) -> Run | None:
    """The first run labelled (or of scheme) ``reference`` with ``run``'s model and dataset (unknown: any)."""
    return next((r for r in runs if reference in (r.label, r.scheme)
                 and (r.setup is None or run.setup is None or r.setup == run.setup)), None)


def reference_of(run: Run, runs: list[Run], reference: str) -> Run | None:
    """The run ``run`` is compared with; None for that reference run itself, or when there is none."""
    ref = _first_reference(run, runs, reference)
    return None if ref is run else ref


def problems(runs: list[Run], reference: str) -> list[str]:
    """What keeps runs from being compared: no reference run at all, or none of a run's model and dataset. A single
    run that is not the reference has nothing to be compared with: not a problem (``write``'s text says so)."""
    refs = [r for r in runs if reference in (r.label, r.scheme)]
    if len(runs) == 1 and not refs:
        return []
    if runs and not refs:
        return [f"--metrics: no run labelled {reference!r} among {', '.join(r.label for r in runs)}: relative "
                f"loss errors not computed (--reference LABEL names the reference run)"]
    return [f"--metrics: run {r.label!r} ({r.setup}) is not compared: no {reference!r} run of the same model and "
            f"dataset among {', '.join(f'{x.label} ({x.setup})' for x in refs)}"
            for r in runs if _first_reference(r, runs, reference) is None]


def loss_error(run: Run, ref: Run, last_n: int | None = None) -> tuple[float | None, int]:
    """(mean relative loss error, non-finite iterations) of ``run`` against ``ref``.

    Over the iterations both runs logged (the last ``last_n`` of them when given), leaving out those where the
    reference's loss is zero or not finite. An iteration where ``run``'s loss is NaN or Inf while the
    reference's is finite has an infinite relative error: the mean is then ``inf``, and the second value counts
    those iterations. None when no iteration is left."""
    if last_n is not None and (isinstance(last_n, bool) or not isinstance(last_n, int) or last_n < 1):
        raise ValueError(f"last_n={last_n!r}: must be an integer >= 1 (or None: every iteration)")
    a, b = run.series("loss"), ref.series("loss")
    its = sorted(a.keys() & b.keys())
    if last_n is not None:
        its = its[-last_n:]
    its = [i for i in its if b[i] != 0 and math.isfinite(b[i])]
    if not its:
        return None, 0
    nonfinite = sum(1 for i in its if not math.isfinite(a[i]))
    if nonfinite:
        return math.inf, nonfinite
    return float(np.mean([abs(a[i] - b[i]) / abs(b[i]) for i in its])), 0


def mean_relative_error(run: Run, ref: Run, last_n: int | None = None) -> float | None:
    """``mean(|loss - loss_ref| / |loss_ref|)``: the first value of ``loss_error``."""
    return loss_error(run, ref, last_n)[0]


def compare(runs: list[Run], reference: str = "bf16", last_n: int = 10) -> list[dict]:
    runs = unique_labels(runs)
    rows = []
    for r in runs:
        loss = r.series("loss")
        final = loss[max(loss)] if loss else None
        ref = reference_of(r, runs, reference)
        mre, nonfinite = (None, None) if ref is None else loss_error(r, ref)
        rows.append({"run": r.label, "path": str(r.path), "iterations": len(loss), "final_loss": final,
                     "reference": None if ref is None else ref.label, "mre_all": mre,
                     f"mre_last_{last_n}": None if ref is None else mean_relative_error(r, ref, last_n),
                     "nonfinite_loss": nonfinite})
    return rows


def _finite(its: list[int], ys: list[float]) -> tuple[list[int], list[float], int]:
    """The points of a curve that can be drawn (a NaN or Inf, from a run that diverged, would leave the axis
    without a scale), and how many were left out."""
    keep = [(i, y) for i, y in zip(its, ys) if math.isfinite(y)]
    return [i for i, _ in keep], [y for _, y in keep], len(its) - len(keep)


def _label(label: str, dropped: int) -> str:
    return f"{label} ({dropped} non-finite not drawn)" if dropped else label


def write(runs: list[Run], out: Outputs, reference: str = "bf16", last_n: int = 10, plots: bool = True) -> dict:
    runs = unique_labels(runs)
    rows = compare(runs, reference, last_n)
    has_ref = any(reference in (r.label, r.scheme) for r in runs)
    out.json("training/loss_vs_reference.json", {"reference": reference if has_ref else None, "last_n": last_n,
                                                  "runs": rows}, SECTION, "Loss vs reference (JSON)")
    head = list(rows[0]) if rows else ["run"]
    txt = tabulate([[fmt_num(r[h]) if not isinstance(r[h], str) else r[h] for h in head if h != "path"] for r in rows],
                   headers=[h for h in head if h != "path"], disable_numparse=True)
    notes = problems(runs, reference)
    if len(runs) == 1 and not has_ref:
        notes = [f"one run ({runs[0].label}): no run labelled {reference!r} to compare it with (--reference LABEL "
                 "names the reference run)"]
    if notes:
        txt = "\n".join(notes) + "\n\n" + txt
    out.text("training/loss_vs_reference.txt", txt, SECTION, f"Mean relative error vs {reference} (text)")
    if not runs or not plots:
        return {"runs": rows}
    fig, axes = svg.subplots(2, 2, panel=(400, 230), title="Training runs across schemes")
    for ax, (key, label) in zip(axes.ravel(), SERIES):
        not_drawn = 0
        for k, r in enumerate(runs):
            s = r.series(key)
            if s:
                its, ys, dropped = _finite(sorted(s), [s[i] for i in sorted(s)])
                not_drawn += dropped
                ax.plot(its, ys, color=svg.TAB10[k % len(svg.TAB10)], label=r.label,
                        lw=2.2 if reference in (r.label, r.scheme) else 1.3)
        ax.set_xlabel("iteration")
        ax.integer_x = True
        ax.set_ylabel(label)
        ax.set_title(_label(label, not_drawn))  # the legend is shared by the panels
        ax.grid()
        if key in ("loss", "grad_norm"):
            vals = [v for r in runs for v in r.series(key).values() if 0 < v < math.inf]
            if vals and max(vals) / min(vals) > 20:
                ax.set_yscale("log")
    axes[0, 1].legend("outside")
    out.figure("training/curves.svg", fig, SECTION, "Loss, grad norm, throughput and step time")
    pairs = [(k, r, ref) for k, r in enumerate(runs) if (ref := reference_of(r, runs, reference)) is not None]
    if pairs:
        fig, ax = svg.subplots(panel=(620, 260))
        several = len({id(ref) for _, _, ref in pairs}) > 1
        for k, r, ref in pairs:
            a, b = r.series("loss"), ref.series("loss")
            its = sorted(i for i in a.keys() & b.keys() if b[i] != 0)
            its, ys, dropped = _finite(its, [100 * abs(a[i] - b[i]) / abs(b[i]) for i in its])
            ax.plot(its, ys, color=svg.TAB10[k % len(svg.TAB10)],
                    label=_label(f"{r.label} vs {ref.label}" if several else r.label, dropped))
        ax.set_xlabel("iteration")
        ax.set_ylabel(f"|loss - loss_{reference}| / loss_{reference} (%)")
        ax.set_title(f"Relative loss error against the {reference} run")
        ax.integer_x = True
        ax.grid()
        ax.legend("outside")
        out.figure("training/relative_error.svg", fig, SECTION, f"Relative loss error vs {reference}")
    return {"runs": rows}
