"""`fxquant report`, `fxquant quant-error`, `fxquant mx-sweep`: analysis of capture sets and training runs.

`report` writes everything (docs/analysis.md) and index.html; `quant-error` and `mx-sweep` print one
analysis as a table (the predecessor's quantization-error CLI and MX scaling sweep) and can write JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fxquant.cli.options import WHERE_HELP, check_dirs, nothing_found, positive_int, where_conditions


def _common(p: argparse.ArgumentParser, *, figures: bool = False, study: bool = False, formats: bool = False) -> None:
    """The options of a verb: every verb reads DIRs with workers and --where; ``study``: the MX scaling study's;
    ``formats``: the over/underflow and distribution formats; ``figures``: its workers also draw figures."""
    p.add_argument("dirs", nargs="*", metavar="DIR", help="capture directories (fxquant.capture sets, or "
                   "directories of the predecessor's .pt files)")
    p.add_argument("-j", "--workers", type=int, default=1, help="worker processes that summarise the tensors" +
                   (" and then draw the figures" if figures else "") + " (default 1: all in this process)")
    p.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE",
                   help=f"keep {WHERE_HELP}. A kept quantized copy also keeps the high-precision record it was "
                   f"quantized from, its error's reference")
    if formats:
        p.add_argument("--formats", default=None, help="comma-separated formats for the over/underflow summary and "
                       "the distribution pages (default: common formats plus those captured)")
    if study:
        p.add_argument("--mx-formats", default=None, help="comma-separated MX formats of the scaling study "
                       "(default: mxfp8_e4m3, mxfp8_e5m2, mxfp4_e2m1 plus the MX formats captured)")
        p.add_argument("--offsets", default="-2,-1,0,1,2", help="shared-exponent offsets of the MX study")
    if study and formats:
        p.add_argument("--sample-blocks", type=int, default=128, help="32-element blocks sampled per tensor for the "
                       "MX study and NVFP4 (0: no study)")
    elif study:
        p.add_argument("--sample-blocks", type=positive_int, default=128, help="32-element blocks sampled per "
                       "tensor for the study (>= 1)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar (default: a tqdm bar on stderr)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="statistics, plots and index.html over capture sets and training runs")
    _common(p, figures=True, study=True, formats=True)
    p.add_argument("-o", "--out", default="fxquant-report", help="report directory (default ./fxquant-report)")
    p.add_argument("--metrics", action="append", default=[], metavar="RUN",
                   help="a training run's metrics.jsonl or run directory (repeatable; default: no loss curves)")
    p.add_argument("--reference", default="bf16", help="label of the reference run for relative errors")
    p.add_argument("--last-n", type=positive_int, default=10, metavar="N",
                   help="iterations in the 'last N' mean relative error (N >= 1)")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    p.set_defaults(func=run_report)
    q = sub.add_parser("quant-error", help="per-site quantization error of captured quantized GEMM operands "
                                           "(any high-precision tensor in any format: fxquant what-if)")
    _common(q)
    q.add_argument("--json", action="store_true", help="print the per-site rows as JSON lines")
    q.set_defaults(func=run_quant_error)
    m = sub.add_parser("mx-sweep", help="MX scaling study: scale rules x exponent offsets, with a recommendation")
    _common(m, study=True)
    m.add_argument("--json", action="store_true", help="print the study as JSON")
    m.set_defaults(func=run_mx_sweep)


def _kwargs(args: argparse.Namespace) -> dict:
    if isinstance(args.workers, int) and args.workers < 1:
        raise ValueError(f"--workers {args.workers}: must be >= 1")
    text = getattr(args, "offsets", "-2,-1,0,1,2")
    try:
        offsets = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--offsets {text!r}: expected comma-separated integers") from None
    if not offsets:
        raise ValueError(f"--offsets {text!r}: give at least one exponent offset (e.g. --offsets=-1,0,1)")
    split = (lambda s: None if s is None else [v.strip() for v in s.split(",") if v.strip()])
    return {"workers": args.workers, "where": where_conditions(args.where) or None,
            "formats": split(getattr(args, "formats", None)), "mx_formats": split(getattr(args, "mx_formats", None)),
            "offsets": offsets, "sample_blocks": getattr(args, "sample_blocks", 0),
            "progress": False if args.quiet else f"fxquant {args.verb}"}


def _check_metrics(runs: list[str]) -> None:
    """Every --metrics RUN must be a metrics JSONL or a run directory holding one."""
    from fxquant.analysis.loss_curves import metrics_file

    missing = [str(metrics_file(r)) for r in runs if not metrics_file(r).is_file()]
    if missing:
        raise FileNotFoundError(f"--metrics: no metrics JSONL at {', '.join(missing)} (give a metrics.jsonl file or "
                                f"the run directory holding it)")


def run_report(args: argparse.Namespace) -> int:
    from fxquant.analysis import report

    if not args.dirs and not args.metrics:
        raise ValueError("nothing to report: give capture DIRs and/or --metrics RUN")
    check_dirs(args.dirs)
    _check_metrics(args.metrics)
    res = report(args.dirs, args.out, metrics=args.metrics, reference=args.reference, last_n=args.last_n,
                 plots=not args.no_plots, **_kwargs(args))
    for p in res.problems:
        print(f"warning: {p}", file=sys.stderr)
    print(f"{res.records} records ({res.tensors} tensors, {res.bytes / 1e6:.1f} MB) with {res.workers} worker(s) "
          f"in {res.seconds:.1f} s -> {res.index}")
    error = nothing_found(res.records, res.problems, args.dirs, args.where)
    if error:
        print(f"fxquant report: error: {error}: nothing to analyse", file=sys.stderr)
        return 1
    return 0


def _analyse(args: argparse.Namespace, plots: bool = False):
    import tempfile

    from fxquant.analysis import report

    if not args.dirs:
        raise ValueError("give at least one capture DIR")
    check_dirs(args.dirs)
    with tempfile.TemporaryDirectory() as tmp:
        res = report(args.dirs, tmp, plots=plots, **_kwargs(args))
        for p in res.problems:
            print(f"warning: {p}", file=sys.stderr)
        error = nothing_found(res.records, res.problems, args.dirs, args.where)
        if error:
            raise NothingToAnalyse(f"{error}: nothing to analyse")
        return res.aggregator


class NothingToAnalyse(ValueError):
    """The DIRs gave no record (docs/analysis.md: exit 1, as ``report``)."""


def _analysed(args: argparse.Namespace):
    """``_analyse``'s aggregator, or None after saying why there is none (the verb then exits 1)."""
    try:
        return _analyse(args)
    except NothingToAnalyse as exc:
        print(f"fxquant {args.verb}: error: {exc}", file=sys.stderr)
        return None


