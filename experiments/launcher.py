"""Resolving a run (names -> RunConfig), refusing impossible combinations, and supervising torchrun.

`resolve(...)` checks everything that can be checked before a process starts (names, with did-you-mean;
a scheme YAML file parsed; TP dividing heads / groups / FFN; PP dividing layers; the layouts the device
cannot run; nproc divisible by TP*PP, default TP*PP; batch divisibility; data path and its dataset label;
tokenizer; capture spec)
and returns a `Launch`: the RunConfig and the exact torchrun command. Resolving writes nothing.
`supervise(launch, timeout)` writes the run's `launch.json`, claims its dataset index cache (`claim_data_cache`:
the caches of the same prefixes' earlier files are removed), runs torchrun in its own process group, kills the
whole group on timeout or when the supervisor is interrupted (`Interrupted`, `interruptible`), and on failure
finds the first error line a rank printed (`first_error`).
"""
from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from experiments import catalog
from fxquant._fileio import write_atomic
from fxquant.lowering import Kernels, parse_kernels
from fxquant.megatron_glue import dataset_label
from fxquant.megatron_glue.config import check_host_layout
from fxquant.megatron_glue.sentinel import NonFinitePolicy
from fxquant.megatron_glue.run_config import (AttentionKind, CaptureConfig, CompileBackend, DataConfig, DataKind,
                                              ParallelLayout, Precision, RunConfig, per_run_capture,
                                              stop_after)

logger = logging.getLogger(__name__)  # `log` names a run's train.log here

REPO = Path(__file__).resolve().parents[1]
SCHEME_NAME = re.compile(r"[A-Za-z0-9_.+-]+")  # a scheme name is a directory name of the run


def _pick(kind: str, name: str, choices) -> str:
    if name in choices:
        return name
    close = difflib.get_close_matches(name, list(choices), n=3)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    listed = sorted(choices)
    more = f", ... ({len(listed)} in all)" if len(listed) > 12 else ""
    raise ValueError(f"unknown {kind} {name!r}{hint} (choices: {', '.join(listed[:12])}{more})")


def is_scheme_file(scheme: str) -> bool:
    """Whether `--scheme` names a scheme YAML file rather than a preset (as `fxquant.schemes.get` decides)."""
    return scheme.endswith((".yaml", ".yml")) or "/" in scheme or Path(scheme).is_file()


def resolve_scheme(scheme: str) -> tuple[str, str | None]:
    """(name, YAML text) of `--scheme`: a preset name (text None), or a scheme YAML file, parsed now (every
    problem listed with file:line) and recorded whole in the run config."""
    if not is_scheme_file(scheme):
        return _pick("scheme", scheme, catalog.scheme_names()), None
    from fxquant import schemes

    path = Path(scheme)
    if not path.is_file():
        raise ValueError(f"--scheme {scheme!r}: no such scheme file (a preset name or a scheme YAML path; "
                         f"`fxquant schemes` lists the presets)")
    name = schemes.get(str(path)).name
    if not SCHEME_NAME.fullmatch(name):
        raise ValueError(f"--scheme {scheme!r}: the scheme's name {name!r} names the run directory; allowed "
                         f"characters: letters, digits, '_', '.', '+', '-' (set `name:` in the file)")
    if name.lower() in {n.lower() for n in catalog.scheme_names()}:
        raise ValueError(f"--scheme {scheme!r}: the scheme is named {name!r}, like a preset; runs of both would "
                         f"share a run directory: rename it (`name:` in the file, else the file's stem)")
    return name, path.read_text(encoding="utf-8")


def linear_block_sizes(scheme: str, scheme_yaml: str | None) -> list[int]:
    """The block sizes of the block formats (MX 32, NVFP4 16) the scheme's rules give linear operands, sorted;
    [] for a scheme without one (bf16, HiF8, FP8)."""
    from fxquant import schemes
    from fxquant.schemes.model import linear_operands

    sch = schemes.Scheme.from_yaml_text(scheme_yaml) if scheme_yaml is not None else schemes.get(scheme)
    return sorted({tq.fmt.block_size for rule in sch.rules if rule.linear is not None
                   for ops in linear_operands(rule.linear).values() for tq in ops.values()
                   if tq is not None and tq.fmt.block_size})


