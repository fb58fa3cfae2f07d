"""Process groups for Megatron-core: from the torchrun environment, or a single process with no launcher.

`initialize_parallel(ParallelLayout(tp, pp))` starts `torch.distributed` (gloo on CPU, NCCL on CUDA) from
torchrun's RANK/WORLD_SIZE/MASTER_ADDR variables when present, else as a one-process group on an
in-memory store (no port, no launcher), then initialises Megatron's `parallel_state` (data parallelism is
what is left: world / (tp * pp)) and installs what Megatron needs on the chosen device
(`host.install_device_support`). `destroy_parallel()` undoes it, so tests can build models repeatedly.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from fxquant.megatron_glue.host import install_device_support
from fxquant.megatron_glue.run_config import ParallelLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelInfo:
    """Where this process sits: global rank and its tensor/pipeline/data coordinates."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_logging_rank(self) -> bool:
        """The rank that prints and writes metrics: last pipeline stage, tp 0, dp 0 (it holds the loss)."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def initialize_parallel(layout: ParallelLayout = ParallelLayout(), *, device: torch.device | str | None = None,
                        seed: int = 1234, timeout_minutes: int = 10) -> ParallelInfo:
    """Start torch.distributed (if needed) and Megatron's parallel state; return this rank's coordinates."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend=backend, init_method="env://")
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    layout.data_parallel_size(world)  # validates divisibility with a clear message
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=device.type != "cuda",
    )
    install_device_support(device, seed)
    torch.manual_seed(seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    info = current_info(device)
    log.info("parallel state: %s", info)
    return info


def current_info(device: torch.device | None = None) -> ParallelInfo:
    return ParallelInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        device=device if device is not None else default_device(),
    )


def destroy_parallel() -> None:
    """Tear down Megatron's parallel state and the process group (safe to call when not initialised)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
