"""`fxquant explain`: print every matched site of a model (module path, layer, kind, each GEMM operand's
format) and every matmul-like op left unmatched, for a scheme.

    fxquant explain --scheme FA_linear_hifp8 --model tests.models:make_llama --seq-len 16

``--model`` is ``module:factory``, a zero-argument callable returning an nn.Module that takes a
``[batch, seq_len]`` LongTensor of token ids (vocabulary size from ``--vocab``).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from fxquant.lowering import Kernels


def _load_factory(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model {spec!r}: expected 'package.module:factory'")
    if os.getcwd() not in sys.path:  # as `python -m` does: modules of the current directory are importable
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r} ({exc})") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {attr!r} is not a callable in {module_name}")
    return factory


def run(args: argparse.Namespace) -> int:
    import torch

    import fxquant

    model = _load_factory(args.model)()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"--model {args.model!r} returned {type(model).__name__}, not an nn.Module")
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    print(fxquant.explain(model, tokens, scheme=args.scheme, kernels=args.kernels, backend=args.backend))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("explain", help="list the GEMM sites a scheme quantizes in a model",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--scheme", required=True, help="preset name or scheme YAML path")
    p.add_argument("--model", required=True, help="module:factory returning the nn.Module")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--kernels", default="auto", choices=[k.value for k in Kernels],
                   help="quantize implementation to report, as fxquant.compile(kernels=...) (default: %(default)s)")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                   help="compile backend the report assumes (default: %(default)s)")
    p.set_defaults(func=run)
