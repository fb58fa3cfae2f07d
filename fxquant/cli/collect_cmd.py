"""`fxquant collect`: the predecessor's `run_tensor_collection.sh` (modes single / batch / quick).

A thin command over `python -m experiments run`: each collection is one supervised training run of a
Megatron model with the predecessor's capture switch (`--save-tensors --tensor-save-dir DIR --control-iter N
[--collect-micro-batches M]`; experiments run writes DIR/SCHEME), so captures land in the predecessor's
layout, one capture set per quant type under DIR. Afterwards it counts the records of each set per pattern (the
predecessor counted files matching *_forward_*, *_pre_*, *_FA_*, ...) and writes a summary
(DIR/collection_summary.{json,txt}).

    fxquant collect single mxfp8 --control-iter 3 --collect-micro-batches 2
    fxquant collect batch                      # bf16 and the FA_/linear_/FA_linear_ x mxfp8/mxfp4/hifp8 schemes
    fxquant collect quick hifp8                # one iteration, one micro-batch
    fxquant collect single hifp8 --export-pt ./pt_logs   # also the predecessor's .pt files
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

MODES = ("single", "batch", "quick")
BASE_TYPES = ("bf16", "mxfp8", "mxfp4", "hifp8")  # the predecessor's quant types
DEFAULT_DIR = "./enhanced_tensor_logs"
# (pattern, record field, value): the predecessor's file-name patterns, counted on manifest records
PATTERNS = (("forward", "direction", "forward"), ("backward", "direction", "backward"), ("pre", "phase", "pre"),
            ("post", "phase", "post"), ("FA", "component", "attention"), ("linear", "component", "linear"),
            ("quantized", "copy", "quantized"))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collect", help="collect tensors from short training runs (predecessor's run_tensor_collection)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_collection_arguments(p)
    p.set_defaults(func=run_collect)


def add_collection_arguments(p: argparse.ArgumentParser, modes: tuple[str, ...] = MODES) -> None:
    p.add_argument("mode_arg", nargs="?", metavar="MODE", choices=modes, help=f"{' | '.join(modes)} (or --mode)")
    p.add_argument("quant_type_arg", nargs="?", metavar="QUANT_TYPE", help="quant type (or --quant-type)")
    p.add_argument("--mode", choices=modes, default=None, help=f"default {modes[0]}")
    p.add_argument("--quant-type", default=None,
                   help="bf16 | mxfp8 | mxfp4 | hifp8 (the FA_linear_ scheme of that format) or any scheme name; "
                        "default mxfp8 (single), hifp8 (quick)")
    p.add_argument("--quant-types", nargs="+", default=None, metavar="Q",
                   help="batch: the quant types to collect (default: the predecessor's ten schemes)")
    p.add_argument("--control-iter", type=int, default=1, help="iterations to collect, then stop (default 1)")
    p.add_argument("--collect-micro-batches", type=int, default=None, metavar="M",
                   help="micro-batches 0..M-1 of each iteration (default all; quick: 1)")
    p.add_argument("--tensor-save-dir", "--tensor-dir", dest="tensor_dir", default=DEFAULT_DIR,
                   help=f"captures go to DIR/<scheme>/ (default {DEFAULT_DIR})")
    p.add_argument("--export-pt", default=None, metavar="OUT",
                   help="also write the predecessor's .pt files of each collection to OUT/<scheme>/ "
                        "(fxquant capture export-pt; torch.load(weights_only=True))")
    p.add_argument("--spec", default=None, help="capture spec (default: the shipped 'predecessor' spec)")
    p.add_argument("--model", default="llama32-1b", help="experiments model (default llama32-1b, the predecessor's)")
    p.add_argument("--variant", default="tiny", choices=["tiny", "full"])
    p.add_argument("--dataset", default="mock")
    p.add_argument("--config", default="cpu", help="training config (experiments list)")
    p.add_argument("--out", default="runs/collect", help="run directories (default ./runs/collect)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--data-prefix", default=None)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--backend", default="aot_eager", choices=["inductor", "aot_eager", "eager"])
    p.add_argument("--attention", default="local", choices=["sdpa", "local"],
                   help="default local: Megatron's unfused attention materialises the probabilities")
    p.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    p.add_argument("--dry-run", action="store_true", help="print the runs' commands and configurations only")


def scheme_for(quant_type: str) -> str:
    """The predecessor's quant type (its linear and attention both in that format) or a scheme name."""
    from fxquant import schemes

    if quant_type in BASE_TYPES:
        return "bf16" if quant_type == "bf16" else f"FA_linear_{quant_type}"
    if quant_type in schemes.names():
        return quant_type
    from fxquant.formats.options import did_you_mean

    raise ValueError(f"quant type {quant_type!r}{did_you_mean(quant_type, [*BASE_TYPES, *schemes.names()])}; "
                     f"allowed: {', '.join(BASE_TYPES)} or a scheme name (fxquant explain / experiments list)")


