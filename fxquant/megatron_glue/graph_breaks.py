"""Removing the graph breaks Megatron-core 0.16.1 puts in front of torch.compile (ARCHITECTURE.md trap 10).

`megatron.core.utils.get_tensor_model_parallel_group_if_none` calls `warnings.warn` (a deprecation
notice) whenever a caller passes no tensor-parallel group; Dynamo cannot trace `warnings.warn`, and a
Megatron GPTModel breaks into a dozen graphs. The function is imported by name into several Megatron
modules, so `quiet_tp_group_lookup()` rebinds that name, in every loaded module that holds Megatron's
function, to `_tp_group_if_none` (the same lookup without the warning) and restores the original
bindings on exit. Scoped and reversible: torch is never patched, and only Megatron module attributes that
are the original function are touched. Hold it while a compiled Megatron model is traced (its first
calls, any recompilation): `fxquant.megatron_glue.train` holds it for the whole run.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

import torch
from megatron.core import parallel_state
from megatron.core import utils as megatron_utils

_NAME = "get_tensor_model_parallel_group_if_none"
_ORIGINAL = getattr(megatron_utils, _NAME)
_lock = threading.Lock()
_depth = 0
_rebound: list[object] = []


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


def _megatron_modules() -> list[object]:
    return [m for name, m in list(sys.modules.items())
            if m is not None and name.startswith("megatron.") and getattr(m, _NAME, None) is _ORIGINAL]


@contextlib.contextmanager
def quiet_tp_group_lookup() -> Iterator[None]:
    """Within the block, Megatron looks up the default TP group without a warning (no graph breaks).

    Re-entrant: nested uses share one patch; the outermost exit restores Megatron's function.
    """
    global _depth
    with _lock:
        if _depth == 0:
            _rebound[:] = _megatron_modules()
            for module in _rebound:
                setattr(module, _NAME, _tp_group_if_none)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for module in _rebound:
                    setattr(module, _NAME, _ORIGINAL)
                _rebound.clear()


def is_quiet() -> bool:
    """True while `quiet_tp_group_lookup()` is active."""
    return _depth > 0
