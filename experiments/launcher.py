"""Resolving a run (names -> RunConfig), refusing impossible combinations, and supervising torchrun.

`resolve(...)` checks everything that can be checked before a process starts (names, with did-you-mean;
TP dividing heads / groups / FFN; PP dividing layers; nproc divisible by TP*PP; batch divisibility;
data path; tokenizer) and returns a `Launch`: the RunConfig and the exact torchrun command.
`supervise(launch, timeout)` runs it in its own process group and kills the whole group on timeout.
"""
from __future__ import annotations

import difflib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from experiments import catalog
from fxquant.megatron_glue.sentinel import NonFinitePolicy
from fxquant.megatron_glue.run_config import (AttentionKind, CaptureConfig, CompileBackend, DataConfig, DataKind,
                                              ParallelLayout, RunConfig, stop_after)

REPO = Path(__file__).resolve().parents[1]


def _pick(kind: str, name: str, choices) -> str:
    if name in choices:
        return name
    close = difflib.get_close_matches(name, list(choices), n=3)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    listed = sorted(choices)
    more = f", ... ({len(listed)} in all)" if len(listed) > 12 else ""
    raise ValueError(f"unknown {kind} {name!r}{hint} (choices: {', '.join(listed[:12])}{more})")


@dataclass(frozen=True)
class Launch:
    run: RunConfig
    nproc: int
    config_path: Path

    def command(self) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
                "-m", "fxquant.megatron_glue.launch", "--config", str(self.config_path)]

    def shell(self) -> str:
        return " ".join(shlex.quote(c) for c in self.command())


def resolve(*, model: str, dataset: str, scheme: str, config: str = "cpu", variant: str = "tiny",
            capture: CaptureConfig | str | None = None, nproc: int = 1, tp: int = 1, pp: int = 1, out: str = "runs",
            tokenizer: str | None = None, data_prefix: str | None = None, iters: int | None = None,
            backend: str = "aot_eager", attention: str = "sdpa", control_iter: int | None = None,
            eval_interval: int | None = None, eval_iters: int | None = None, tensorboard: bool = False,
            nonfinite: str = "record") -> Launch:
    model = _pick("model", model, catalog.MODELS)
    dataset = _pick("dataset", dataset, catalog.DATASETS)
    scheme = _pick("scheme", scheme, catalog.scheme_names())
    config = _pick("config", config, catalog.CONFIGS)
    variant = _pick("variant", variant, ("full", "tiny"))
    mcfg = catalog.TINY[model] if variant == "tiny" else catalog.MODELS[model]
    if nproc < 1 or nproc % (tp * pp):
        raise ValueError(f"nproc={nproc} must be a positive multiple of tp*pp = {tp}*{pp}")
    mcfg.check_parallel(tp, pp)
    if isinstance(capture, str):
        capture = CaptureConfig(spec=capture)
    if capture is not None:  # paths made absolute: the training processes run in the repository
        _check_capture_spec(capture.spec)
        spec = str(Path(capture.spec).resolve()) if Path(capture.spec).is_file() else capture.spec
        capture = replace(capture, spec=spec, dir=None if capture.dir is None else str(Path(capture.dir).resolve()))
    tcfg = catalog.CONFIGS[config]
    tcfg = replace(tcfg, train_iters=iters or tcfg.train_iters, control_iter=stop_after(capture, control_iter),
                   eval_interval=tcfg.eval_interval if eval_interval is None else eval_interval,
                   eval_iters=eval_iters or tcfg.eval_iters,
                   nonfinite=NonFinitePolicy(_pick("--on-nonfinite policy", nonfinite, [p.value for p in NonFinitePolicy])))
    dp = nproc // (tp * pp)
    if tcfg.global_batch_size % (tcfg.micro_batch_size * dp):
        raise ValueError(f"config {config!r}: global batch {tcfg.global_batch_size} is not divisible by "
                         f"micro batch {tcfg.micro_batch_size} x data-parallel size {dp}")
    if tokenizer is None:
        if variant == "full":
            raise ValueError(f"model {model!r} (full size, vocab {mcfg.vocab_size}) needs --tokenizer DIR (a local "
                             f"HuggingFace tokenizer directory); the built-in byte tokenizer only fits --variant tiny")
        tokenizer = "byte"
    elif tokenizer != "byte" and not Path(tokenizer).is_dir():
        raise ValueError(f"--tokenizer {tokenizer!r}: no such directory")
    if dataset == "mock":
        data = DataConfig()
    else:
        prefix = catalog.dataset_prefix(dataset, data_prefix)
        missing = [s for s in (".bin", ".idx") if not Path(f"{prefix}{s}").is_file()]
        if missing:
            ds = catalog.DATASETS[dataset]
            raise ValueError(f"dataset {dataset!r}: {prefix}{missing[0]} not found; build it with `fxquant "
                             f"prepare-data ... -o {prefix}`, or point --data-prefix / ${ds.env} at it")
        data = DataConfig(DataKind.INDEXED, (prefix,), cache_dir=str(Path(out) / ".data-cache"))
    run_dir = Path(out).resolve() / mcfg.name / dataset / scheme  # absolute: torchrun runs in the repository
    run = RunConfig(model=mcfg, train=tcfg, data=data, output_dir=str(run_dir), tokenizer=tokenizer, scheme=scheme,
                    capture=capture, attention=AttentionKind.parse(attention), backend=CompileBackend(backend),
                    layout=ParallelLayout(tp=tp, pp=pp), tensorboard=tensorboard)
    return Launch(run=run, nproc=nproc, config_path=run_dir / "launch.json")


def _check_capture_spec(spec: str) -> None:
    """Load the spec now (unknown names get a did-you-mean; YAML problems are listed with file:line)."""
    from fxquant.capture import SpecError, load_spec

    try:
        load_spec(spec)
    except SpecError as exc:
        raise ValueError(f"--capture {spec!r}: {exc}") from None


@dataclass
class Outcome:
    status: str  # ok | failed | timeout
    returncode: int | None
    seconds: float
    log: Path


def supervise(launch: Launch, timeout: float, echo: bool = True) -> Outcome:
    """Run the launch in a new process group; on timeout kill the group (SIGTERM, then SIGKILL)."""
    launch.config_path.parent.mkdir(parents=True, exist_ok=True)
    launch.config_path.write_text(json.dumps(launch.run.to_dict(), indent=2))
    log = launch.config_path.parent / "train.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    with open(log, "w") as handle:
        proc = subprocess.Popen(launch.command(), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        timer = threading.Timer(timeout, _kill_group, args=(proc,))  # fires even when the run prints nothing
        timer.start()
        try:
            for line in proc.stdout:
                handle.write(line)
                if echo and line.startswith(("iter ", "FXQUANT_RESULT", "capture rank ")):
                    print(line.rstrip(), flush=True)
            proc.wait()
        finally:
            timer.cancel()
    seconds = time.monotonic() - start
    if seconds >= timeout and proc.returncode != 0:
        return Outcome("timeout", proc.returncode, seconds, log)
    return Outcome("ok" if proc.returncode == 0 else "failed", proc.returncode, seconds, log)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
