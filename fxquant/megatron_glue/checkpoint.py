"""Checkpoints of a training run: one safetensors-free, pickle-free file per rank, atomically written.

Layout: `{dir}/iter_{NNNNNNN}/rank_{RRRRR}.pt` + `{dir}/latest` (text: the iteration), written by rank 0
after every rank has finished (barrier), so `latest` only ever names a complete checkpoint. Each file is
`torch.save` of plain containers (model and optimizer state dicts, the scheduler state, RNG states,
iteration, consumed samples) and is loaded with `torch.load(weights_only=True)`: no code runs on load.
Resuming restores everything a step depends on, so a resumed run continues bit for bit. A checkpoint records the
job's parallel layout and the run's settings (`run_settings`: model, precision, attention, sequence length, batch
sizes, seed, scheme and its YAML text, tokenizer, data, optimizer hyperparameters) and loads only into the same
ones, refusing with every difference named; a setting the checkpoint does not record (written before it was
recorded) is not checked, and named at INFO. The lr schedule is the resuming run's (its config's `train_iters`,
warm-up and decay), with the step count restored: the same config continues bit for bit, a longer `--iters`
continues on the longer schedule (a WARNING names what changed). The compile backend and `kernels` are not
settings, so a run may resume on another machine with another choice: the quantize ops compute the same bits under
every choice, the rest of the model may differ in the last bits under Inductor (a close, not bit-identical, resume).
"""
from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy
import torch
import torch.distributed as dist

from fxquant._fileio import write_atomic

log = logging.getLogger(__name__)


def _iter_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def _rank_file(root: Path, iteration: int) -> Path:
    return _iter_dir(root, iteration) / f"rank_{dist.get_rank():05d}.pt"


