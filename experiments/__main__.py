"""`python -m experiments list | run | matrix` (see docs/megatron.md)."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

from tabulate import tabulate

from experiments import catalog, compare
from experiments.launcher import Interrupted, interruptible, resolve, run_device, supervise
from fxquant.analysis import outputs
from fxquant.capture import compat
from fxquant.cli import HelpFormatter, quiet_broken_pipe
from fxquant.cli.collect_plan import collection_for
from fxquant.cli.options import positive_int, positive_seconds
from fxquant.megatron_glue.config import AttentionKind
from fxquant.lowering import Kernels
from fxquant.megatron_glue.run_config import DEFAULT_CAPTURE_SUBDIR, CompileBackend, capture_from_args


CUSTOM_QUANT_TYPE = "CUSTOM_QUANT_TYPE"  # the predecessor's environment variable naming a run's quant type


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="cpu", help="training config: " + ", ".join(catalog.CONFIGS))
    p.add_argument("--variant", default="tiny", choices=["tiny", "full"],
                   help="model size: tiny (the same structure, trains on 2 CPU cores) or full (the published one)")
    p.add_argument("--capture", metavar="SPEC", default=None,
                   help="capture during training: a shipped spec name (predecessor, linear_io, stats_only, attention_maps) or a spec "
                   "YAML path; captures go to RUN_DIR/captures, or to --tensor-save-dir (one subdirectory per run); "
                   "default: no capture (predecessor with --save-tensors)")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes (torchrun --nproc-per-node); default tp*pp (data-parallel size 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--out", default="runs", help="root of the run directories (OUT/<model name>/<dataset>/<scheme>; the tiny variant's "
                   "model name ends in -tiny)")
    p.add_argument("--tokenizer", default=None,
                   help="local HuggingFace tokenizer dir (required for --variant full) or 'byte' (default for tiny)")
    p.add_argument("--data-prefix", nargs="+", metavar="[DATASET=]PREFIX",
                   help="indexed dataset prefix per dataset, e.g. wikipedia=data/wiki/wiki_text_document "
                        "dolma=data/dolma/dolma_text_document (a bare PREFIX when one indexed dataset is named); default "
                        "$FXQUANT_WIKIPEDIA_PREFIX / $FXQUANT_DOLMA_PREFIX, else data/<dataset>/<dataset>_text_document")
    p.add_argument("--iters", type=int, default=None, help="training iterations (default: the config's train_iters); "
                   "the config's warm-up is clipped to iters - 1")
    p.add_argument("--save-interval", type=int, default=None,
                   help="checkpoint every N iterations and at the end, and resume from the run directory's checkpoint "
                   "(0 = no checkpoints; default: the config's, which is 0 for cpu and fast: a rerun then trains "
                   "again from iteration 0)")
    p.add_argument("--eval-interval", type=int, default=None,
                   help="validation loss every N iterations and at the end (0 = off; default: the config's)")
    p.add_argument("--eval-iters", type=int, default=None,
                   help="global batches of the validation split per evaluation (default: the config's)")
    p.add_argument("--backend", default="aot_eager", choices=[b.value for b in CompileBackend],
                   help="torch.compile backend after fxquant's passes; eager: the rewritten graph interpreted; "
                   "none: no torch.compile (bf16 without capture only)")
    p.add_argument("--kernels", default="auto", choices=[k.value for k in Kernels],
                   help="what the quantize ops run: inductor (fused into Inductor's kernels; with --backend "
                   "inductor), triton (standalone kernels, CUDA), reference, auto (docs/compile.md)")
    p.add_argument("--attention", default="sdpa", choices=[a.value for a in AttentionKind],
                   help="Megatron's core attention: sdpa (F.scaled_dot_product_attention) or local (the unfused "
                   "baddbmm/softmax/bmm the predecessor quantized)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="parameters and activations: auto = bf16 on CUDA, fp32 on CPU")
    compat.add_arguments(p)  # --save-tensors, --tensor-save-dir, --control-iter
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard event files to <run>/tensorboard (needs the tensorboard package)")
    p.add_argument("--on-nonfinite", default="record", choices=["record", "fatal", "off"],
                   help="NaN/Inf sentinel: record the first non-finite iteration and its parameters in "
                        "<run>/nonfinite.json and the metrics (default), also stop the run (fatal), or off")
    p.add_argument("--collect-micro-batches", type=int, metavar="M", default=None,
                   help="with --save-tensors: capture micro-batches 0..M-1 of each collected iteration (default all)")


def _resolve(args, model, dataset, scheme, capture_per_run: bool = False):
    return resolve(model=model, dataset=dataset, scheme=scheme, config=args.config, variant=args.variant,
                   capture=capture_from_args(args), nproc=args.nproc, tp=args.tp, pp=args.pp, out=args.out,
                   tokenizer=args.tokenizer, iters=args.iters,
                   data_prefix=catalog.data_prefixes(args.data_prefix, getattr(args, "datasets", [dataset])).get(dataset),
                   backend=args.backend, attention=args.attention, control_iter=args.control_iter,
                   eval_interval=args.eval_interval, eval_iters=args.eval_iters, save_interval=args.save_interval,
                   capture_per_run=capture_per_run,
                   precision=args.precision, tensorboard=args.tensorboard, nonfinite=args.on_nonfinite,
                   kernels=args.kernels)


def _run_scheme(args) -> str:
    """--scheme; else the predecessor's CUSTOM_QUANT_TYPE (a quant type bf16/mxfp8/mxfp4/hifp8 means its
    FA_linear_ scheme, as in `fxquant collect`; or a scheme name); else bf16. The flag wins over the
    environment, as for the other predecessor controls, and the console says so."""
    env = os.environ.get(CUSTOM_QUANT_TYPE, "").strip() or None
    if env is None:
        return args.scheme or "bf16"
    if args.scheme is not None:
        print(f"note: --scheme {args.scheme} given; {CUSTOM_QUANT_TYPE}={env} is not used", file=sys.stderr)
        return args.scheme
    scheme = collection_for(env).scheme_arg
    print(f"scheme {scheme} (from {CUSTOM_QUANT_TYPE}={env})", file=sys.stderr)
    return scheme


def _replacing_note(launch) -> str | None:
    """A console note when this run will replace captures an earlier run left where it writes, or (run without
    --capture) leaves them beside metrics they do not belong to."""
    if launch.run.capture is None:
        root = Path(launch.run.output_dir) / DEFAULT_CAPTURE_SUBDIR
        if root.is_dir() and any(root.glob("rank-*")):
            return (f"note: {root} holds an earlier run's captures; this run captures nothing and leaves them, so "
                    f"they do not belong to its metrics (remove them, or capture with --capture)")
        return None
    root = launch.run.capture.root(launch.run.output_dir)
    earlier = sorted(root.glob("rank-*")) if root.is_dir() else []
    if not earlier:
        return None
    return (f"note: {root} holds an earlier run's captures ({len(earlier)} rank(s)); this run replaces them "
            f"when it starts at iteration 0 (a resumed run appends)")


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
    print(f"all schemes ({len(catalog.scheme_names())} presets, or a scheme YAML path): `fxquant schemes` lists them")
    return 0


def _checkpoint_mismatch(launch) -> str | None:
    """Why the checkpoint in the cell's run directory belongs to another experiment (another parallel layout or other
    run settings, as the rank's resume would refuse it), or None: a finished one would be reported as this cell's
    result, an unfinished one would fail the cell after it started."""
    import torch

    from fxquant.megatron_glue import checkpoint

    if not launch.run.resume:
        return None
    run, root = launch.run, Path(launch.run.output_dir) / "checkpoints"
    layout = checkpoint.expected_layout(launch.nproc, run.layout.tp, run.layout.pp, run.layout.ep)
    try:
        differences = checkpoint.mismatch(root, layout=layout,
                                          settings=checkpoint.run_settings(run, run.train.bf16_on(torch.device(run_device()))))
    except (ValueError, OSError, RuntimeError):  # a corrupt marker or file: the cell's rank names it when it resumes
        return None
    if not differences:
        return None
    return (f"its run directory's checkpoint ({root}) is of another run ({'; '.join(differences)}); write this "
            f"matrix somewhere else (another --out), or delete {root} to run the cell again from iteration 0")


def _finished_at(launch) -> int | None:
    """The iteration of the cell's checkpoint when the run it describes already finished (its run directory holds a
    checkpoint at or past ``train_iters`` and the run resumes from checkpoints): a run launched again would train
    nothing and fail ("nothing to train")."""
    from fxquant.megatron_glue.checkpoint import latest_iteration

    if not launch.run.resume:
        return None
    try:
        done = latest_iteration(Path(launch.run.output_dir) / "checkpoints")
    except ValueError:  # a corrupt marker: the cell is launched, and its rank names the problem
        return None
    return done if done is not None and done >= launch.run.train.train_iters else None


def written_since(path: Path, since: float) -> Path | None:
    """``path`` if it exists, holds something and was written at or after ``since`` (a time.time()), else None: a
    run that failed or timed out before writing its metrics leaves an earlier run's file in its directory, or the
    empty one a fresh run starts with."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return path if stat.st_size > 0 and stat.st_mtime >= since - 1.0 else None  # 1 s: file times use a coarser clock


