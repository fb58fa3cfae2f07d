"""Forward/backward over the micro-batches of one iteration: Megatron's schedules, or a host equivalent.

`forward_backward(...)` has the signature of the function `megatron.core.pipeline_parallel.
get_forward_backward_func()` returns, and on CUDA it is that function (no pipelining, or 1F1B).
Megatron 0.16.1's schedule loops and p2p communication allocate on `'cuda'` literally, so on other
devices `host_forward_backward` runs instead: Megatron's own per-micro-batch `forward_step` /
`backward_step` (loss scaling, MoE aux-loss scale, `set_input_tensor`), with all forwards then all
backwards (GPipe order) and activations / gradients exchanged between pipeline stages with blocking
`torch.distributed.send/recv` (gloo). Same losses and gradients as 1F1B; more activation memory,
which only matters at sizes nobody trains on a CPU.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
from megatron.core.utils import get_model_config


def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                     micro_batch_size: int, forward_only: bool = False) -> list[dict]:
    """Run one iteration's micro-batches; returns the per-micro-batch loss dicts (last stage only)."""
    device = next(model.parameters()).device
    kwargs = dict(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                  num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
                  forward_only=forward_only)
    if device.type == "cuda":
        return get_forward_backward_func()(**kwargs)
    return host_forward_backward(**kwargs)


def _send(tensor: torch.Tensor, peer: int) -> None:
    dist.send(tensor.detach().contiguous(), peer, group=parallel_state.get_pipeline_model_parallel_group())


def _recv(shape, dtype, peer: int, requires_grad: bool) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype)
    dist.recv(buf, peer, group=parallel_state.get_pipeline_model_parallel_group())
    return buf.requires_grad_(requires_grad)


def _peer(offset: int) -> int:
    """Global rank of the pipeline stage `offset` away (in the pipeline group's rank order)."""
    ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    return ranks[parallel_state.get_pipeline_model_parallel_rank() + offset]


def host_forward_backward(*, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                          micro_batch_size: int, forward_only: bool = False) -> list[dict]:
    config = get_model_config(model)
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    hidden = config.hidden_size
    shape = (seq_length, micro_batch_size, hidden)  # [s, b, h], Megatron's activation layout
    dtype = config.pipeline_dtype or torch.float32
    cp_size = parallel_state.get_context_parallel_world_size()
    store: list = []
    inputs, outputs = [], []
    for i in range(num_microbatches):
        input_tensor = None if first else _recv(shape, dtype, _peer(-1), requires_grad=not forward_only)
        output, _ = forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                                 store, config, cp_size, is_first_microbatch=i == 0, current_microbatch=i,
                                 is_last_stage=last)
        if not last:
            _send(output, _peer(+1))
        if forward_only:
            continue
        inputs.append(input_tensor)
        outputs.append(output)
    if forward_only:
        return store
    for i in reversed(range(num_microbatches)):
        output_grad = None if last else _recv(shape, dtype, _peer(+1), requires_grad=False)
        input_grad = backward_step(inputs[i], outputs[i], output_grad, ModelType.encoder_or_decoder, config)
        if not first:
            _send(input_grad, _peer(-1))
        inputs[i] = outputs[i] = None
    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([model])
    return store
