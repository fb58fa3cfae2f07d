"""The predecessor's capture controls, meaning what they meant (PREDECESSOR.md "Tensor capture").

    --save-tensors            capture on                     env TENSOR_SAVE_ENABLED=true|1|yes
    --tensor-save-dir DIR     where (default ./enhanced_tensor_logs)   env TENSOR_SAVE_DIR
    --control-iter N          collect for N iterations, then stop training (default 1; 0 = no limit)
    CUSTOM_QUANT_TYPE         the quant type name recorded as the run's scheme when none is given

``add_arguments(parser)`` adds the flags to an argparse parser (the Megatron launcher uses it);
``from_predecessor(...)`` turns flags + environment into ``(CaptureSpec, SessionConfig kwargs)`` or
None when capture is off. Flags win over the environment. The spec is the shipped ``predecessor``
spec with its iteration window set to ``[start_iteration, start_iteration + N)`` and every micro-batch
of those iterations, on every rank.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from fxquant.capture.spec import ALL, CaptureSpec, Span, Window, load_spec

DEFAULT_DIR = "./enhanced_tensor_logs"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tensor capture (predecessor-compatible)")
    g.add_argument("--save-tensors", action="store_true", default=None,
                   help="capture tensors around every quantized GEMM for --control-iter iterations, then stop "
                   "training (env TENSOR_SAVE_ENABLED; default off)")
    g.add_argument("--tensor-save-dir", default=None,
                   help=f"capture directory (env TENSOR_SAVE_DIR; default {DEFAULT_DIR})")
    g.add_argument("--control-iter", type=int, default=None, metavar="N",
                   help="train N iterations of this run, then stop training; with --save-tensors capture covers "
                   "those N (default: 1 with --save-tensors, else no limit; 0: no limit)")


def _env_flag(env: dict, name: str) -> bool | None:
    raw = env.get(name)
    if raw is None:
        return None
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of {list(_TRUE) + list(_FALSE)[:-1]}")


def from_predecessor(
    save_tensors: bool | None = None,
    tensor_save_dir: str | None = None,
    control_iter: int | None = None,
    *,
    start_iteration: int = 0,
    scheme: str | None = None,
    spec: CaptureSpec | None = None,
    env: dict | None = None,
) -> tuple[CaptureSpec, dict] | None:
    """(spec, session config kwargs) per the predecessor's flags and environment; None if capture is off."""
    env = dict(os.environ) if env is None else env
    enabled = save_tensors if save_tensors is not None else _env_flag(env, "TENSOR_SAVE_ENABLED")
    if not enabled:
        return None
    n = 1 if control_iter is None else control_iter
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"control_iter={control_iter!r}: must be an integer >= 0 (0: no limit)")
    base = spec if spec is not None else load_spec("predecessor")
    iters = Span(start_iteration, None if n == 0 else start_iteration + n)
    sections = tuple(dataclasses.replace(s, when=Window(iters, ALL, s.when.ranks)) for s in base.sections)
    out = dataclasses.replace(base, sections=sections)
    root = tensor_save_dir or env.get("TENSOR_SAVE_DIR") or DEFAULT_DIR
    config = {"root": Path(root), "start_iteration": start_iteration,
              "scheme": scheme or env.get("CUSTOM_QUANT_TYPE") or "unknown"}
    return out, config


def from_args(args: argparse.Namespace, **kwargs) -> tuple[CaptureSpec, dict] | None:
    """``from_predecessor`` with the values of ``add_arguments``' flags."""
    return from_predecessor(getattr(args, "save_tensors", None), getattr(args, "tensor_save_dir", None),
                            getattr(args, "control_iter", None), **kwargs)