def cmd_run(args) -> int:
    launch = _resolve(args, args.model, args.dataset, _run_scheme(args))
    if args.dry_run:
        print(launch.shell())
        print(json.dumps(launch.run.to_dict(), indent=2))
        return 0
    note = _replacing_note(launch)
    if note:
        print(note, flush=True)
    started = time.time()
    outcome = supervise(launch, args.timeout)
    metrics = written_since(Path(launch.run.output_dir) / "metrics.jsonl", started)
    log = written_since(outcome.log, started)
    print(f"{outcome.status} in {outcome.seconds:.0f}s" + (f"; log {log}" if log is not None else "") +
          (f"; metrics {metrics}" if metrics is not None else ""))
    if outcome.status == "failed":
        print(f"error: {outcome.error or f'exit status {outcome.returncode}, no error line in the log'}" +
              (f" (full output: {log})" if log is not None else ""), file=sys.stderr)
    if launch.run.capture is not None and launch.run.capture.root(launch.run.output_dir).is_dir():
        print(f"captures: {launch.run.capture.root(launch.run.output_dir)} (spec {launch.run.capture.spec}; "
              f"`fxquant capture ls` / `fxquant report` read it)")
    return 0 if outcome.status == "ok" else 1


def cmd_matrix(args) -> int:
    if os.environ.get(CUSTOM_QUANT_TYPE, "").strip():
        print(f"note: a matrix runs --schemes; {CUSTOM_QUANT_TYPE}={os.environ[CUSTOM_QUANT_TYPE].strip()} is not "
              f"used", file=sys.stderr)
    out = Path(args.out)
    catalog.data_prefixes(args.data_prefix, args.datasets)  # refused once here, not once per run
    combos = list(itertools.product(args.models, args.datasets, args.schemes))
    twice = sorted({"/".join(c) for c in combos if combos.count(c) > 1})
    if twice:  # both would write one run directory
        print(f"error: run(s) given more than once: {', '.join(twice)}; each cell runs once", file=sys.stderr)
        return 2
    rows, records, launches = [], [], []
    for model, dataset, scheme in combos:  # every cell resolved before any runs: a typo costs no training time
        name = f"{model}/{dataset}/{scheme}"
        try:
            launches.append((name, model, dataset, scheme, _resolve(args, model, dataset, scheme, capture_per_run=True)))
        except (ValueError, TypeError, FileNotFoundError) as exc:
            records.append({"run": name, "status": "refused", "error": str(exc)})
            print(f"[refused] {name}: {exc}", flush=True)
    by_dir: dict[str, list[str]] = {}
    for name, *_, launch in launches:
        by_dir.setdefault(str(Path(launch.run.output_dir).resolve()), []).append(name)
    for run_dir, names in by_dir.items():  # e.g. two scheme files of one name in different directories
        if len(names) > 1:
            msg = f"{' and '.join(names)} resolve to one run directory, {run_dir}: each would overwrite the other's"
            records.append({"run": names[-1], "status": "refused", "error": msg + "; give the schemes distinct names"})
            print(f"[refused] {msg}; give the schemes distinct names (a scheme YAML's `name:`)", flush=True)
    for name, *_, launch in launches:  # a checkpoint of another experiment would be taken for this cell's
        why = _checkpoint_mismatch(launch)
        if why:
            records.append({"run": name, "status": "refused", "error": why})
            print(f"[refused] {name}: {why}", flush=True)
    if args.dry_run:  # nothing written: the commands and the refusals are the whole answer
        for name, *_, launch in launches:
            print(launch.shell())
        print(f"{len(launches)} run(s) resolved, {len(records)} refused (each command reads its run's launch.json, "
              "which the matrix writes when it runs the cell; `experiments run ... --dry-run` prints a cell's config)")
        return 1 if records else 0
    if records:
        print(f"error: {len(records)} of {len(combos)} run(s) refused (above); nothing was run", file=sys.stderr)
        return 1
    interrupted = None
    for _, model, dataset, scheme, launch in launches:
        name = f"{model}/{dataset}/{launch.run.scheme}"  # a scheme file's cell is named by its scheme, as its run dir
        record = {"run": name, "model": model, "dataset": dataset, "scheme": launch.run.scheme,
                  **({"scheme_file": scheme} if launch.run.scheme != scheme else {}),
                  "run_dir": launch.run.output_dir,
                  "captures": (str(launch.run.capture.root(launch.run.output_dir))
                               if launch.run.capture is not None else None)}
        done_at = _finished_at(launch)
        if done_at is not None:  # a rerun of the matrix (or one resumed after an interruption): not trained again
            metrics = Path(launch.run.output_dir) / "metrics.jsonl"
            losses, val_losses = compare.read_losses(metrics), compare.read_losses(metrics, key="val_loss")
            records.append({**record, "status": "ok", "finished_earlier": True, "iterations": len(losses),
                            "final_loss": losses[-1] if losses else None,
                            "final_val_loss": val_losses[-1] if val_losses else None})
            print(f"[done] {name}: finished earlier (its checkpoint is at iteration {done_at}); not run again",
                  flush=True)
            continue
        print(f"[start] {name}", flush=True)
        started = time.time()
        try:  # progress per iteration
            outcome = supervise(launch, args.timeout, echo=("iter ", "resumed from "), prefix=f"  {name} ")
        except OSError as exc:  # its run directory cannot be written: this cell fails, the sweep goes on
            records.append({**record, "status": "failed", "seconds": round(time.time() - started, 1),
                            "error": str(exc)})
            print(f"[failed] {name}: {exc}", flush=True)
            continue
        except Interrupted as exc:  # the job is stopped; the cells run so far are summarised, then the command ends
            records.append({**record, "status": "interrupted", "seconds": round(time.time() - started, 1),
                            "log": str(exc.log)})
            print(f"[interrupted] {name}", flush=True)
            interrupted = exc
            break
        metrics = written_since(Path(launch.run.output_dir) / "metrics.jsonl", started)  # not an earlier run's
        losses = [] if metrics is None else compare.read_losses(metrics)
        val_losses = [] if metrics is None else compare.read_losses(metrics, key="val_loss")
        records.append({**record, "status": outcome.status, "seconds": round(outcome.seconds, 1),
                        "iterations": len(losses), "final_loss": losses[-1] if losses else None,
                        "final_val_loss": val_losses[-1] if val_losses else None, "log": str(outcome.log)})
        if outcome.status == "failed":
            records[-1]["error"] = outcome.error
        print(f"[{outcome.status}] {name} in {outcome.seconds:.0f}s" +
              (f": {outcome.error} (log {outcome.log})" if outcome.status == "failed" and outcome.error else ""),
              flush=True)
    comparison = compare.against_bf16(records, last_n=args.last_n)
    for r in records:
        if r.get("status") == "ok" and r["scheme"] != "bf16" and r["run"] not in comparison:
            print(f"note: {r['run']} is not compared: no bf16 run of {r['model']}/{r['dataset']} in this matrix or "
                  f"beside its run directory", flush=True)
    for r in records:
        rows.append((r["run"], r["status"], r.get("iterations", ""), r.get("final_loss", ""), r.get("final_val_loss", ""),
                     comparison.get(r["run"], {}).get("mre_all", ""), comparison.get(r["run"], {}).get("mre_last", "")))
    out.mkdir(parents=True, exist_ok=True)
    summary = {"runs": records, "loss_vs_bf16": comparison, "last_n": args.last_n}
    # strict JSON as fxquant report writes it (a diverged run's NaN loss null, its inf error "inf")
    (out / "matrix_summary.json").write_text(json.dumps(outputs.clean(summary), indent=2, allow_nan=False))
    table = tabulate(rows, headers=["run", "status", "iters", "final loss", "val loss", "MRE vs bf16", f"MRE last {args.last_n}"])
    (out / "matrix_summary.txt").write_text(table + "\n")
    print(table)
    plot = compare.plot_curves(records, out / "loss_curves.svg")
    if plot is None:  # no run finished: an earlier matrix's figure must not stand beside this summary
        (out / "loss_curves.svg").unlink(missing_ok=True)
    print(f"summary: {out / 'matrix_summary.json'}, {out / 'matrix_summary.txt'}" + (f", {plot}" if plot else ""))
    if interrupted is not None:
        raise interrupted
    failed = [r for r in records if r["status"] != "ok"]
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="models, configs, datasets, schemes", formatter_class=HelpFormatter).set_defaults(func=cmd_list)
    run = sub.add_parser("run", help="one training run (torchrun)", formatter_class=HelpFormatter)
    run.add_argument("--model", required=True, help="model: " + ", ".join(catalog.MODELS))
    run.add_argument("--dataset", default="mock", help="dataset: " + ", ".join(catalog.DATASETS))
    run.add_argument("--scheme", default=None, help="a preset name (`fxquant schemes` lists them) or a scheme YAML "
                     f"path; default: ${CUSTOM_QUANT_TYPE} (the predecessor's: bf16, mxfp8, mxfp4, hifp8 mean "
                     "bf16 and FA_linear_<type>, or a scheme name), else bf16")
    run.add_argument("--dry-run", action="store_true",
                     help="print the torchrun command and the resolved config; start and write nothing")
    run.add_argument("--timeout", type=positive_seconds, default=3600.0, help="seconds before the run's processes are killed")
    _common(run)
    run.set_defaults(func=cmd_run)
    matrix = sub.add_parser("matrix", help="a sweep of models x datasets x schemes, supervised", formatter_class=HelpFormatter)
    matrix.add_argument("--models", nargs="+", default=list(catalog.MODELS), help="models to run")
    matrix.add_argument("--datasets", nargs="+", default=["mock"], help="datasets to run")
    matrix.add_argument("--schemes", nargs="+", default=list(catalog.PREDECESSOR_SCHEMES),
                        help="preset names or scheme YAML paths")
    matrix.add_argument("--timeout", type=positive_seconds, default=1800.0, help="seconds per run before it is killed")
    matrix.add_argument("--last-n", type=positive_int, default=10, help="iterations in the 'last N' relative error")
    matrix.add_argument("--dry-run", action="store_true",
                        help="print each run's torchrun command; start and write nothing")
    _common(matrix)
    matrix.set_defaults(func=cmd_matrix)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command's exit status; interrupted (Ctrl-C, SIGTERM), it stops the training job it supervises, prints
    one line and raises SystemExit(128 + signal), 130 or 143, so that a caller running it in-process (`fxquant
    collect`) stops too."""
    args = build_parser().parse_args(argv)
    try:
        with interruptible():
            status = args.func(args)
            sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return status
    except Interrupted as exc:
        stopped = (f"its training job was stopped (log {exc.log})" if exc.log is not None
                   else "no training job was running")
        print(f"experiments {args.cmd}: interrupted by {exc}: {stopped}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_status) from None
    except BrokenPipeError:  # `... | head` closed the pipe: stop quietly
        return quiet_broken_pipe()
    except (ValueError, TypeError, OSError) as exc:  # OSError: e.g. a run directory that cannot be made
        print(f"experiments {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
