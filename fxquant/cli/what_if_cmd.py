"""`fxquant what-if` (the quantization error captured high-precision tensors would have in any format) and
`fxquant plot-tensors` (value heatmaps and attention maps of captured tensors)."""
from __future__ import annotations

import argparse
import json
import sys

from fxquant.cli.options import WHERE_HELP, check_dirs, nothing_found, where_conditions

COLUMNS = ("format", "tensors", "sqnr_db", "rel_err", "mean_rel_err", "mse", "mae", "max_err", "cosine", "flushed_pct",
           "nan_pct", "inf_pct")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("what-if", help="quantization error of captured high-precision tensors in any format "
                                       "(capture sets or the predecessor's .pt directories)")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="capture directories or directories of .pt files")
    p.add_argument("--formats", default="all", help="comma-separated formats, or 'all' (default: every format of "
                                                    "`fxquant formats`)")
    p.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE", help=f"keep {WHERE_HELP}")
    p.add_argument("--dim", type=int, default=-1, help="blocked dimension of block formats (default -1: the last)")
    p.add_argument("--block-size", type=int, default=None,
                   help="elements per scale for block formats (MX default 32, NVFP4 16); element formats have none")
    p.add_argument("--rounding", default=None, help="rounding mode for every format (default: each format's)")
    p.add_argument("--scale-mode", default=None, help="MX scale rule: floor, rceil, ceil, even (default floor)")
    p.add_argument("--by", default="role", help="comma-separated manifest fields to group by (default role; '' for "
                                                "one group)")
    p.add_argument("--per-tensor", action="store_true", help="one row per tensor and format")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    register_plot(sub)


def run(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from fxquant.analysis.outputs import clean, fmt_num
    from fxquant.analysis.what_if import what_if

    check_dirs(args.dirs)
    by = tuple(b.strip() for b in args.by.split(",") if b.strip())
    res = what_if(args.dirs, args.formats, where=where_conditions(args.where) or None, dim=args.dim,
                  block_size=args.block_size, rounding=args.rounding, scale_mode=args.scale_mode, by=by,
                  per_tensor=args.per_tensor, progress=not args.quiet)
    for p in res.problems:
        print(f"warning: {p}", file=sys.stderr)
    if not res.records:
        error = nothing_found(0, res.problems, args.dirs, args.where, "high-precision records with a stored tensor")
        print(f"fxquant what-if: error: {error}: nothing to analyse", file=sys.stderr)
        return 1
    if not res.loaded:
        print(f"fxquant what-if: error: none of the {res.records} selected high-precision tensor(s) could be read "
              f"(see the warnings above): nothing to analyse", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(clean({"rows": res.rows, "tensors": res.tensors, "records": res.records,
                                "loaded": res.loaded}), indent=1, sort_keys=True))
        return 0
    cols = [*by, *COLUMNS]
    print(tabulate([[fmt_num(r.get(c)) for c in cols] for r in res.rows], headers=cols, disable_numparse=True))
    if args.per_tensor:
        tcols = ["module", "role", "rank", "iteration", *COLUMNS[:1], *COLUMNS[2:]]
        print()
        print(tabulate([[fmt_num(r.get(c)) for c in tcols] for r in res.tensors], headers=tcols,
                       disable_numparse=True))
    unread = res.records - res.loaded
    left_out = f"; {unread} of the {res.records} selected could not be read and are left out (see the warnings above)"
    print(f"\n{res.loaded} high-precision tensor(s)" + (left_out if unread else ""))
    return 0


def register_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot-tensors", help="value heatmaps of captured tensors and attention maps of attention "
                                            "scores/probs, with an index.html")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="capture directories or directories of .pt files")
    p.add_argument("-o", "--out", default="fxquant-heatmaps", help="output directory (default ./fxquant-heatmaps)")
    p.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE", help=f"keep {WHERE_HELP}")
    p.add_argument("--max-tensors", type=int, default=50, help="draw at most this many tensors (default 50)")
    p.add_argument("--cells", type=int, default=64, help="heatmap resolution: at most CELLS x CELLS cells (default 64)")
    p.add_argument("--heads", type=int, default=8, help="heads per attention map (default 8)")
    p.set_defaults(func=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    from fxquant.analysis.tensor_plots import plot_tensors

    check_dirs(args.dirs)
    index, problems, n = plot_tensors(args.dirs, args.out, where=where_conditions(args.where) or None,
                                      max_tensors=args.max_tensors, cells=args.cells, heads=args.heads)
    for p in problems:
        print(f"warning: {p}", file=sys.stderr)
    error = nothing_found(n, problems, args.dirs, args.where, what="records with a stored tensor")
    if error:
        print(f"fxquant plot-tensors: error: {error}: nothing drawn", file=sys.stderr)
        return 1
    print(f"{n} tensor(s) drawn -> {index}")
    return 0
