"""`fxquant draw`: the predecessor's `run_tensor_draw.sh` (modes collect / visualize / both).

A thin command: `collect` is `fxquant collect` (same options), `visualize` is `fxquant report` over the
capture sets under `--tensor-dir` (the directory itself when it is one capture set, else each
subdirectory that is, e.g. DIR/<scheme>/ as `fxquant collect` writes them) into `--output-dir`, with the
training runs of every collection listed in DIR/collection_summary.json as loss curves; `both` runs one,
then the other.

    fxquant draw                                   # visualize ./enhanced_tensor_logs into ./draw
    fxquant draw both mxfp8 --control-iter 3 --collect-micro-batches 2
    fxquant draw --mode visualize --tensor-dir ./enhanced_tensor_logs --output-dir ./draw
"""
from __future__ import annotations

import argparse
from pathlib import Path

from fxquant.capture import pt_reader
from fxquant.capture.reader import is_capture_set
from fxquant.cli import collect_cmd, collect_plan, collect_summary

MODES = ("visualize", "collect", "both")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("draw", help="collect tensors and/or report on them (predecessor's run_tensor_draw)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    collect_cmd.add_collection_arguments(p, MODES)
    p.add_argument("--output-dir", default="./draw", metavar="DIR", help="report directory (default ./draw)")
    p.add_argument("-j", "--workers", type=int, default=1, metavar="N", help="report worker processes (default 1)")
    p.add_argument("--no-plots", action="store_true", help="report tables only (default: tables and plots)")
    p.add_argument("--reference", default=None, metavar="LABEL",
                   help="the run the others' losses are compared with (default bf16, or legacy_bf16 when the "
                        "collections hold that and no bf16 run: `collect --legacy`)")
    p.set_defaults(func=run_draw)


def capture_sets(root: Path) -> list[Path]:
    """`root` if it is a capture set (has rank-* directories), else its subdirectories that are; else `root` when it
    holds the predecessor's .pt files (read as one set by fxquant.capture.pt_reader, its quant types as schemes)."""
    if not root.is_dir():
        raise FileNotFoundError(f"--tensor-dir {str(root)!r}: no such directory; collect first "
                                f"(`fxquant draw collect ...` or `fxquant collect ...`)")
    if is_capture_set(root):
        return [root]
    found = sorted(d for d in root.iterdir() if is_capture_set(d))
    if not found and pt_reader.has_pt_files(root):
        return [root]
    if not found:
        raise FileNotFoundError(f"--tensor-dir {str(root)!r} holds no capture set (no rank-* directories in it or "
                                f"its subdirectories); collect first with `fxquant draw collect` or `fxquant collect`")
    return found


def visualize(args: argparse.Namespace) -> int:
    from fxquant.cli import main as fxquant_main

    root = Path(args.tensor_dir)
    sets = capture_sets(root)
    run_dirs = collect_summary.run_dirs(root)
    collections = collect_summary.read(root)
    print(f"[draw visualize] {len(sets)} capture set(s) and {len(run_dirs)} training run(s) of "
          f"{len(collections)} collection(s) under {root}", flush=True)
    argv = ["report", *map(str, sets), "-o", args.output_dir, "-j", str(args.workers)]
    for run_dir in run_dirs:
        argv += ["--metrics", run_dir]
    if run_dirs:
        schemes = {row.get("scheme") for c in collections for row in c.get("runs", []) if row.get("run_dir") in run_dirs}
        reference = args.reference or ("legacy_bf16" if "legacy_bf16" in schemes and "bf16" not in schemes else "bf16")
        argv += ["--reference", reference]
    if args.no_plots:
        argv.append("--no-plots")
    print(f"[draw visualize] fxquant {' '.join(argv)}", flush=True)
    if args.dry_run:  # the command above is the whole answer
        return 0
    return fxquant_main(argv)


def run_draw(args: argparse.Namespace) -> int:
    mode, quant_type = collect_plan.mode_and_quant_type(args, MODES)
    if mode == "visualize" and (quant_type is not None or args.legacy):
        given = f"quant type {quant_type!r}" if quant_type is not None else "--legacy"
        raise ValueError(f"{given} chooses what to collect; visualize reports on every capture set under "
                         f"--tensor-dir: use `fxquant draw collect|both ...` to collect first")
    if mode in ("collect", "both"):
        args.mode, args.mode_arg, args.quant_type, args.quant_type_arg = "single", None, quant_type, None
        code = collect_cmd.run_collect(args)
        if code != 0 or mode == "collect" or args.dry_run:
            return code
    return visualize(args)