def latest_iteration(root: str | Path) -> int | None:
    marker = Path(root) / "latest"
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{marker}: expected an iteration number, found {text[:40]!r}")
    return int(text)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import random as megatron_random  # here: latest_iteration needs no Megatron

    tracker = megatron_random.get_cuda_rng_tracker()
    _, keys, pos, has_gauss, cached = numpy.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy": [keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "python": repr(random.getstate()), "tracker": dict(tracker.get_states())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    import ast

    torch.set_rng_state(state["torch"])
    keys, pos, has_gauss, cached = state["numpy"]
    numpy.random.set_state(("MT19937", numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))
    random.setstate(ast.literal_eval(state["python"]))
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.get_cuda_rng_tracker().set_states(dict(state["tracker"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _layout() -> dict[str, int]:
    """The job's parallel layout (world size, tensor/pipeline/data parallel sizes): a checkpoint holds one
    rank's shard of it, and loads only into the same layout."""
    from megatron.core import parallel_state as ps

    return {"world_size": dist.get_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(), "cp": ps.get_context_parallel_world_size()}


def expected_layout(world_size: int, tp: int, pp: int, ep: int = 1) -> dict[str, int]:
    """The layout `_layout()` records for a job of `world_size` processes with these sizes (no context parallelism),
    computed without starting the job: what a launcher compares a run directory's checkpoint with."""
    return {"world_size": world_size, "tp": tp, "pp": pp, "dp": world_size // (tp * pp), "ep": ep, "cp": 1}


def mismatch(root: str | Path, *, layout: dict, settings: dict) -> list[str]:
    """Why the latest checkpoint in `root` would not load into a job of `layout` with `settings` (`run_settings`),
    as `load` would refuse it: one line per difference; [] when it would load, when there is none, and when rank 0's
    file is missing (`load` names that). Reads the metadata of rank 0's file only (memory-mapped: no tensor data is
    read)."""
    root = Path(root)
    iteration = latest_iteration(root)
    if iteration is None:
        return []
    path = _iter_dir(root, iteration) / "rank_00000.pt"
    if not path.is_file():  # an incomplete checkpoint: the resume names it
        return []
    payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    saved, recorded = payload.get("layout"), payload.get("settings")
    out = [f"layout: checkpoint {_layout_text(saved)}, this run {_layout_text(layout)}"] if saved not in (None, layout) else []
    if recorded is not None:
        out += _compare(recorded, settings)[0]
    return out


def _layout_text(layout: dict) -> str:
    sizes = ", ".join(f"{k}={layout[k]}" for k in ("tp", "pp", "dp", "ep", "cp") if k in layout)
    return f"{layout['world_size']} processes, {sizes}"


# Optimizer hyperparameters a resume must keep: each changes the update, and the optimizer's `load_state_dict`
# restores its param groups' values (weight decay, betas, eps) from the checkpoint, so a changed one would be
# silently replaced. The lr schedule (lr, min_lr, warmup_iters, decay_iters, decay_style) is the resuming run's
# own (`load` warns when it changed).
OPTIMIZER_SETTINGS = ("weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "distributed_optimizer")


def run_settings(run, bf16: bool) -> dict:
    """What a checkpoint of `run` (a RunConfig; `bf16`: the precision it resolved to) must be resumed with: the
    model, precision, attention, sequence length, batch sizes, seed, scheme name and scheme YAML text, tokenizer,
    data (kind, prefixes, split; not the cache directory, which is derived from them) and the optimizer
    hyperparameters `OPTIMIZER_SETTINGS`. Resumed under other ones, training would go on silently as another
    experiment than the one its metrics began. Not among them: the lr schedule (a resume may extend the run),
    the compile backend and `kernels` (the quantize ops compute the same bits under every choice, so a run may
    resume on another machine, closely rather than bit for bit where Inductor changes the rest of the model's
    last bits), and what only names where outputs go or how often they are written."""
    t, d = run.train, run.data
    return {"model": run.to_dict()["model"], "precision": "bf16" if bf16 else "fp32", "attention": run.attention.value,
            "seq_length": t.seq_length, "micro_batch_size": t.micro_batch_size,
            "global_batch_size": t.global_batch_size, "seed": t.seed, "scheme": run.scheme,
            "scheme_yaml": run.scheme_yaml, "tokenizer": run.tokenizer,
            "data": {"kind": d.kind.value, "prefixes": list(d.prefixes), "split": d.split},
            "optim": {k: getattr(t.optim, k) for k in OPTIMIZER_SETTINGS}}


def _compare(saved: dict, now: dict, prefix: str = "") -> tuple[list[str], list[str]]:
    """(differences, unrecorded). Differences: `name: checkpoint X, this run Y` per differing setting (mappings
    field by field, as `model.hidden_size`; a YAML text only named). Unrecorded: the names of this run's settings
    that `saved` lacks (a checkpoint written before they were recorded): not a difference."""
    differences, unrecorded = [], []
    for key in sorted(set(saved) | set(now)):
        name = prefix + key
        if key not in saved:
            unrecorded.append(name)
            continue
        a, b = saved[key], now.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            inner, missing = _compare(a, b, name + ".")
            differences += inner
            unrecorded += missing
        elif name == "scheme_yaml":
            differences.append("scheme YAML: " + ("the text differs" if a is not None and b is not None else
                                                  f"checkpoint {'a scheme file' if a else 'a preset'}, this run "
                                                  f"{'a scheme file' if b else 'a preset'}"))
        else:
            differences.append(f"{name}: checkpoint {a!r}, this run {b!r}")
    return differences, unrecorded


_SCHEDULE = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")


def save(root: str | Path, iteration: int, *, model, optimizer, scheduler, consumed_samples: int,
         extra: dict | None = None, settings: dict | None = None) -> Path:
    """Write this rank's checkpoint for `iteration`; every rank must call it. `settings`: `run_settings(...)`,
    which `load` requires again."""
    root = Path(root)
    path = _rank_file(root, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"iteration": iteration, "consumed_samples": consumed_samples, "model": model.state_dict(),
               "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
               "rng": _rng_state(), "extra": extra or {}, "layout": _layout(), "settings": settings}
    write_atomic(path, lambda handle: torch.save(payload, handle))
    dist.barrier()
    if dist.get_rank() == 0:
        write_atomic(root / "latest", lambda f: f.write(f"{iteration}\n".encode()))
    dist.barrier()
    return path.parent


def load(root: str | Path, *, model, optimizer, scheduler, iteration: int | None = None,
         settings: dict | None = None) -> tuple[int, int, dict]:
    """Restore this rank's state; returns (iteration, consumed_samples, extra). `settings` (`run_settings(...)`):
    the checkpoint must have been saved with equal ones, else ValueError naming each difference, before any
    state is touched (None: not checked)."""
    root = Path(root)
    iteration = latest_iteration(root) if iteration is None else iteration
    if iteration is None:
        raise FileNotFoundError(f"no checkpoint in {str(root)!r} (no 'latest' marker)")
    path = _rank_file(root, iteration)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} is missing: was it written with a different "
                                f"number of processes?")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    saved, now = payload.get("layout"), _layout()
    if saved is not None and saved != now:
        raise ValueError(f"checkpoint {str(path.parent)!r} was written by a job of {_layout_text(saved)}; this job has "
                         f"{_layout_text(now)}: resume it with the layout it was written with, or start again in "
                         "another run directory")
    recorded = payload.get("settings")
    if settings is not None and recorded is not None:
        differences, unrecorded = _compare(recorded, settings)
        if differences:
            raise ValueError(f"checkpoint {str(path.parent)!r} was written by a run with other settings "
                             f"({'; '.join(differences)}): resume it with the settings it was written with, write "
                             f"this run somewhere else (another --out), or delete {str(root)!r} to start again at "
                             "iteration 0")
        if unrecorded and dist.get_rank() == 0:
            log.info("checkpoint %s does not record %s (written before they were recorded): resuming without "
                     "checking them", path.parent, ", ".join(unrecorded))
    elif settings is not None and dist.get_rank() == 0:
        log.warning("checkpoint %s records no run settings (written by an earlier version): resuming without "
                    "checking that the model, precision, data, tokenizer, optimizer and scheme are the same",
                    path.parent)
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    changed = {k: (payload["scheduler"].get(k), v) for k, v in scheduler.state_dict().items()
               if k in _SCHEDULE and payload["scheduler"].get(k) != v}
    if changed and dist.get_rank() == 0:
        log.warning("the checkpoint's lr schedule differs from this run's (%s): training goes on from iteration %d "
                    "on this run's schedule", ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()),
                    payload["iteration"])
    scheduler.load_state_dict(payload["scheduler"])  # the step count; the schedule stays this run's
    _set_rng_state(payload["rng"])
    return payload["iteration"], payload["consumed_samples"], payload["extra"]
