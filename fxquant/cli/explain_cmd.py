"""`fxquant explain`: print every matched site of a model (module path, layer, kind, each GEMM operand's
format) and every matmul-like op left unmatched, for a scheme.

    fxquant explain --scheme FA_linear_hifp8 --model tests.models:make_llama --seq-len 16

``--model`` is ``module:factory``, a zero-argument callable returning an nn.Module that takes a
``[batch, seq_len]`` LongTensor of token ids, drawn from ``[0, vocab)``: ``--vocab`` defaults to the model's
first ``nn.Embedding`` (its ``num_embeddings``), and ``--seq-len`` / ``--batch`` to 16 / 2.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# fxquant.lowering.Kernels' values, written out: importing fxquant.lowering pulls in torch._inductor (seconds),
# which every verb's --help would pay for (tests/test_cli_help.py checks the two agree)
KERNELS = ("auto", "inductor", "triton", "reference")


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
    vocab = _vocab(model, args.vocab)
    for flag, value in (("--seq-len", args.seq_len), ("--batch", args.batch)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1")
    tokens = torch.randint(0, vocab, (args.batch, args.seq_len))
    try:
        explanation = fxquant.explain(model, tokens, scheme=args.scheme, kernels=args.kernels,
                                      backend=args.backend)
    except (IndexError, RuntimeError) as exc:  # the model's own forward failed on these inputs
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--model {args.model!r}: its forward on token ids of shape [{args.batch}, {args.seq_len}] "
                         f"in [0, {vocab}) failed ({type(exc).__name__}: {first}); check --vocab, --seq-len "
                         f"and --batch") from None
    print(explanation)
    return 0


def _vocab(model, given: int | None) -> int:
    """--vocab, checked against the model's first nn.Embedding; that embedding's size when not given."""
    import torch

    embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    size = None if embedding is None else embedding.num_embeddings
    if given is None:
        if size is None:
            raise ValueError("the model has no nn.Embedding: `fxquant explain` feeds a model token ids, drawn from "
                             "[0, --vocab), and takes the vocabulary size from its first nn.Embedding; give --vocab "
                             "for a token model without one, or call fxquant.explain(model, *inputs, scheme=...) in "
                             "Python for a model with other inputs")
        return size
    if given < 1:
        raise ValueError(f"--vocab {given}: must be >= 1")
    if size is not None and given > size:
        raise ValueError(f"--vocab {given} exceeds the model's embedding ({size} rows): token ids must lie in "
                         f"[0, {size}); leave --vocab out to use {size}")
    return given


def register(subparsers) -> None:
    p = subparsers.add_parser("explain", help="list the GEMM sites a scheme quantizes in a model",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--scheme", required=True, help="preset name or scheme YAML path (`fxquant schemes`)")
    p.add_argument("--model", required=True, help="module:factory returning the nn.Module")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence of the example input")
    p.add_argument("--batch", type=int, default=2, help="sequences in the example input")
    p.add_argument("--vocab", type=int, default=None, help="token ids are drawn from [0, VOCAB) (default: the size "
                   "of the model's first nn.Embedding)")
    p.add_argument("--kernels", default="auto", choices=KERNELS,
                   help="quantize implementation to report, as fxquant.compile(kernels=...)")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                   help="compile backend the report assumes, as fxquant.compile(backend=...)")
    p.set_defaults(func=run)