def run_device() -> str:
    """The device the training processes will use (they run on this machine): cuda when available."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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
            capture: CaptureConfig | str | None = None, nproc: int | None = None, tp: int = 1, pp: int = 1,
            out: str = "runs", tokenizer: str | None = None, data_prefix: str | None = None, iters: int | None = None,
            backend: str = "aot_eager", attention: str = "sdpa", control_iter: int | None = None,
            eval_interval: int | None = None, eval_iters: int | None = None, save_interval: int | None = None,
            capture_per_run: bool = False,
            device: str | None = None, precision: str = "auto", tensorboard: bool = False,
            nonfinite: str = "record", kernels: str = "auto") -> Launch:
    """The run these choices describe, or ValueError naming the value and what is allowed. `nproc` None: tp*pp.
    An explicit capture root (`capture.dir`) gets one subdirectory per run (`run_config.per_run_capture`): the
    scheme's name, or `<model name>/<dataset>/<scheme>` with `capture_per_run` (a matrix; `-tiny` ends a tiny variant's name). `device`: where the ranks will run (default `run_device()`)."""
    model = _pick("model", model, catalog.MODELS)
    dataset = _pick("dataset", dataset, catalog.DATASETS)
    scheme, scheme_yaml = resolve_scheme(scheme)
    config = _pick("config", config, catalog.CONFIGS)
    variant = _pick("variant", variant, ("full", "tiny"))
    backend = CompileBackend(_pick("backend", backend, [b.value for b in CompileBackend]))
    attention = AttentionKind.parse(attention)
    mcfg = catalog.TINY[model] if variant == "tiny" else catalog.MODELS[model]
    for flag, value in (("--tp", tp), ("--pp", pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} {value!r}: parallel sizes must be integers >= 1")
    for flag, value in (("--iters", iters), ("--eval-iters", eval_iters)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{flag} {value!r}: must be an integer >= 1 (leave it out for the config's)")
    if save_interval is not None and (isinstance(save_interval, bool) or not isinstance(save_interval, int)
                                      or save_interval < 0):
        raise ValueError(f"--save-interval {save_interval!r}: must be an integer >= 0 (0: no checkpoints)")
    if nproc is None:
        nproc = tp * pp
    if nproc < 1 or nproc % (tp * pp):
        raise ValueError(f"--nproc {nproc} must be a positive multiple of tp*pp = {tp}*{pp} (default: {tp * pp})")
    mcfg.check_parallel(tp, pp)
    check_host_layout(mcfg, tp, 1, device or run_device())
    for block in linear_block_sizes(scheme, scheme_yaml) if tp > 1 else ():
        for line in mcfg.tp_block_splits(tp, block):
            logger.warning("%s at --tp %d: %s; the scheme's %d-element blocks quantize these operands in other "
                           "blocks than one process does (docs/megatron.md)", mcfg.name, tp, line, block)
    if backend is CompileBackend.NONE and (scheme != "bf16" or capture is not None):
        raise ValueError(f"--backend none runs the model uncompiled: only --scheme bf16 without capture, got "
                         f"scheme {scheme!r}" + (" with capture" if capture is not None else "") +
                         "; use --backend aot_eager (the default), inductor or eager")
    if backend is CompileBackend.NONE and parse_kernels(kernels) is not Kernels.AUTO:
        raise ValueError(f"--kernels {parse_kernels(kernels).value} has no effect with --backend none (nothing is "
                         f"compiled, so no quantize op runs); leave --kernels out")
    if isinstance(capture, str):
        capture = CaptureConfig(spec=capture)
    if capture is not None:  # paths made absolute: the training processes run in the repository
        _check_capture_spec(capture.spec)
        spec = str(Path(capture.spec).resolve()) if Path(capture.spec).is_file() else capture.spec
        capture = replace(capture, spec=spec, dir=None if capture.dir is None else str(Path(capture.dir).resolve()))
        # the run directory's own key (the model's name: `-tiny` for the tiny variant), so that a tiny and a full
        # sweep into one --tensor-save-dir keep each other's captures
        capture = per_run_capture(capture, f"{mcfg.name}/{dataset}/{scheme}" if capture_per_run else scheme)
    tcfg = catalog.CONFIGS[config]
    tcfg = replace(tcfg, train_iters=tcfg.train_iters if iters is None else iters,
                   control_iter=stop_after(capture, control_iter),
                   eval_interval=tcfg.eval_interval if eval_interval is None else eval_interval,
                   eval_iters=tcfg.eval_iters if eval_iters is None else eval_iters,
                   save_interval=tcfg.save_interval if save_interval is None else save_interval,
                   precision=Precision(_pick("precision", precision, [p.value for p in Precision])),
                   nonfinite=NonFinitePolicy(_pick("--on-nonfinite policy", nonfinite, [p.value for p in NonFinitePolicy])))
    if eval_iters is not None and not tcfg.eval_interval:
        raise ValueError(f"--eval-iters {eval_iters} has no effect: the run does not evaluate (eval interval 0); "
                         f"give --eval-interval N too, or leave --eval-iters out")
    dp = nproc // (tp * pp)
    if tcfg.global_batch_size % (tcfg.micro_batch_size * dp):
        raise ValueError(f"config {config!r}: global batch {tcfg.global_batch_size} is not divisible by "
                         f"micro batch {tcfg.micro_batch_size} x data-parallel size {dp}")
    if tokenizer in (None, "byte"):
        if variant == "full":
            raise ValueError(f"model {model!r} (full size, vocab {mcfg.vocab_size}) needs --tokenizer DIR (a local "
                             f"HuggingFace tokenizer directory); the built-in byte tokenizer only fits --variant tiny")
        tokenizer = "byte"
    elif tokenizer != "byte" and not Path(tokenizer).is_dir():
        raise ValueError(f"--tokenizer {tokenizer!r}: no such directory")
    else:
        tokenizer = str(Path(tokenizer).resolve())  # absolute: torchrun runs in the repository
    if dataset == "mock":
        data = DataConfig()
    else:
        prefix = str(Path(catalog.dataset_prefix(dataset, data_prefix)).resolve())  # absolute, as run_dir below
        missing = [s for s in (".bin", ".idx") if not Path(f"{prefix}{s}").is_file()]
        if missing:
            ds = catalog.DATASETS[dataset]
            raise ValueError(f"dataset {dataset!r}: {prefix}{missing[0]} not found; build it with `fxquant "
                             f"prepare-data ... --dataset {dataset} -o {prefix}`, or point --data-prefix "
                             f"{dataset}=PREFIX / ${ds.env} at it")
        dataset_label.check(dataset, prefix, tokenizer, mcfg.vocab_size)
        data = DataConfig(DataKind.INDEXED, (prefix,), cache_dir=str(data_cache_dir(out, (prefix,))))
    if parse_kernels(kernels) is Kernels.TRITON and (device or run_device()) == "cpu":
        raise ValueError("--kernels triton: the training processes run on the CPU here (no CUDA device), where the "
                         "Triton kernels are not registered; allowed here: auto, inductor, reference")
    run_dir = Path(out).resolve() / mcfg.name / dataset / scheme  # absolute: torchrun runs in the repository
    _check_writable_dir(out, run_dir)
    run = RunConfig(model=mcfg, train=tcfg, data=data, output_dir=str(run_dir), tokenizer=tokenizer, scheme=scheme,
                    scheme_yaml=scheme_yaml, capture=capture, attention=attention, backend=backend,
                    layout=ParallelLayout(tp=tp, pp=pp), tensorboard=tensorboard, kernels=parse_kernels(kernels))
    return Launch(run=run, nproc=nproc, config_path=run_dir / "launch.json")


DATA_CACHE_MARKER = "fxquant_prefixes.json"  # in each OUT/.data-cache/<key>: the prefixes whose indexes it holds
_DATA_CACHE_KEY = re.compile(r"[0-9a-f]{16}")


def data_cache_dir(out: str | Path, prefixes: tuple[str, ...]) -> Path:
    """Where Megatron keeps the dataset indexes of a run reading `prefixes`: OUT/.data-cache/<key>, the key a
    hash of each .bin/.idx file's path, size and modification time. Megatron's own cache key covers the path,
    seed and sample counts but not the contents, so a dataset rebuilt at the same prefix (`fxquant
    prepare-data`) would otherwise reuse the old indexes (wrong samples, or Megatron's "offset must be
    non-negative and no greater than buffer length"); rebuilt, it gets a directory of its own
    (`claim_data_cache` removes the old one)."""
    identity = hashlib.sha256()
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            path = Path(f"{prefix}{suffix}").resolve()
            stat = path.stat()
            identity.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return Path(out).resolve() / ".data-cache" / identity.hexdigest()[:16]


def claim_data_cache(cache_dir: str | Path, prefixes: tuple[str, ...]) -> list[Path]:
    """Mark `cache_dir` (a `data_cache_dir`) as holding the indexes of `prefixes` (`DATA_CACHE_MARKER`: their
    resolved paths) and remove its stale siblings: the directories beside it named like a key whose marker names
    the same set of prefixes (indexes of those prefixes' earlier files, which no run reads again). Nothing else
    is touched: not a directory without a marker, nor one whose marker does not parse or names other prefixes.
    Returns the removed directories (each logged at INFO)."""
    cache_dir = Path(cache_dir).resolve()
    resolved = sorted(str(Path(p).resolve()) for p in prefixes)
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(cache_dir / DATA_CACHE_MARKER, lambda f: f.write(json.dumps({"prefixes": resolved}).encode()))
    removed = []
    for sibling in sorted(cache_dir.parent.iterdir()):
        if sibling == cache_dir or not _DATA_CACHE_KEY.fullmatch(sibling.name) or sibling.is_symlink():
            continue
        marker = sibling / DATA_CACHE_MARKER
        try:
            recorded = json.loads(marker.read_text())["prefixes"]
        except (OSError, ValueError, KeyError, TypeError):  # no marker, or not ours: not a cache to remove
            continue
        if isinstance(recorded, list) and all(isinstance(p, str) for p in recorded) and set(recorded) == set(resolved):
            shutil.rmtree(sibling)
            logger.info("removed %s: the dataset indexes of %s before the files were rebuilt", sibling,
                        ", ".join(resolved))
            removed.append(sibling)
    return removed


def _check_writable_dir(out: str, run_dir: Path) -> None:
    """The nearest existing directory on the way to `run_dir` must be a directory (an --out naming a file was a
    traceback from the first mkdir)."""
    for existing in (run_dir, *run_dir.parents):
        if existing.exists():
            if not existing.is_dir():
                raise ValueError(f"--out {out!r}: {existing} is not a directory (the run writes {run_dir}); "
                                 "give --out a directory, or a path that does not exist yet")
            return


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
    error: str | None = None  # failed: the first error line a rank printed (`first_error`)


# rank output shown on the console: progress, the result, captures, early stops, resumes, fxquant's warnings
ECHOED = ("iter ", "FXQUANT_RESULT", "capture rank ", "training stopped", "resumed from iteration ", "WARNING fxquant.")
_RANK_PREFIX = re.compile(r"^\[(?:default)?(?:rank)?(\d+)\]:\s?")
_ERROR_LINE = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure|Failed)\b.*)$")


def first_error(lines) -> str | None:
    """The first exception line (`ValueError: ...`) any rank printed, as `rank R: ValueError: ...`, with the
    indented lines that continue a message ending in ':' (a list of problems), joined by '; '; torchrun's own
    summary (ChildFailedError) only when no rank printed one. None when there is none."""
    fallback = None
    found: list[str] | None = None
    rank = None
    for line in lines:
        line = line.rstrip("\n")
        prefix = _RANK_PREFIX.match(line)
        body = line[prefix.end():] if prefix else line
        if found is not None:  # the message's continuation: the same rank's indented lines (others' skipped)
            if (prefix.group(1) if prefix else None) != rank:
                continue
            if body.startswith((" ", "\t")) and body.strip():
                found.append(body.strip())
                continue
            if found[-1].endswith("raised:") and _ERROR_LINE.match(body):  # Dynamo's wrapper: the real error next
                found.append(body.strip())
                if body.rstrip().endswith(":"):
                    continue
            break
        match = _ERROR_LINE.match(body)
        if match is None:
            continue
        where = f"rank {prefix.group(1)}: " if prefix else ""
        if "ChildFailedError" in body or "elastic" in body:
            fallback = fallback or where + match.group(1)
            continue
        found, rank = [where + match.group(1)], prefix.group(1) if prefix else None
        if not body.rstrip().endswith(":"):
            break
    if found is not None:
        return found[0] + (" " + "; ".join(found[1:]) if len(found) > 1 else "")
    return fallback


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the supervisor (raised by the handlers `interruptible()` installs; `supervise`
    turns a KeyboardInterrupt into one too). Raised out of `supervise` after the job's process group is stopped,
    with `log` naming its train.log. A BaseException, like KeyboardInterrupt: no `except Exception` swallows it."""

    def __init__(self, signum: int, log: Path | None = None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.log = signum, log

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


@contextlib.contextmanager
def _handlers(handler, keep_ignored_sigint: bool = False):
    """SIGINT's and SIGTERM's handler set to `handler` while held, the previous ones restored on exit; nothing
    changes outside the main thread, where handlers cannot be set. `keep_ignored_sigint`: a SIGINT the caller
    ignores (a background job of a script) stays ignored."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            if keep_ignored_sigint and sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                continue
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def interruptible():
    """While held (main thread only), SIGINT and SIGTERM raise `Interrupted` (a SIGINT ignored by the caller,
    e.g. a background job of a script, stays ignored; supervise still turns a KeyboardInterrupt into
    Interrupted off the main thread); the previous handlers are restored on exit."""
    def raise_interrupted(signum, frame):
        raise Interrupted(signum)

    return _handlers(raise_interrupted, keep_ignored_sigint=True)


def _signals_held():
    """SIGINT and SIGTERM ignored while the job is being stopped (a second Ctrl-C does not cut that short, nor
    print a second traceback); nothing changes outside the main thread, where handlers cannot be set."""
    return _handlers(signal.SIG_IGN)


def supervise(launch: Launch, timeout: float, echo: tuple[str, ...] = ECHOED, prefix: str = "") -> Outcome:
    """Write launch.json, run the launch in a new process group; on timeout kill the group (SIGTERM, then
    SIGKILL). Rank lines starting with one of `echo` are printed, after `prefix`; all output goes to train.log.
    Interrupted (Ctrl-C, SIGTERM: `Interrupted`, KeyboardInterrupt) or failing itself, it stops the group the
    same way (SIGTERM first, so the ranks commit their captures), copies what the ranks still print to
    train.log, and raises `Interrupted(signum, log)` (the original exception for any other)."""
    launch.config_path.parent.mkdir(parents=True, exist_ok=True)
    launch.config_path.write_text(json.dumps(launch.run.to_dict(), indent=2))
    data = launch.run.data
    if data.kind is DataKind.INDEXED and data.cache_dir is not None:
        claim_data_cache(data.cache_dir, data.prefixes)
    log = launch.config_path.parent / "train.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    with open(log, "w") as handle:
        proc = subprocess.Popen(launch.command(), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        timer = threading.Timer(timeout, _kill_group, args=(proc,))  # fires even when the run prints nothing
        timer.daemon = True
        try:
            timer.start()
            for line in proc.stdout:
                handle.write(line)
                if echo and line.startswith(echo):
                    print(prefix + line.rstrip(), flush=True)
            proc.wait()
        except BaseException as exc:  # the job must not outlive its supervisor
            timer.cancel()
            with _signals_held():
                _stop(proc, handle)
            if isinstance(exc, (Interrupted, KeyboardInterrupt)):
                raise Interrupted(getattr(exc, "signum", signal.SIGINT), log) from None
            raise
        finally:
            timer.cancel()
    seconds = time.monotonic() - start
    if seconds >= timeout and proc.returncode != 0:
        return Outcome("timeout", proc.returncode, seconds, log)
    if proc.returncode != 0:
        with open(log, errors="replace") as handle:
            return Outcome("failed", proc.returncode, seconds, log, first_error(handle))
    return Outcome("ok", proc.returncode, seconds, log)


def _stop(proc: subprocess.Popen, handle) -> None:
    """Kill the job's group (`_kill_group`, in a thread) while its last output is copied to `handle`: ranks
    committing captures must not block on a full pipe nobody reads."""
    killer = threading.Thread(target=_kill_group, args=(proc,), daemon=True)
    killer.start()
    try:
        for line in proc.stdout:
            handle.write(line)
    except (OSError, ValueError):  # the pipe or the log is gone: the kill goes on regardless
        pass
    killer.join()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the job's process group (torchrun and its ranks), SIGKILL to whatever of it is left 10 s later;
    returns when no process of the group is left (or 10 s after the SIGKILL)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            proc.poll()  # reap torchrun: a zombie still counts as a member of the group
            if not _group_alive(proc.pid):
                return
            time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    """Whether a live process is left in the group: from /proc where there is one (a zombie member, orphaned,
    waits there for an init that may not reap it), else whether the group can be signalled."""
    stats = list(Path("/proc").glob("[0-9]*/stat"))
    if not stats:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a member we may not signal is still a member
            return True
        return True
    for stat in stats:
        try:
            text = stat.read_text()
        except OSError:  # the process ended while we looked
            continue
        state, _ppid, pgrp = text[text.rindex(")") + 2:].split()[:3]
        if int(pgrp) == pgid and state not in ("Z", "X"):
            return True
    return False
