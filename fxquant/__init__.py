"""fxquant: quantized-GEMM emulation for low-precision training research, as a torch.compile backend.

    >>> import fxquant
    >>> model = fxquant.compile(model, scheme="FA_linear_hifp8")    # every GEMM operand per the scheme
    >>> print(fxquant.explain(model, tokens, scheme="linear_mxfp8"))  # which sites, which formats

Public names: ``compile``, ``explain``, ``formats``, ``schemes``. Imports are lazy so that
``import fxquant`` stays light (no Dynamo or Inductor until ``compile`` is used).
"""
from __future__ import annotations

import importlib

__all__ = ["compile", "explain", "formats", "schemes"]

_LAZY = {"compile": "fxquant.api", "explain": "fxquant.api", "compile_state": "fxquant.api"}
_SUBMODULES = {"formats", "schemes", "counters", "passes", "backend", "api", "ops", "qfunctions"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"fxquant.{name}")
    raise AttributeError(f"module 'fxquant' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(_LAZY) | _SUBMODULES)
