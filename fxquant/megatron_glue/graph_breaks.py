"""Removing the graph breaks Megatron-core 0.16.1 puts in front of torch.compile (ARCHITECTURE.md trap 10).

`traceable_megatron()` is a scoped, reversible context manager that rebinds a few attributes of Megatron's
own modules (torch is never patched) and restores them on exit. Each measure removes one measured break:

1. `megatron.core.utils.get_tensor_model_parallel_group_if_none` calls `warnings.warn` (a deprecation
   notice) whenever a caller passes no tensor-parallel group; Dynamo cannot trace `warnings.warn`, and a
   GPTModel breaks into a dozen graphs. The function is imported by name into several Megatron modules;
   every such binding is rebound to `_tp_group_if_none` (the same lookup without the warning).
2. TP > 1: `ColumnParallelLinear` all-reduces its input gradient inside the linear's backward with
   `torch.distributed.all_reduce(..., async_op=True)`, which Dynamo refuses ("async_op=True for
   distributed collectives"); the whole `autograd.Function` then runs outside the graph, unquantized.
   `megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication` is rebound to
   `SyncDgradLinear`: Megatron's own forward and backward, with the dgrad all-reduce done synchronously
   after Megatron's backward returns (Dynamo traces a synchronous all-reduce as a functional collective).
   The sum is the same; only the overlap of that all-reduce with the wgrad GEMM is given up.
3. TP > 1: `linear_with_grad_accumulation_and_async_allreduce` warns once about
   CUDA_DEVICE_MAX_CONNECTIONS (another `warnings.warn`): its `warned` flag is held at True.

Hold it while a compiled Megatron model runs (its first calls trace it; Dynamo guards on the rebound names,
so a call outside it recompiles): `fxquant.megatron_glue.train` holds it for the whole run. Re-entrant:
nested uses share one patch; the outermost exit restores everything. `quiet_tp_group_lookup` is the
same context manager under another name.

Not covered: sequence parallelism on a non-CUDA device. Megatron 0.16.1's sequence-parallel paths allocate
their gather/scatter buffers on `torch.cuda.current_device()` (tensor_parallel/mappings.py, and the
linear's backward), so a CPU run fails eagerly, before torch.compile is involved.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

import torch
from megatron.core import parallel_state
from megatron.core import utils as megatron_utils
from megatron.core.tensor_parallel import layers as megatron_layers

_NAME = "get_tensor_model_parallel_group_if_none"
_ORIGINAL = getattr(megatron_utils, _NAME)
_LINEAR_FN_NAME = "LinearWithGradAccumulationAndAsyncCommunication"
_ORIGINAL_LINEAR_FN = getattr(megatron_layers, _LINEAR_FN_NAME)
# Megatron's bodies without their custom_fwd/custom_bwd wrappers (ours carry them): Dynamo only accepts the
# autocast wrapper of the backward it is tracing, not a second one called from inside it.
_MEGATRON_FORWARD = _ORIGINAL_LINEAR_FN.forward.__wrapped__
_MEGATRON_BACKWARD = _ORIGINAL_LINEAR_FN.backward.__wrapped__
_WRAPPER = megatron_layers.linear_with_grad_accumulation_and_async_allreduce
_lock = threading.Lock()
_depth = 0
_rebound: list[object] = []
_saved_warned: list[bool] = []


def _tp_group_if_none(tp_group=None, is_expert=False, check_initialized=True):
    """megatron.core.utils.get_tensor_model_parallel_group_if_none (0.16.1) minus its warnings.warn."""
    if not torch.distributed.is_initialized():
        return None
    if not parallel_state.is_initialized():
        return tp_group
    if tp_group is None:
        if is_expert:
            return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
        return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
    return tp_group


class SyncDgradLinear(_ORIGINAL_LINEAR_FN):
    """Megatron's LinearWithGradAccumulationAndAsyncCommunication with a synchronous dgrad all-reduce.

    forward runs Megatron's forward with `allreduce_dgrad=False` and remembers the flag; backward runs
    Megatron's backward (which then skips its async all-reduce) and all-reduces the input gradient over
    the tensor-parallel group itself, synchronously. Everything else (sequence parallelism, gradient
    accumulation fusion, deferred wgrad) is Megatron's code unchanged.
    """

    @staticmethod
    @megatron_layers.custom_fwd
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                grad_output_buffer, wgrad_deferral_limit, tp_group):
        output = _MEGATRON_FORWARD(ctx, input, weight, bias, gradient_accumulation_fusion, False,
                                   sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group)
        ctx.sync_allreduce_dgrad = allreduce_dgrad
        return output

    @staticmethod
    @megatron_layers.custom_bwd
    def backward(ctx, grad_output):
        grads = _MEGATRON_BACKWARD(ctx, grad_output)
        if ctx.sync_allreduce_dgrad:
            torch.distributed.all_reduce(grads[0], group=ctx.tp_group)
        return grads


def _megatron_modules() -> list[object]:
    return [m for name, m in list(sys.modules.items())
            if m is not None and name.startswith("megatron.") and getattr(m, _NAME, None) is _ORIGINAL]


def _apply() -> None:
    _rebound[:] = _megatron_modules()
    for module in _rebound:
        setattr(module, _NAME, _tp_group_if_none)
    setattr(megatron_layers, _LINEAR_FN_NAME, SyncDgradLinear)
    _saved_warned[:] = [_WRAPPER.warned]
    _WRAPPER.warned = True


def _restore() -> None:
    for module in _rebound:
        setattr(module, _NAME, _ORIGINAL)
    _rebound.clear()
    setattr(megatron_layers, _LINEAR_FN_NAME, _ORIGINAL_LINEAR_FN)
    if _saved_warned:
        _WRAPPER.warned = _saved_warned.pop()


@contextlib.contextmanager
def traceable_megatron() -> Iterator[None]:
    """Within the block, a Megatron GPTModel (TP >= 1, no sequence parallelism) traces as one graph.

    Re-entrant: nested uses share one patch; the outermost exit restores Megatron's bindings.
    """
    global _depth
    with _lock:
        if _depth == 0:
            _apply()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _restore()


quiet_tp_group_lookup = traceable_megatron  # alias, used by train.py and the tests


def is_quiet() -> bool:
    """True while `traceable_megatron()` (alias `quiet_tp_group_lookup()`) is active."""
    return _depth > 0
