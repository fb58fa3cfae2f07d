"""Optimizer, gradient finalisation and LR schedule for the training loop, on megatron.core.

Two implementations behind one small interface (`zero_grad`, `step() -> StepStats`, `state_dict`,
`load_state_dict`), chosen by device:
- CUDA: `MegatronOptimizerSetup` = Megatron's `DistributedDataParallel` wrapper, `get_megatron_optimizer`
  (Adam, optional distributed optimizer, bf16 master weights, grad clipping) and `finalize_model_grads`
  (DP reduce-scatter/all-reduce, tied-embedding and layernorm grads).
- elsewhere: `HostOptimizer`, because Megatron 0.16.1's DDP buffers, optimizer and clip_grads allocate
  on `'cuda'` literally. It does what they do, on the host: DP-mean gradients (gloo), all-reduce the
  tied embedding's gradient between first and last pipeline stage, the global grad norm over the
  model-parallel group counting each TP-duplicated parameter once (Megatron's own
  `param_is_not_tensor_parallel_duplicate` / `param_is_not_shared`), clipping, then torch AdamW with
  Megatron's parameter groups (no weight decay on biases and norms).
The LR schedule is Megatron's `OptimizerParamScheduler` (warm-up, then cosine/linear/constant decay) on
both paths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from fxquant.megatron_glue.run_config import OptimConfig, warmup_for


@dataclass(frozen=True)
class StepStats:
    grad_norm: float
    skipped: bool


def _no_decay(name: str, param: torch.nn.Parameter) -> bool:
    return param.dim() == 1 or name.endswith(".bias")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if _no_decay(name, p) else decay).append(p)
    return [{"params": decay, "wd_mult": 1.0, "weight_decay": weight_decay},
            {"params": no_decay, "wd_mult": 0.0, "weight_decay": 0.0}]


class HostOptimizer:
    """AdamW with Megatron's gradient finalisation and clipping, for CPU (gloo) runs."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, shared_embedding: torch.nn.Parameter | None) -> None:
        if cfg.distributed_optimizer:
            raise ValueError("distributed_optimizer=True needs CUDA (Megatron's DistributedOptimizer); "
                             "this run is on the host")
        self.model, self.cfg = model, cfg
        self.shared_embedding = shared_embedding
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                                           betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def finalize_grads(self) -> None:
        dp = parallel_state.get_data_parallel_world_size()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if dp > 1:
                dist.all_reduce(p.grad, group=parallel_state.get_data_parallel_group())
                p.grad.div_(dp)
        if self.shared_embedding is not None and parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(self.shared_embedding.grad, group=parallel_state.get_embedding_group())

    def grad_norm(self) -> float:
        squares = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                squares += p.grad.double().pow(2).sum().cpu()
        if dist.get_world_size(parallel_state.get_model_parallel_group()) > 1:
            dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
        return math.sqrt(squares.item())

    def step(self) -> StepStats:
        self.finalize_grads()
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return StepStats(norm, skipped=True)
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            scale = self.cfg.clip_grad / (norm + 1e-6)
            for p in self.params:
                p.grad.mul_(scale)
        self.optimizer.step()
        return StepStats(norm, skipped=False)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


class MegatronOptimizerSetup:
    """Megatron's DDP + optimizer on CUDA. `self.model` is the DDP-wrapped module to run."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, *, bf16: bool) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        tcfg = model.config
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=cfg.distributed_optimizer)
        self.model = DistributedDataParallel(config=tcfg, ddp_config=ddp_config, module=model)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=cfg.distributed_optimizer), [self.model])
        tcfg.finalize_model_grads_func = finalize_model_grads
        tcfg.no_sync_func = self.model.no_sync
        tcfg.grad_scale_func = self.optimizer.scale_loss

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> StepStats:
        ok, grad_norm, _ = self.optimizer.step()
        return StepStats(float(grad_norm) if grad_norm is not None else float("nan"), skipped=not ok)

    def state_dict(self) -> dict:
        if self.optimizer.config.use_distributed_optimizer:
            raise ValueError("checkpointing with the distributed optimizer is not supported; set "
                             "train.optim.distributed_optimizer to false in the run config to save checkpoints")
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def lr_scheduler(optimizer, cfg: OptimConfig, train_iters: int) -> OptimizerParamScheduler:
    """Megatron's scheduler, stepped once per iteration (warm-up from 0, decay to min_lr). The warm-up is
    clipped to `train_iters - 1` iterations (`run_config.warmup_for`), so a run shorter than its config's
    warm-up still reaches the peak lr (`--iters 1` trains at `lr`, not at 0)."""
    warmup = warmup_for(cfg, train_iters)
    decay = cfg.decay_iters or train_iters
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=max(decay, warmup + 1), lr_decay_style=cfg.decay_style,
        start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=max(decay, 1),
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
    )  # on resume the schedule stays this run's (checkpoint.load restores the step count)
