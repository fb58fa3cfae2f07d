"""Entry point of every training process: `torchrun ... -m fxquant.megatron_glue.launch --config run.json`.

Reads a `RunConfig` JSON (written by `experiments`), trains, writes progress on the logging rank and a
final JSON line (`FXQUANT_RESULT {...}`) the launcher parses. These console lines go through the logger
`CONSOLE`, which `main` points at stdout with the bare message (the launcher reads them there).

Capture can be switched on here too, over the JSON: `--capture SPEC` (shipped name or YAML path) and the
predecessor's `--save-tensors`, `--tensor-save-dir DIR`, `--control-iter N` and `TENSOR_SAVE_ENABLED`,
`TENSOR_SAVE_DIR` (`run_config.capture_from_args`; with the predecessor's switch, training also stops after
N iterations, as it did, and a `training stopped ...` line says so). Every rank prints one `capture rank R:
...` line (records, bytes, where, why it stopped); a resumed run prints `resumed from iteration N (DIR)`.
SIGTERM (torchrun forwards it; the experiment supervisor sends it on timeout and when it is interrupted) raises
SystemExit in the training thread, so the capture session is drained and committed before the process ends;
later SIGTERMs are ignored meanwhile.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import warnings

log = logging.getLogger(__name__)
CONSOLE = logging.getLogger(__name__ + ".console")  # the process's console lines (stdout, bare message)


def format_progress(record: dict, total: int) -> str:
    """One progress line: loss, lr, grad norm, throughput, step time; MoE aux and validation loss if present."""
    line = (f"iter {record['iteration']:>6}/{total} | loss {record['loss']:.4f} | lr {record['lr']:.3e} | "
            f"grad norm {record['grad_norm']:.3f} | {record['tokens_per_s']:.0f} tok/s | "
            f"{record['step_time_s'] * 1000:.0f} ms")
    for key in sorted(k for k in record if k.endswith("load_balancing_loss")):
        line += f" | {key.replace('_loss', '')} {record[key]:.3f}"
    if "val_loss" in record:
        line += f" | val loss {record['val_loss']:.4f}"
    if "nonfinite" in record:
        line += f" | NON-FINITE (first at iteration {record['nonfinite']['first_iteration']})"
    return line


def _progress(total: int):
    def show(record: dict) -> None:
        CONSOLE.info(format_progress(record, total))
    return show


def with_capture_args(run, args: argparse.Namespace):
    """`run` with the capture and `--control-iter` of the command line applied (None of them: unchanged). The
    predecessor's environment (`TENSOR_SAVE_ENABLED`, `TENSOR_SAVE_DIR`) applies only to a run whose config holds
    no capture: `experiments` already resolved it into the config (one directory per run), and every rank inherits
    the same environment, which would otherwise replace that capture in each rank."""
    from fxquant.megatron_glue.run_config import capture_from_args, stop_after

    capture = capture_from_args(args, env={} if run.capture is not None else None)
    train = run.train
    if args.control_iter is not None or (capture is not None and capture.iterations is not None):
        train = dataclasses.replace(train, control_iter=stop_after(capture, args.control_iter))
    return dataclasses.replace(run, capture=capture or run.capture, train=train)


def stopped_line(run, done: int) -> str:
    """The console line of a run that `--control-iter` (or `--save-tensors`' window) stopped early."""
    t = run.train
    why = f"--control-iter {t.control_iter}"
    if run.capture is not None and run.capture.iterations == t.control_iter:
        why += " (--save-tensors captures that many iterations, 1 unless --control-iter is given, and stops training)"
    return (f"training stopped after {done} of {t.train_iters} iterations by {why}; --control-iter 0 trains "
            f"all {t.train_iters}")


def resumed_line(iteration: int, checkpoint_dir) -> None:
    """The console line of a run that resumes from its run directory's checkpoint."""
    CONSOLE.info(f"resumed from iteration {iteration} ({checkpoint_dir})")


def _terminate(signum, frame):
    """The first SIGTERM ends the process (SystemExit, so captures are committed on the way out); later ones
    are ignored (torchrun forwards the supervisor's, which also reaches the ranks through their process group),
    so they cannot cut that commit short. SIGKILL, 10 s later, ends a process that hangs."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def build_parser() -> argparse.ArgumentParser:
    from fxquant.capture import compat

    parser = argparse.ArgumentParser(prog="python -m fxquant.megatron_glue.launch")
    parser.add_argument("--config", required=True, help="RunConfig JSON file")
    parser.add_argument("--capture", help="capture spec: a shipped name (e.g. predecessor) or a YAML path")
    compat.add_arguments(parser)
    parser.add_argument("-v", "--verbose", action="count", default=0)
    return parser


def _console_to_stdout() -> None:
    """CONSOLE writes each line as it is to the current stdout (flushed per record by StreamHandler), not to the
    root logger; called by every ``main`` (a caller may have replaced sys.stdout since the last one)."""
    for old in list(CONSOLE.handlers):
        CONSOLE.removeHandler(old)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    CONSOLE.addHandler(handler)
    CONSOLE.setLevel(logging.INFO)
    CONSOLE.propagate = False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s")
    _console_to_stdout()
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
    from fxquant.megatron_glue.parallel import destroy_parallel
    from fxquant.megatron_glue.run_config import RunConfig
    from fxquant.megatron_glue.train import train
    from fxquant.megatron_glue.training_capture import describe

    try:
        with open(args.config) as handle:
            config = RunConfig.from_dict(json.load(handle))
    except (OSError, ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        log.error("run config %s: %s", args.config, exc)
        return 2
    run = with_capture_args(config, args)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        result = train(run, progress=_progress(run.train.train_iters), resumed=resumed_line)
        if result.capture is not None:
            CONSOLE.info(describe(result.capture))
        if result.records:
            validated = [r["val_loss"] for r in result.records if "val_loss" in r]
            summary = {"run_dir": str(result.run_dir), "iterations": result.iterations,
                       "final_loss": result.records[-1]["loss"], "metrics": str(result.metrics_path),
                       "final_val_loss": validated[-1] if validated else None,
                       "checkpoints": str(result.checkpoint_dir) if result.checkpoint_dir else None,
                       "stopped_by_control_iter": result.stopped_by_control_iter,
                       "captures": str(run.capture.root(run.output_dir)) if run.capture else None}
            if result.stopped_by_control_iter:
                CONSOLE.info(stopped_line(run, len(result.records)))
            CONSOLE.info("FXQUANT_RESULT " + json.dumps(summary))
    finally:
        destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