def _no_sites_reason(args: argparse.Namespace, agg) -> str:
    """Why ``quant-error`` has no row: the selected records hold quantized copies without an error to show (neither
    a readable high-precision source nor capture-time statistics), or hold none (the filter, the capture spec or
    the predecessor's .pt files, which hold high-precision tensors only)."""
    from fxquant.capture import pt_reader
    from fxquant.capture.reader import is_capture_set

    copies = agg.groups[("copy",)].get(("quantized",))
    n = copies.moments.tensors if copies is not None else 0
    if n:
        return (f"{n} quantized {'copy' if n == 1 else 'copies'} selected, none with a readable high-precision source "
                f"or capture-time error statistics")
    text = "no quantized copies among the selected records"
    if args.where:
        text += f" (--where {' '.join(args.where)})"
    pt = [d for d in args.dirs if not is_capture_set(Path(d)) and pt_reader.has_pt_files(Path(d))]
    if pt:
        text += f"; the predecessor saved high-precision tensors only ({', '.join(pt)})"
    if len(pt) < len(args.dirs):
        text += "; a capture set holds them where its spec asks for them (copies: [hp, quantized])"
    return text


def run_quant_error(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from fxquant.analysis import quant_error
    from fxquant.analysis.outputs import clean, fmt_num

    agg = _analysed(args)  # no --sample-blocks: no MX study
    if agg is None:
        return 1
    if not agg.sites:
        print(f"note: {_no_sites_reason(args, agg)}; `fxquant what-if DIR` gives the error the high-precision tensors "
              f"would have in any format", file=sys.stderr)
    if args.json:
        for s in agg.sites:
            print(json.dumps(clean(s), sort_keys=True))
        return 0
    cols = ["scheme", "module", "role", "gemm", "format", "rank", "iteration", "sqnr_db", "mse", "cosine", "max_err",
            "saturated_pct", "flushed_pct"]
    print(tabulate([[fmt_num(s.get(c)) for c in cols] for s in agg.sites], headers=cols, disable_numparse=True))
    summary = quant_error.summary_rows(agg.sites)
    print(f"\n{len(agg.sites)} quantized operand(s) in {len(summary)} group(s)")
    return 0


def run_mx_sweep(args: argparse.Namespace) -> int:
    from fxquant.analysis import mx_report, mx_study
    from fxquant.analysis.outputs import clean

    agg = _analysed(args)
    if agg is None:
        return 1
    rows = mx_report.rows_of(agg)
    if not rows:
        print("fxquant mx-sweep: error: no MX study rows: the selected records hold no high-precision GEMM operand "
              "with stored values (a statistics-only capture, or --where left none)", file=sys.stderr)
        return 1
    best = mx_study.recommend(rows)
    if args.json:
        import dataclasses

        print(json.dumps(clean({"rows": [dataclasses.asdict(r) for r in rows],
                                "recommendation": {f"{f}/{g}": dataclasses.asdict(r) for (f, g), r in best.items()}}),
                         indent=1, sort_keys=True))
        return 0
    print(mx_report.study_table([r for r in rows if r.group == "all"]))
    for (f, g), r in sorted(best.items()):
        if g == "all":
            print(f"recommended for {f}: scale_mode={r.scale_mode} offset={r.offset:+d} (SQNR {r.sqnr_db:.2f} dB)")
    return 0
