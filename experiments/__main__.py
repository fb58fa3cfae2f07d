"""`python -m experiments list | run | matrix` (see docs/megatron.md)."""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

from tabulate import tabulate

from experiments import catalog, compare
from experiments.launcher import resolve, supervise
from fxquant.capture import compat
from fxquant.megatron_glue.run_config import capture_from_args


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="cpu", help="training config: " + ", ".join(catalog.CONFIGS))
    p.add_argument("--variant", default="tiny", choices=["tiny", "full"], help="model size (default tiny)")
    p.add_argument("--capture", metavar="SPEC", help="capture during training: a shipped spec name (predecessor, "
                   "linear_io, stats_only) or a spec YAML path; captures go to RUN_DIR/captures (or --tensor-save-dir)")
    p.add_argument("--nproc", type=int, default=1, help="processes (torchrun --nproc-per-node)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--out", default="runs", help="root of run directories (default ./runs)")
    p.add_argument("--tokenizer", help="local HuggingFace tokenizer dir (required for --variant full) or 'byte'")
    p.add_argument("--data-prefix", help="indexed dataset prefix (overrides $FXQUANT_WIKIPEDIA_PREFIX / $FXQUANT_DOLMA_PREFIX)")
    p.add_argument("--iters", type=int, help="override the config's train_iters")
    p.add_argument("--eval-interval", type=int, help="validation loss every N iterations (0 = off; default: config's)")
    p.add_argument("--eval-iters", type=int, help="global batches of the validation split per evaluation")
    p.add_argument("--backend", default="aot_eager", choices=["inductor", "aot_eager", "eager", "none"])
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "local"])
    compat.add_arguments(p)  # --save-tensors, --tensor-save-dir, --control-iter (stop after N iterations)
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard event files to <run>/tensorboard (needs the tensorboard package)")
    p.add_argument("--on-nonfinite", default="record", choices=["record", "fatal", "off"],
                   help="NaN/Inf sentinel: record the first non-finite iteration and its parameters in "
                        "<run>/nonfinite.json and the metrics (default), also stop the run (fatal), or off")
    p.add_argument("--collect-micro-batches", type=int, metavar="M",
                   help="with --save-tensors: capture micro-batches 0..M-1 of each collected iteration (default all)")


def _resolve(args, model, dataset, scheme, per_run_capture_dir: bool = False):
    capture = capture_from_args(args)
    if per_run_capture_dir and capture is not None and capture.dir is not None:  # matrix: one root per run
        capture = replace(capture, dir=str(Path(capture.dir) / model / dataset / scheme))
    return resolve(model=model, dataset=dataset, scheme=scheme, config=args.config, variant=args.variant,
                   capture=capture, nproc=args.nproc, tp=args.tp, pp=args.pp, out=args.out,
                   tokenizer=args.tokenizer, data_prefix=args.data_prefix, iters=args.iters,
                   backend=args.backend, attention=args.attention, control_iter=args.control_iter,
                   eval_interval=args.eval_interval, eval_iters=args.eval_iters, tensorboard=args.tensorboard,
                   nonfinite=args.on_nonfinite)


def cmd_list(args) -> int:
    rows = [(n, "full", m.num_layers, m.hidden_size, m.num_attention_heads, f"{m.num_parameters() / 1e9:.2f}B")
            for n, m in catalog.MODELS.items()]
    rows += [(n, "tiny", m.num_layers, m.hidden_size, m.num_attention_heads, f"{m.num_parameters() / 1e6:.2f}M")
             for n, m in catalog.TINY.items()]
    print(tabulate(rows, headers=["model", "variant", "layers", "hidden", "heads", "params"]))
    print()
    print(tabulate([(n, c.seq_length, c.micro_batch_size, c.global_batch_size, c.train_iters, c.optim.lr)
                    for n, c in catalog.CONFIGS.items()], headers=["config", "seq", "mbs", "gbs", "iters", "lr"]))
    print()
    print("datasets:", ", ".join(f"{d.name} (${d.env})" if d.env else d.name for d in catalog.DATASETS.values()))
    print("predecessor schemes:", ", ".join(catalog.PREDECESSOR_SCHEMES))
    print(f"all schemes ({len(catalog.scheme_names())}): see `fxquant explain` / fxquant.schemes.names()")
    return 0


