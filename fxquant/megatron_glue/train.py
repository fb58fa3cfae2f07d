"""The training loop on megatron.core: `train(RunConfig) -> TrainResult`.

One iteration = `global_batch_size` samples = micro-batches of `micro_batch_size` on each of the
data-parallel ranks, run by `schedule.forward_backward` (Megatron's schedules on CUDA), then the
optimizer step (`optim`), Megatron's LR scheduler, metrics (JSONL per iteration: loss, lr, grad norm,
tokens/s, step time, MoE aux losses; optional TensorBoard), the NaN/Inf sentinel (`sentinel`: the first
non-finite iteration and its parameters, recorded or fatal), the validation loss every `eval_interval`
iterations (`evaluation.Validator`, recorded as `val_loss`), periodic checkpoints (`checkpoint`) and
auto-resume from the run directory (refused when the checkpoint's settings differ from the run's;
`run_config.json` is written only once that check has passed). `control_iter` stops the run after that many
iterations of this run (the predecessor's `--control-iter`). The model is compiled through `compile_model` (fxquant.compile with the run's
scheme and capture spec) while `graph_breaks.quiet_tp_group_lookup()` is held, so Megatron's model is one
graph. With `run.capture`, each rank writes one capture session (`training_capture.TrainingCapture`: iteration
and micro-batch counters follow the schedule, forward and backward; closed and committed at the end, on error
and on interrupt). Configuration types and their JSON form live in `run_config`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from fxquant.megatron_glue import checkpoint
from fxquant.megatron_glue.data import PretrainingSampler, batch_iterator, build_datasets
from fxquant.megatron_glue.evaluation import Validator, mean_loss
from fxquant.megatron_glue.graph_breaks import quiet_tp_group_lookup
from fxquant.megatron_glue.host_moe_mla import MoEAuxLosses
from fxquant.megatron_glue.model import build_gpt_model, causal_attention_mask, layer_offset
from fxquant.megatron_glue.optim import HostOptimizer, MegatronOptimizerSetup, lr_scheduler
from fxquant.megatron_glue.parallel import initialize_parallel
from fxquant.megatron_glue.run_config import CompileBackend, DataKind, RunConfig
from fxquant.megatron_glue.schedule import forward_backward
from fxquant.megatron_glue.sentinel import REPORT_FILE, NonFiniteSentinel
from fxquant.megatron_glue.tokenizer import load_tokenizer
from fxquant.megatron_glue.training_capture import TrainingCapture

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"  # SummaryWriter event files (--tensorboard)
SITES_FILE = "fxquant_sites.json"  # what fxquant.compile matched and rewrote (logging rank's model)


@dataclass
class TrainResult:
    run_dir: Path
    iterations: int              # iterations completed in total (resumed ones included)
    records: list[dict] = field(default_factory=list)  # metrics of this process's run (logging rank only)
    metrics_path: Path | None = None
    checkpoint_dir: Path | None = None
    stopped_by_control_iter: bool = False
    sites: list[dict] = field(default_factory=list)  # fxquant sites of the logging rank's model (SITES_FILE)
    capture: dict | None = None  # this rank's capture summary (records, bytes, shards, stop_reason, dir, ...)


def compile_model(model: torch.nn.Module, run: RunConfig, capture_spec=None) -> torch.nn.Module:
    """The one place a run's model is compiled: fxquant.compile with the run's scheme (and capture spec,
    a CaptureSpec), or eager."""
    if run.backend is CompileBackend.NONE:
        if run.scheme != "bf16" or run.capture is not None:
            raise ValueError(f"backend='none' runs the model uncompiled: only scheme 'bf16' without capture "
                             f"is possible, got scheme={run.scheme!r}, capture={run.capture!r}")
        return model
    from fxquant.api import compile as fxquant_compile

    kwargs = {"capture": capture_spec} if capture_spec is not None else {}
    return fxquant_compile(model, run.compile_scheme(), backend=run.backend.value, kernels=run.kernels.value, **kwargs)


def _check_batch(run: RunConfig, dp: int) -> int:
    t = run.train
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise ValueError(f"global_batch_size={t.global_batch_size} is not divisible by micro_batch_size * "
                         f"data_parallel_size = {t.micro_batch_size} * {dp}")
    return t.global_batch_size // per_step


def _remove_earlier_outputs(run_dir: Path, start_iteration: int) -> None:
    """A run starting at iteration 0 replaces an earlier run's outputs: its metrics, TensorBoard events, non-finite
    report and sites report go at once, beside this run's run_config.json, so none stays beside this run's
    configuration when this run ends without writing its own (--backend none writes no sites report; a run may
    fail before its first iteration or be killed). A resumed run keeps them."""
    if start_iteration:
        return
    for stale in (run_dir / METRICS_FILE, run_dir / TENSORBOARD_DIR, run_dir / REPORT_FILE, run_dir / SITES_FILE):
        if stale.exists():
            log.info("run starts at iteration 0: removing the earlier run's %s", stale)
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()


class _MetricsSink:
    """metrics.jsonl (+ TensorBoard when asked and installed), written by the logging rank only."""

    def __init__(self, run_dir: Path, start_iteration: int, enabled: bool, tensorboard: bool) -> None:
        self.path = run_dir / METRICS_FILE
        self.enabled = enabled
        self.writer = None
        self.kept: list[dict] = []  # the records a resumed run keeps (logging rank)
        if not enabled:
            return
        kept = []
        if self.path.is_file():  # a resumed run: keep what led up to the checkpoint, drop the rest
            for number, line in enumerate(self.path.read_text().splitlines(), 1):
                try:
                    record = json.loads(line) if line.strip() else None
                except json.JSONDecodeError:  # the torn line of a run killed while writing: after the checkpoint
                    log.warning("%s:%d: not JSON (a run killed while writing it?), dropped", self.path, number)
                    continue
                if isinstance(record, dict) and record.get("iteration", start_iteration + 1) <= start_iteration:
                    kept.append(line)
                    self.kept.append(record)
        self.path.write_text("".join(line + "\n" for line in kept))
        if tensorboard:  # RunConfig refused --tensorboard without the package
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                self.writer.add_scalar(f"train/{key}", record[key], record["iteration"])
            if "val_loss" in record:
                self.writer.add_scalar("valid/loss", record["val_loss"], record["iteration"])
            if "nonfinite" in record:
                self.writer.add_scalar("train/nonfinite", 1.0, record["iteration"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def train(run: RunConfig, progress: Callable[[dict], None] | None = None,
          resumed: Callable[[int, Path], None] | None = None) -> TrainResult:
    """Train per `run`; every rank of the job calls it. `progress(record)` is called on the logging rank, and so is
    `resumed(iteration, checkpoint_dir)` when the run resumes from a checkpoint."""
    t = run.train
    info = initialize_parallel(run.layout, seed=t.seed)
    device = info.device
    bf16 = t.bf16_on(device)
    tokenizer = load_tokenizer(run.tokenizer)
    if tokenizer.vocab_size > run.model.vocab_size:
        raise ValueError(f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but model "
                         f"{run.model.name!r} has vocab_size={run.model.vocab_size}")
    num_micro = _check_batch(run, info.dp_size)
    run_dir = Path(run.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    model = build_gpt_model(run.model, attention=run.attention, device=device, bf16=bf16,
                            params_dtype=torch.bfloat16 if bf16 else torch.float32, seed=t.seed,
                            max_sequence_length=t.seq_length)
    if device.type == "cuda":
        setup = MegatronOptimizerSetup(model, t.optim, bf16=bf16)
        optimizer, runnable = setup, setup.model
    else:
        shared = model.shared_embedding_or_output_weight() if run.model.tie_embeddings else None
        optimizer = HostOptimizer(model, t.optim, shared_embedding=shared)
    scheduler = lr_scheduler(optimizer, t.optim, t.train_iters)

    ckpt_dir = run_dir / "checkpoints"
    settings = checkpoint.run_settings(run, bf16)
    train_samples = t.train_iters * t.global_batch_size  # what the train split is built for (its shuffle depends on it)
    start, consumed = 0, 0
    if run.resume and checkpoint.latest_iteration(ckpt_dir) is not None:
        start, consumed, extra = checkpoint.load(ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler,
                                                 settings=settings)
        log.info("resumed from %s at iteration %d", ckpt_dir, start)
        built_for = extra.get("train_samples")
        if run.data.kind is not DataKind.MOCK and built_for not in (None, train_samples) and info.is_logging_rank:
            log.warning("the train split is built for %d samples, the checkpointed run's for %d: where the dataset is "
                        "read for more than one epoch, Megatron's shuffle differs, and samples from iteration %d on "
                        "come in another order than that run's (some read again, others not at all)", train_samples,
                        built_for, start + 1)
        if start >= t.train_iters:
            raise ValueError(f"nothing to train: {ckpt_dir} holds a checkpoint at iteration {start}, and this run "
                             f"trains to {t.train_iters}; raise --iters to go on, or remove {ckpt_dir} to start "
                             "again")
        if resumed is not None and info.is_logging_rank:
            resumed(start, ckpt_dir)
    if info.rank == 0:  # after the resume checks: a refused run leaves the configuration its checkpoint was made by
        (run_dir / "run_config.json").write_text(json.dumps(run.to_dict(), indent=2))
    if info.is_logging_rank:
        _remove_earlier_outputs(run_dir, start)
    capture = None
    if run.capture is not None:  # after resume: the predecessor's window counts from the start iteration
        capture = TrainingCapture.open(run, info, layer_offset(model), start)
    sink = None
    try:
        compiled = compile_model(model, run, None if capture is None else capture.spec)
        if device.type == "cuda":
            runnable.module = compiled  # DDP keeps the grad hooks, runs the compiled module
        else:
            runnable = compiled
        train_ds, valid_ds = build_datasets(run.data, tokenizer, seq_length=t.seq_length,
                                            train_samples=train_samples,
                                            valid_samples=t.eval_samples, seed=t.seed)
        validator = Validator(valid_ds, t, info, num_micro) if t.eval_interval else None
        sampler = PretrainingSampler(len(train_ds), consumed, t.micro_batch_size, info.dp_rank, info.dp_size)
        batches = batch_iterator(train_ds, sampler)
        mask = causal_attention_mask(t.seq_length, device)

        def forward_step_func(data_iterator, module):
            batch = next(data_iterator)
            tokens, labels, positions = (batch[k].to(device, non_blocking=True)
                                         for k in ("tokens", "labels", "position_ids"))
            loss_mask = batch["loss_mask"].to(device, non_blocking=True)
            if capture is None:
                output = module(tokens, positions, mask, labels=labels)
            else:  # micro-batch index for this forward and, through a grad hook, for its backward
                output = capture.forward(lambda: module(tokens, positions, mask, labels=labels))

            def loss_func(per_token: torch.Tensor):
                loss = (per_token.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
                return loss, {"lm loss": loss.detach().clone()}  # Megatron divides `loss` in place

            return output, loss_func

        sink = _MetricsSink(run_dir, start, info.is_logging_rank, run.tensorboard)
        sentinel = NonFiniteSentinel(t.nonfinite, run_dir, info.is_logging_rank, info.rank)
        if start:
            sentinel.resume(start, sink.kept)
        result = TrainResult(run_dir=run_dir, iterations=start,
                             metrics_path=sink.path if info.is_logging_rank else None,
                             checkpoint_dir=ckpt_dir if start else None)  # resumed: the run's checkpoints are there
        moe_aux = MoEAuxLosses(model.config)
        moe_aux.start(device)
        runnable.train()
        with quiet_tp_group_lookup():
            for iteration in range(start, t.train_iters):
                if t.control_iter is not None and iteration >= start + t.control_iter:
                    result.stopped_by_control_iter = True
                    break
                if capture is not None:
                    capture.begin_iteration(iteration)
                record = _one_iteration(run, iteration, forward_step_func, batches, runnable, optimizer,
                                        scheduler, num_micro, info)
                record.update(moe_aux.collect(iteration + 1, num_micro))
                event = sentinel.check(iteration + 1, record["loss"], record["grad_norm"], model,
                                       None if capture is None else capture.session)
                if event is not None:
                    record["nonfinite"] = event
                if validator is not None and t.evaluates_at(iteration + 1, start):
                    with capture.paused() if capture is not None else contextlib.nullcontext():
                        record["val_loss"] = validator.loss(forward_step_func, runnable)
                consumed += t.global_batch_size
                result.iterations = iteration + 1
                if info.is_logging_rank:
                    record["consumed_samples"] = consumed
                    sink.write(record)
                    result.records.append(record)
                    if progress is not None:
                        progress(record)
                sentinel.stop_if_fatal(event)  # every rank: loss and grad norm are reduced over the job
                if t.save_interval and (result.iterations % t.save_interval == 0
                                        or result.iterations == t.train_iters):
                    checkpoint.save(ckpt_dir, result.iterations, model=model, optimizer=optimizer,
                                    scheduler=scheduler, consumed_samples=consumed, settings=settings,
                                    extra={"train_samples": train_samples})
                    result.checkpoint_dir = ckpt_dir
    except BaseException:  # error or interrupt: what was captured is drained and committed, then re-raised
        if capture is not None:
            capture.close(failing=True)
        raise
    finally:
        if sink is not None:
            sink.close()
    if capture is not None:
        from fxquant.api import compile_state

        result.capture = dict(capture.close(), uncapturable=len(compile_state(compiled).uncapturable()))
    if compiled is not model and info.is_logging_rank:
        result.sites = write_sites_report(compiled, run_dir / SITES_FILE)
    return result


def write_sites_report(compiled: torch.nn.Module, path: Path) -> list[dict]:
    """What fxquant.compile matched in this rank's model (module path, op, kind, layer, status): JSON at `path`."""
    from fxquant.api import compile_state

    state = compile_state(compiled)
    sites = [{"module_path": s.site.module_path, "op": s.op.value, "kind": s.site.kind.value, "layer": s.site.layer,
              "status": s.status.value, "note": s.note} for s in state.sites()]
    unmatched = [{"target": u.target, "module_path": u.module_path, "shapes": list(u.shapes)}
                 for u in state.unmatched()]
    path.write_text(json.dumps({"scheme": state.scheme.name, "sites": sites, "unmatched": unmatched}, indent=2))
    return sites


def _one_iteration(run, iteration, forward_step_func, batches, runnable, optimizer, scheduler, num_micro, info) -> dict:
    t = run.train
    lr = optimizer.param_groups[0]["lr"]
    start = time.perf_counter()
    optimizer.zero_grad()
    losses = forward_backward(forward_step_func=forward_step_func, data_iterator=batches, model=runnable,
                              num_microbatches=num_micro, seq_length=t.seq_length,
                              micro_batch_size=t.micro_batch_size)
    stats = optimizer.step()
    scheduler.step(1)
    loss = mean_loss(losses, info)
    if info.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"iteration": iteration + 1, "loss": loss, "lr": lr, "grad_norm": stats.grad_norm,
            "skipped": stats.skipped, "step_time_s": seconds,
            "tokens_per_s": t.global_batch_size * t.seq_length / seconds}