def _plan(args: argparse.Namespace) -> tuple[str, list[str]]:
    mode = args.mode or args.mode_arg or MODES[0]
    if args.mode and args.mode_arg and args.mode != args.mode_arg:
        raise ValueError(f"mode given twice: {args.mode_arg!r} and --mode {args.mode!r}")
    qt = args.quant_type or args.quant_type_arg
    if mode == "batch":
        from experiments.catalog import PREDECESSOR_SCHEMES

        if qt is not None:
            raise ValueError(f"batch collects every quant type; use --quant-types to choose, not {qt!r}")
        return mode, [scheme_for(q) for q in (args.quant_types or PREDECESSOR_SCHEMES)]
    if args.quant_types:
        raise ValueError(f"--quant-types is for batch mode; {mode} collects one --quant-type")
    return mode, [scheme_for(qt or ("hifp8" if mode == "quick" else "mxfp8"))]


def run_argv(args: argparse.Namespace, mode: str, scheme: str) -> list[str]:
    """`python -m experiments run` arguments of one collection."""
    argv = ["run", "--model", args.model, "--variant", args.variant, "--dataset", args.dataset, "--scheme", scheme,
            "--config", args.config, "--out", args.out, "--nproc", str(args.nproc), "--tp", str(args.tp),
            "--pp", str(args.pp), "--backend", args.backend, "--attention", args.attention,
            "--timeout", str(args.timeout), "--save-tensors", "--tensor-save-dir", str(args.tensor_dir)]
    control_iter, micro_batches = args.control_iter, args.collect_micro_batches
    if mode == "quick":
        control_iter, micro_batches = 1, micro_batches or 1
        argv += ["--iters", "1", "--eval-interval", "0"]
    argv += ["--control-iter", str(control_iter)]
    if micro_batches is not None:
        argv += ["--collect-micro-batches", str(micro_batches)]
    for flag, value in (("--spec", args.spec), ("--tokenizer", args.tokenizer), ("--data-prefix", args.data_prefix)):
        if value is not None:
            argv += ["--capture" if flag == "--spec" else flag, value]
    if args.dry_run:
        argv.append("--dry-run")
    return argv


def _run_dir(args: argparse.Namespace, scheme: str) -> str | None:
    """Where `experiments run` put the run (OUT/<model name>/<dataset>/<scheme>); None for an unknown model."""
    from experiments.catalog import MODELS, TINY

    models = TINY if args.variant == "tiny" else MODELS
    if args.model not in models:
        return None
    return str(Path(args.out).resolve() / models[args.model].name / args.dataset / scheme)


def count_patterns(root: Path) -> dict:
    """Records per predecessor pattern in the capture set at `root`, plus totals and the commit state."""
    from fxquant import capture

    cs = capture.open(root)
    counts = collections.Counter()
    for rec in cs:
        for name, field, value in PATTERNS:
            counts[name] += rec.fields.get(field) == value
    committed = [m["committed"] for m in cs.meta.values()]
    return {"records": len(cs), "tensors": sum(1 for r in cs if r.has_tensor),
            "bytes": sum(c.get("bytes", 0) for c in committed if c), **{n: counts[n] for n, _, _ in PATTERNS},
            "ranks": cs.values("rank"), "iterations": cs.values("iteration"), "micro_batches": cs.values("micro_batch"),
            "committed": all(c is not None for c in committed),
            "stop_reasons": sorted({c["stop_reason"] for c in committed if c and c.get("stop_reason")})}


def run_collect(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from experiments.__main__ import main as experiments_main

    mode, schemes = _plan(args)
    rows = []
    for scheme in schemes:
        print(f"[collect {mode}] {scheme} -> {Path(args.tensor_dir) / scheme}", flush=True)
        code = experiments_main(run_argv(args, mode, scheme))
        row = {"scheme": scheme, "status": "ok" if code == 0 else f"failed (exit {code})",
               "captures": str(Path(args.tensor_dir) / scheme), "run_dir": _run_dir(args, scheme)}
        if code == 0 and not args.dry_run:
            try:
                row.update(count_patterns(Path(row["captures"])))
            except (ValueError, FileNotFoundError) as exc:  # CaptureReadError is a ValueError
                row["status"] = f"unreadable: {exc}"
            if args.export_pt is not None and row["status"] == "ok":
                from fxquant.cli import main as fxquant_main

                if fxquant_main(["capture", "export-pt", row["captures"], args.export_pt]) != 0:
                    row["status"] = "export-pt failed"
        rows.append(row)
    if args.dry_run:
        return 0 if all(r["status"] == "ok" for r in rows) else 1
    cols = ["records", "tensors", *[n for n, _, _ in PATTERNS]]
    table = tabulate([[r["scheme"], r["status"], *[r.get(c, "") for c in cols],
                       f"{r['bytes'] / 1e6:.2f}" if "bytes" in r else ""] for r in rows],
                     headers=["scheme", "status", *cols, "MB"])
    root = Path(args.tensor_dir)
    root.mkdir(parents=True, exist_ok=True)
    summary = {"mode": mode, "control_iter": 1 if mode == "quick" else args.control_iter, "model": args.model,
               "variant": args.variant, "dataset": args.dataset, "runs": rows}
    (root / "collection_summary.json").write_text(json.dumps(summary, indent=2))
    (root / "collection_summary.txt").write_text(table + "\n")
    print(table)
    ok = sum(r["status"] == "ok" for r in rows)
    print(f"{ok}/{len(rows)} collections ok; {sum(r.get('records', 0) for r in rows)} records under {root} "
          f"(summary {root / 'collection_summary.json'}; `fxquant draw visualize --tensor-dir {root}` reports on them)")
    return 0 if ok == len(rows) else 1
