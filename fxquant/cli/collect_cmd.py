"""`fxquant collect`: the predecessor's `run_tensor_collection.sh` (modes single / batch / quick).

A thin command over `python -m experiments run`: each collection is one supervised training run of a
Megatron model with the predecessor's capture switch (`--save-tensors --tensor-save-dir DIR --control-iter N
[--collect-micro-batches M]`; experiments run writes DIR/SCHEME), so captures land in the predecessor's
layout, one capture set per quant type under DIR. Afterwards it counts the records of each set per pattern (the
predecessor counted files matching *_forward_*, *_pre_*, *_FA_*, ...) and appends the collection to the
summary (DIR/collection_summary.{json,txt}; earlier collections are kept). What runs: collect_plan.py.

    fxquant collect single mxfp8 --control-iter 3 --collect-micro-batches 2
    fxquant collect batch                      # bf16, FA_linear_mxfp8, FA_linear_mxfp4, FA_linear_hifp8
    fxquant collect batch --legacy             # what the predecessor computed for them: legacy_bf16, legacy_FA_linear_*
    fxquant collect batch --quant-types FA_mxfp8 linear_mxfp8 FA_PV_mxfp8   # any schemes
    fxquant collect quick hifp8                # one iteration, one micro-batch
    fxquant collect single my_scheme.yaml      # a scheme YAML, collected under its name
    fxquant collect single hifp8 --export-pt ./pt_logs   # also the predecessor's .pt files
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import io
import os
import sys
from pathlib import Path

from fxquant.cli import collect_plan, collect_summary
from fxquant.cli.collect_plan import MODES
from fxquant.cli.options import positive_int, positive_seconds

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
    p.add_argument("mode_arg", nargs="?", metavar="MODE", help=f"{' | '.join(modes)} (or --mode)")
    p.add_argument("quant_type_arg", nargs="?", metavar="QUANT_TYPE", help="quant type (or --quant-type)")
    p.add_argument("--mode", choices=modes, default=None, help=f"{' | '.join(modes)} (default {modes[0]})")
    default = "mxfp8 for single, hifp8 for quick" if "quick" in modes else "mxfp8"  # draw collects as `single`
    p.add_argument("--quant-type", default=None, metavar="Q",
                   help="bf16 | mxfp8 | mxfp4 | hifp8 (the FA_linear_ scheme of that format), a scheme name or a "
                        f"scheme YAML path (default: $CUSTOM_QUANT_TYPE, else {default})")
    if "batch" in modes:  # `fxquant draw` collects one quant type (its modes have no batch)
        p.add_argument("--quant-types", nargs="+", default=None, metavar="Q",
                       help="batch: the quant types, scheme names or scheme YAML paths to collect (default: the "
                            "predecessor's four quant types bf16 mxfp8 mxfp4 hifp8)")
    else:
        p.set_defaults(quant_types=None)
    p.add_argument("--legacy", action="store_true",
                   help="reproduce what the predecessor computed: quant type X -> legacy_FA_linear_X, scheme "
                        "name N -> legacy_N (docs/schemes.md 'legacy presets'); default off")
    p.add_argument("--control-iter", type=positive_int, default=1, metavar="N",
                   help="iterations to collect, then stop (N >= 1; default 1)")
    p.add_argument("--collect-micro-batches", "--control-micro-batches", dest="collect_micro_batches",
                   type=positive_int, default=None, metavar="M",
                   help="micro-batches 0..M-1 of each iteration (default all; quick: 1)")
    p.add_argument("--tensor-save-dir", "--tensor-dir", "--tensor-path", dest="tensor_dir", default=DEFAULT_DIR, metavar="DIR",
                   help=f"captures go to DIR/<scheme>/ (default {DEFAULT_DIR})")
    p.add_argument("--export-pt", default=None, metavar="OUT",
                   help="also write the predecessor's .pt files of each collection to OUT/<scheme>/ "
                        "(fxquant capture export-pt; torch.load(weights_only=True)); default off")
    p.add_argument("--capture", "--spec", dest="spec", default=None, metavar="SPEC",
                   help="capture spec: a shipped spec name or a spec YAML path (default: the shipped 'predecessor')")
    p.add_argument("--model", default="llama32-1b",
                   help="experiments model, see `python -m experiments list` (default llama32-1b, the predecessor's)")
    p.add_argument("--variant", default="tiny", choices=["tiny", "full"], help="model size (default tiny)")
    p.add_argument("--dataset", default="mock",
                   help="mock | wikipedia | dolma (default mock; wikipedia / dolma read an indexed dataset built by "
                        "`fxquant prepare-data --dataset NAME`)")
    p.add_argument("--config", default="cpu", help="training config: cpu | fast | standard (default cpu)")
    p.add_argument("--out", default="runs/collect", metavar="DIR", help="root of the run directories (default ./runs/collect)")
    p.add_argument("--tokenizer", "--tokenizer-path", dest="tokenizer", default=None, metavar="DIR",
                   help="local HuggingFace tokenizer dir or 'byte' (default byte; --variant full needs a dir)")
    p.add_argument("--data-prefix", "--data-path", dest="data_prefix", default=None, metavar="PREFIX",
                   help="indexed dataset prefix of --dataset (default $FXQUANT_<DATASET>_PREFIX, else "
                        "data/<dataset>/<dataset>_text_document)")
    p.add_argument("--dtype", default=None, metavar="DTYPE",
                   help="the predecessor's training dtype: bf16 | fp32, passed as `experiments run --precision` "
                        "(default: bf16 on CUDA, fp32 on CPU); formats are chosen by quant type, not here")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="processes (torchrun --nproc-per-node; default tp*pp, as `experiments run`)")
    p.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, metavar="P", help="pipeline-parallel size (default 1)")
    p.add_argument("--backend", default="aot_eager", choices=["inductor", "aot_eager", "eager"],
                   help="torch.compile backend (default aot_eager; no 'none': capture needs the compiled graph)")
    p.add_argument("--attention", default="local", choices=["sdpa", "local"],
                   help="default local (unlike `experiments run`): Megatron's unfused attention materialises the "
                        "attention probabilities the predecessor captured")
    p.add_argument("--timeout", type=positive_seconds, default=3600.0, metavar="S",
                   help="per run, seconds (default 3600)")
    p.add_argument("--dry-run", action="store_true", help="print the runs' commands and configurations only (default off)")


def run_argv(args: argparse.Namespace, mode: str, collection: collect_plan.Collection) -> list[str]:
    """`python -m experiments run` arguments of one collection."""
    argv = ["run", "--model", args.model, "--variant", args.variant, "--dataset", args.dataset,
            "--scheme", collection.scheme_arg, "--config", args.config, "--out", args.out,
            *(["--nproc", str(args.nproc)] if args.nproc is not None else []),
            "--tp", str(args.tp), "--pp", str(args.pp), "--backend", args.backend, "--attention", args.attention,
            "--timeout", str(args.timeout), "--save-tensors", "--tensor-save-dir", str(args.tensor_dir)]
    control_iter, micro_batches = args.control_iter, args.collect_micro_batches
    if mode == "quick":
        control_iter, micro_batches = 1, 1 if micro_batches is None else micro_batches
        argv += ["--iters", "1", "--eval-interval", "0"]
    argv += ["--control-iter", str(control_iter)]
    if micro_batches is not None:
        argv += ["--collect-micro-batches", str(micro_batches)]
    precision = collect_plan.precision_for(args.dtype)
    for flag, value in (("--capture", args.spec), ("--tokenizer", args.tokenizer),
                        ("--data-prefix", args.data_prefix), ("--precision", precision)):
        if value is not None:
            argv += [flag, value]
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
    from experiments.__main__ import main as experiments_main

    mode, planned, notes = collect_plan.plan(args, dict(os.environ))
    for note in notes:
        print(f"[collect {mode}] {note}", flush=True)
    for c in planned:  # every run resolved first: a refused one (names, layout, data, tokenizer) stops all
        with contextlib.redirect_stdout(io.StringIO()):
            code = experiments_main([*run_argv(args, mode, c), *([] if args.dry_run else ["--dry-run"])])
        if code != 0:
            print(f"fxquant collect: {c.scheme}: refused before any run started (experiments run's error above)",
                  file=sys.stderr)
            return 2
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for c in planned:
        print(f"[collect {mode}] {c.scheme} -> {Path(args.tensor_dir) / c.scheme}", flush=True)
        row = {"scheme": c.scheme, "captures": str(Path(args.tensor_dir) / c.scheme),
               "run_dir": _run_dir(args, c.scheme)}
        if c.scheme_arg != c.scheme:  # a scheme YAML: its text as collected, whatever the file becomes
            row["scheme_file"], row["scheme_text"] = c.scheme_arg, Path(c.scheme_arg).read_text()
        try:
            code = experiments_main(run_argv(args, mode, c))
        except (SystemExit, KeyboardInterrupt):  # interrupted (experiments exits 128 + signal): keep what finished
            if not args.dry_run:
                rows.append({**row, "status": "interrupted"})
                _summarise(args, mode, started, notes, rows)
            raise
        row["status"] = "ok" if code == 0 else f"failed (exit {code})"
        if code == 0 and not args.dry_run:
            try:
                row.update(count_patterns(Path(row["captures"])))
            except (ValueError, FileNotFoundError) as exc:  # CaptureReadError is a ValueError
                row["status"] = f"unreadable: {exc}"
            if args.export_pt is not None and row["status"] == "ok":
                from fxquant.cli import main as fxquant_main

                # --replace: this collection's captures replaced the earlier ones of its scheme, so do its .pt files
                if fxquant_main(["capture", "export-pt", row["captures"], args.export_pt, "--replace"]) != 0:
                    row["status"] = "export-pt failed"
        rows.append(row)
    if args.dry_run:
        return 0 if all(r["status"] == "ok" for r in rows) else 1
    return _summarise(args, mode, started, notes, rows)


def _summarise(args: argparse.Namespace, mode: str, started: str, notes: list[str], rows: list[dict]) -> int:
    """Append the collection (its runs so far) to DIR/collection_summary.{json,txt} and print its table."""
    from tabulate import tabulate

    cols = ["records", "tensors", *[n for n, _, _ in PATTERNS]]
    table = tabulate([[r["scheme"], r["status"], *[r.get(c, "") for c in cols],
                       f"{r['bytes'] / 1e6:.2f}" if "bytes" in r else ""] for r in rows],
                     headers=["scheme", "status", *cols, "MB"])
    root = Path(args.tensor_dir)
    collection = {"mode": mode, "started": started, "legacy": args.legacy,
                  "control_iter": 1 if mode == "quick" else args.control_iter, "model": args.model,
                  "variant": args.variant, "dataset": args.dataset, "notes": notes, "runs": rows}
    number = collect_summary.append(root, collection, table)
    print(table)
    ok = sum(r["status"] == "ok" for r in rows)
    print(f"{ok}/{len(rows)} collections ok; {sum(r.get('records', 0) for r in rows)} records under {root} "
          f"(collection {number} in {root / collect_summary.JSON_NAME}; `fxquant draw visualize --tensor-dir {root}` "
          f"reports on every collection there)")
    return 0 if ok == len(rows) else 1