def cmd_run(args) -> int:
    launch = _resolve(args, args.model, args.dataset, args.scheme)
    if args.dry_run:
        print(launch.shell())
        print(json.dumps(launch.run.to_dict(), indent=2))
        return 0
    outcome = supervise(launch, args.timeout)
    print(f"{outcome.status} in {outcome.seconds:.0f}s; log {outcome.log}; metrics "
          f"{Path(launch.run.output_dir) / 'metrics.jsonl'}")
    if launch.run.capture is not None:
        print(f"captures: {launch.run.capture.root(launch.run.output_dir)} (spec {launch.run.capture.spec}; "
              f"`fxquant capture ls` / `fxquant report` read it)")
    return 0 if outcome.status == "ok" else 1


def cmd_matrix(args) -> int:
    out = Path(args.out)
    combos = list(itertools.product(args.models, args.datasets, args.schemes))
    rows, records = [], []
    for model, dataset, scheme in combos:
        name = f"{model}/{dataset}/{scheme}"
        try:
            launch = _resolve(args, model, dataset, scheme, per_run_capture_dir=True)
        except (ValueError, TypeError, FileNotFoundError) as exc:
            records.append({"run": name, "status": "refused", "error": str(exc)})
            print(f"[refused] {name}: {exc}", flush=True)
            continue
        if args.dry_run:
            print(launch.shell())
            records.append({"run": name, "status": "dry-run", "run_dir": launch.run.output_dir})
            continue
        print(f"[start] {name}", flush=True)
        outcome = supervise(launch, args.timeout, echo=False)
        losses = compare.read_losses(Path(launch.run.output_dir) / "metrics.jsonl")
        val_losses = compare.read_losses(Path(launch.run.output_dir) / "metrics.jsonl", key="val_loss")
        records.append({"run": name, "model": model, "dataset": dataset, "scheme": scheme, "status": outcome.status,
                        "seconds": round(outcome.seconds, 1), "iterations": len(losses),
                        "final_loss": losses[-1] if losses else None,
                        "final_val_loss": val_losses[-1] if val_losses else None, "run_dir": launch.run.output_dir,
                        "captures": (str(launch.run.capture.root(launch.run.output_dir))
                                     if launch.run.capture is not None else None),
                        "log": str(outcome.log)})
        print(f"[{outcome.status}] {name} in {outcome.seconds:.0f}s", flush=True)
    comparison = compare.against_bf16(records, last_n=args.last_n)
    for r in records:
        rows.append((r["run"], r["status"], r.get("iterations", ""), r.get("final_loss", ""), r.get("final_val_loss", ""),
                     comparison.get(r["run"], {}).get("mre_all", ""), comparison.get(r["run"], {}).get("mre_last", "")))
    out.mkdir(parents=True, exist_ok=True)
    summary = {"runs": records, "loss_vs_bf16": comparison, "last_n": args.last_n}
    (out / "matrix_summary.json").write_text(json.dumps(summary, indent=2))
    table = tabulate(rows, headers=["run", "status", "iters", "final loss", "val loss", "MRE vs bf16", f"MRE last {args.last_n}"])
    (out / "matrix_summary.txt").write_text(table + "\n")
    print(table)
    plot = compare.plot_curves(records, out / "loss_curves.svg")
    print(f"summary: {out / 'matrix_summary.json'}, {out / 'matrix_summary.txt'}" + (f", {plot}" if plot else ""))
    failed = [r for r in records if r["status"] not in ("ok", "dry-run")]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="models, configs, datasets, schemes").set_defaults(func=cmd_list)
    run = sub.add_parser("run", help="one training run (torchrun)")
    run.add_argument("--model", required=True)
    run.add_argument("--dataset", default="mock")
    run.add_argument("--scheme", default="bf16")
    run.add_argument("--dry-run", action="store_true", help="print the torchrun command and resolved config only")
    run.add_argument("--timeout", type=float, default=3600.0)
    _common(run)
    run.set_defaults(func=cmd_run)
    matrix = sub.add_parser("matrix", help="a sweep of models x datasets x schemes, supervised")
    matrix.add_argument("--models", nargs="+", default=list(catalog.MODELS))
    matrix.add_argument("--datasets", nargs="+", default=["mock"])
    matrix.add_argument("--schemes", nargs="+", default=list(catalog.PREDECESSOR_SCHEMES))
    matrix.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    matrix.add_argument("--last-n", type=int, default=10, help="iterations in the 'last N' relative error")
    matrix.add_argument("--dry-run", action="store_true")
    _common(matrix)
    matrix.set_defaults(func=cmd_matrix)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"experiments {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
