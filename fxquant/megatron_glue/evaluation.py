"""Loss reduction and validation inside the training loop.

- `mean_loss(loss_dicts, info)`: the iteration's language-model loss, the mean over micro-batches (last
  pipeline stage) and data-parallel ranks; 0.0 on the other stages.
- `Validator`: the validation loss, forward only (model in eval mode, no autograd), on the *same*
  `eval_iters` global batches of the validation split every time (Megatron's GPTDataset valid split, or
  MockGPTDataset's), so that values at different iterations, and of runs with different schemes, are
  comparable. Every rank calls it (pipeline stages exchange activations, data-parallel ranks reduce).
  A compiled model is recompiled once for eval mode; fxquant's passes quantize its forward GEMMs as in
  training (Megatron linears traced without grad), so the validation loss is the quantized model's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from fxquant.megatron_glue.data import PretrainingSampler, batch_iterator
from fxquant.megatron_glue.parallel import ParallelInfo
from fxquant.megatron_glue.run_config import TrainConfig
from fxquant.megatron_glue.schedule import forward_backward


def mean_loss(losses: list[dict], info: ParallelInfo, key: str = "lm loss") -> float:
    """Mean of `key` over the micro-batch loss dicts (last stage) and over data-parallel ranks."""
    loss = torch.zeros((), dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage():
        loss = torch.stack([d[key].double().cpu() for d in losses]).mean()
        if info.dp_size > 1:
            loss_dp = loss.to(info.device)
            dist.all_reduce(loss_dp, group=parallel_state.get_data_parallel_group())
            loss = loss_dp.cpu() / info.dp_size
    return loss.item()


class Validator:
    """The validation loss of a model on fixed batches of `dataset` (see the module docstring)."""

    def __init__(self, dataset, train: TrainConfig, info: ParallelInfo, num_microbatches: int) -> None:
        if dataset is None or len(dataset) < train.eval_samples:
            have = 0 if dataset is None else len(dataset)
            raise ValueError(f"eval_interval={train.eval_interval} needs {train.eval_samples} validation samples "
                             f"(eval_iters={train.eval_iters} x global_batch_size={train.global_batch_size}) but "
                             f"the validation split has {have}; give the data split a validation share "
                             f"(e.g. split='98,2,0') or set eval_interval=0")
        self.dataset, self.train, self.info = dataset, train, info
        self.num_microbatches = num_microbatches

    def loss(self, forward_step_func, model: torch.nn.Module) -> float:
        t, info = self.train, self.info
        sampler = PretrainingSampler(t.eval_samples, 0, t.micro_batch_size, info.dp_rank, info.dp_size)
        batches = batch_iterator(self.dataset, sampler)
        losses: list[dict] = []
        was_training = model.training
        model.eval()
        # the RNG as it was: a validation's stochastic-rounding seeds come from torch's generators, and training
        # goes on with the state it would have had without the validation (the same losses bit for bit)
        devices = [info.device] if info.device.type == "cuda" else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                for _ in range(t.eval_iters):
                    losses += forward_backward(forward_step_func=forward_step_func, data_iterator=batches,
                                               model=model, num_microbatches=self.num_microbatches,
                                               seq_length=t.seq_length, micro_batch_size=t.micro_batch_size,
                                               forward_only=True)
        finally:
            model.train(was_training)
        return mean_loss(losses, info)
