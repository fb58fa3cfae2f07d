"""Megatron-core 0.16.1 on a non-CUDA device (ARCHITECTURE.md trap 10): what has to be swapped, and nothing more.

Megatron-core assumes CUDA in four places a CPU run reaches:
- `parallel_state`'s global memory buffer (used by the unfused `DotProductAttention` for its baddbmm
  output) allocates on `torch.cuda.current_device()`: `DeviceMemoryBuffer` allocates on a chosen device.
- the tensor-parallel RNG tracker (`get_cuda_rng_tracker().fork()` around attention dropout, expert
  init) saves and restores CUDA generator states: `HostRNGStatesTracker` keeps CPU generator states.
- `RotaryEmbedding.get_emb` moves its frequencies to CUDA on first use: `HostRotaryEmbedding` keeps them
  on the device they were built on.
- `LanguageModule.setup_embeddings_and_output_layer` moves a tied embedding to CUDA before the all-reduce
  that gives the last pipeline stage the first stage's weights: `HostGPTModel` all-reduces it where it is.
`install_device_support(device)` installs the first two into Megatron's module globals (the slots
Megatron itself fills at initialisation; nothing of torch is touched); `model.build_gpt_model` builds a
`HostGPTModel` and swaps the rotary embedding. On CUDA nothing here is used.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import operator
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.utils import GlobalMemoryBuffer

log = logging.getLogger(__name__)

# Megatron's tracker names (megatron.core.tensor_parallel.random), reused so forks find their states.
_MODEL_PARALLEL_RNG = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME
_DATA_PARALLEL_RNG = megatron_random._DATA_PARALLEL_RNG_TRACKER_NAME
_EXPERT_PARALLEL_RNG = megatron_random._EXPERT_PARALLEL_RNG_TRACKER_NAME


class DeviceMemoryBuffer(GlobalMemoryBuffer):
    """Megatron's GlobalMemoryBuffer, allocating on `device` instead of the current CUDA device."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context: Callable | None = None):
        if torch.compiler.is_compiling():
            # A traced graph allocates its own scratch (the compiler plans its memory). Filling the dict here would
            # be a side effect Dynamo guards on: the next call would find the entry, fail the guard and recompile.
            return torch.empty(tuple(tensor_shape), dtype=dtype, device=self.device)
        required = functools.reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < required:
            with (mem_alloc_context or contextlib.nullcontext)():
                buf = torch.empty(required, dtype=dtype, device=self.device, requires_grad=False)
            self.buffer[(name, dtype)] = buf
        return buf[0:required].view(*tensor_shape)


class HostRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """The tensor-parallel RNG tracker over the CPU generator.

    Same contract as Megatron's CudaRNGStatesTracker: named states seeded once, `fork(name)` runs a block
    with that state and restores the default one afterwards. Inside a torch.compile trace the fork is
    transparent (Dynamo cannot save/restore generator state without a graph break); this only matters
    for dropout inside tensor-parallel regions, which the shipped configurations do not use (p = 0).
    """

    def __init__(self) -> None:
        super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=False)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
        if torch.compiler.is_compiling():
            yield
            return
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not tracked; tracked: {sorted(self.states_)}")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


class HostRotaryEmbedding(RotaryEmbedding):
    """Megatron's RotaryEmbedding built on the host, without the move of `inv_freq` to CUDA on first use."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["use_cpu_initialization"] = True
        super().__init__(*args, **kwargs)

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]


class HostGPTModel(GPTModel):
    """Megatron's GPTModel, whose tied-embedding set-up all-reduces the weight on its own device.

    With tied embeddings and pipeline stages, Megatron's set-up marks the last stage's copy of the word
    embeddings (`shared`, `shared_embedding`), zeroes it, and all-reduces it with the first stage's over the
    embedding group, so both start equal; after every backward the two gradients are all-reduced over the same
    group (`optim.HostOptimizer` off CUDA, Megatron's `finalize_model_grads` on CUDA). Megatron 0.16.1 moves
    the weight to CUDA for that all-reduce (`weight.data.cuda()`); here Megatron's own set-up runs with the
    embedding group hidden for the duration of the call, which skips only its all-reduce, and the same
    all-reduce then runs on the weight's device (gloo on CPU).
    """

    def setup_embeddings_and_output_layer(self) -> None:
        group, self.embd_group = self.embd_group, None
        try:
            super().setup_embeddings_and_output_layer()
        finally:
            self.embd_group = group
        tied = self.share_embeddings_and_output_weights or getattr(self.config, "mtp_num_layers", 0)
        if (tied and self.config.pipeline_model_parallel_size > 1 and dist.is_initialized()
                and self._is_in_embd_group()):
            dist.all_reduce(self.shared_embedding_or_output_weight().data, group=self.embd_group)


def install_device_support(device: torch.device | str, seed: int) -> None:
    """Make Megatron's global memory buffer and RNG tracker work on `device` (call after parallel_state init).

    On CUDA this seeds Megatron's own tracker (`model_parallel_cuda_manual_seed`); elsewhere it installs
    `DeviceMemoryBuffer` and `HostRNGStatesTracker`, seeded the way Megatron seeds its tracker.
    """
    device = torch.device(device)
    if device.type == "cuda":
        megatron_random.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        return
    parallel_state._GLOBAL_MEMORY_BUFFER = DeviceMemoryBuffer(device)
    tracker = HostRNGStatesTracker()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    # The same seed layout as megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed.
    tracker.add(_DATA_PARALLEL_RNG, seed)
    tracker.add(_MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG, seed + 1024 + 100 * ep_rank + etp_rank)
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    log.debug("installed host memory buffer and RNG tracker for %s (seed %d)", device, seed)
