"""The report: plan -> stream tensors through workers -> merge -> write every table, figure and index.html.

    >>> from fxquant import analysis
    >>> res = analysis.report(["captures/bf16", "captures/mxfp8"], "report/", workers=4,
    ...                       where={"role": ["input", "grad_output"]}, metrics=["runs/bf16", "runs/mxfp8"])
    >>> res.index                       # report/index.html

Output names depend only on the data (formats, schemes, groupings), never on time or worker count. The output
directory is made (or refused: a file, unwritable) before any tensor is read; a report written into the directory
of an earlier one removes the earlier files it does not write itself, as listed in the earlier ``report.json``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from fxquant.analysis import (distributions, engine, html, layer_pages, loss_curves, mx_report, overflow, plan,
                              quant_error, stats_report)
from fxquant.analysis.aggregate import Aggregator
from fxquant.analysis.outputs import Job, Outputs, run_jobs
from fxquant.analysis.summary import AnalysisConfig

log = logging.getLogger(__name__)

DEFAULT_FORMATS = ("hifp8", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1", "nvfp4")
DEFAULT_MX = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1")
MANIFEST = "report.json"  # lists every file of the report ("files") but itself and index.html


@dataclass
class ReportResult:
    out: Path
    index: Path
    records: int
    tensors: int
    bytes: int
    workers: int
    worker_pids: list[int]
    problems: list[str]
    seconds: float
    files: list[str] = field(default_factory=list)
    aggregator: Aggregator | None = None


def _formats(fmts, seen: set[str], default) -> tuple[str, ...]:
    if fmts is not None:
        return tuple(fmts)
    return tuple(dict.fromkeys([*default, *sorted(seen)]))


def _present_formats(p: plan.Plan) -> set[str]:
    """Canonical names of the formats the selected records were quantized with (unknown names skipped)."""
    from fxquant import formats

    out = set()
    for name in {str(i.fields["format"]) for t in p.tasks for u in t.units for i in u if i.fields.get("format")}:
        try:
            out.add(formats.canonical_name(name))
        except ValueError:
            log.warning("records name an unknown format %r; it is not analysed as a format", name)
    return out


def report(dirs: list[str | Path] | str | Path = (), out: str | Path = "fxquant-report", *, workers: int = 1,
           where: dict | None = None, formats: list[str] | None = None, mx_formats: list[str] | None = None,
           offsets: tuple[int, ...] = (-2, -1, 0, 1, 2), sample_blocks: int = 128, metrics: list = (),
           reference: str = "bf16", last_n: int = 10, progress: bool | str = True, plots: bool = True,
           task_bytes: int = 64 << 20) -> ReportResult:
    """Analyse capture directories ``dirs`` (and training ``metrics``) into the report directory ``out``."""
    t0 = time.perf_counter()
    if metrics and (isinstance(last_n, bool) or not isinstance(last_n, int) or last_n < 1):
        raise ValueError(f"last_n={last_n!r}: must be an integer >= 1")
    dirs = [dirs] if isinstance(dirs, (str, Path)) else list(dirs)
    p = plan.build(dirs, where, workers, task_bytes=task_bytes)
    present = _present_formats(p)
    mx_present = {f for f in present if f.startswith("mx")}
    config = AnalysisConfig(formats=_formats(formats, present, DEFAULT_FORMATS),
                            mx_formats=_formats(mx_formats, mx_present, DEFAULT_MX), offsets=tuple(offsets),
                            sample_blocks=sample_blocks)
    outputs = Outputs(Path(out))  # the output directory, before the work: a bad path fails now, not at the end
    previous = outputs.listed(MANIFEST)
    agg = Aggregator(config)
    agg.problems.extend(p.problems)
    runs = []
    for m in metrics or ():
        try:
            runs.append(loss_curves.load_run(m))
        except FileNotFoundError as exc:
            agg.problems.append(str(exc))
    runs = loss_curves.unique_labels(runs)
    agg.problems.extend(loss_curves.problems(runs, reference))
    pool = engine.worker_pool(workers) if workers > 1 else None
    try:
        pids = engine.run(p, config, workers, agg.merge_result, progress=progress, pool=pool)
        jobs: list[Job] = []  # every part of the report; with a pool they run (and draw) in its workers
        if dirs:
            jobs += [Job("stats", stats_report.write, (agg,), {"plots": plots}),
                     Job("quant_error", quant_error.write, (agg,), {"plots": plots})]
            jobs += [Job(f"distributions/{j.name}", j.func, j.args) for j in distributions.jobs(agg)] if plots else []
            jobs += [Job("layers", layer_pages.write, (agg,), {"plots": plots}),
                     Job("overflow", overflow.write, (agg,), {"plots": plots}),
                     Job("mx_study", mx_report.write, (agg,), {"plots": plots, "sample_blocks": sample_blocks})]
        if runs:
            jobs.append(Job("training", loss_curves.write, (runs,),
                            {"reference": reference, "last_n": last_n, "plots": plots}))
        run_jobs(jobs, outputs, pool)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    seconds = time.perf_counter() - t0
    facts = [("capture directories", ", ".join(map(str, dirs)) or "none"),
             ("records analysed", f"{agg.records} ({agg.tensors} with stored tensors, {p.nbytes} bytes)"),
             ("filters", repr(where) if where else "none"),
             ("workers", f"{workers} (PIDs {sorted(set(pids))})"),
             ("formats", ", ".join(config.formats)), ("MX study formats", ", ".join(config.mx_formats)),
             ("quantile accuracy", stats_report.QUANTILE_ACCURACY),
             ("training runs", ", ".join(r.label for r in runs) or "none")]
    outputs.json(MANIFEST, {"facts": dict(facts), "problems": agg.problems, "workers": workers,
                            "worker_pids": sorted(set(pids)), "records": agg.records, "tensors": agg.tensors,
                            "bytes": p.nbytes, "files": [e.path for e in outputs.entries]},
                 "About this report", "Report metadata (JSON)")
    index = html.write(outputs.root, outputs.entries, "fxquant report", facts, agg.problems)
    outputs.remove_stale(previous, keep=[index.name])
    return ReportResult(outputs.root, index, agg.records, agg.tensors, p.nbytes, workers, sorted(set(pids)), agg.problems,
                        seconds, [e.path for e in outputs.entries], agg)
