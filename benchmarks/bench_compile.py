"""Compile time of a 2-layer model on CPU: fxquant.compile vs plain torch.compile (issue 3, "Speed").

Each case compiles a fresh model in a fresh Dynamo state and times the first forward+backward (compile
included) and a later step. Each case compiles cold: in a temporary Inductor cache directory, with Inductor's
in-memory code caches cleared (``fresh_caches``), so no case reuses kernels an earlier case compiled (the
process itself, its imports and compile workers, is warmed up by a throwaway first case). Prints a table; with --json PATH also writes the rows as JSON.

    python benchmarks/bench_compile.py [--backends inductor aot_eager] [--scheme FA_linear_mxfp8] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from envinfo import environment  # noqa: E402
from fxquant.analysis.outputs import strict_dumps  # noqa: E402
import fxquant  # noqa: E402
from tests.models import make_llama, make_tokens, next_token_loss  # noqa: E402


def step(model, tokens) -> float:
    t0 = time.perf_counter()
    next_token_loss(model(tokens), tokens).backward()
    return time.perf_counter() - t0


def fresh_caches():
    """Inductor's context for a cold compile: a temporary cache directory (removed after) and its in-memory code
    caches cleared on entry and exit, so that no case loads kernels an earlier case of the process compiled."""
    from torch._inductor import utils

    return getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache  # the older name: torch < 2.8


def case(backend: str, scheme: str | None, tokens) -> dict:
    torch._dynamo.reset()
    with fresh_caches()():
        model = make_llama()
        if scheme is None:
            compiled = torch.compile(model, backend=backend)
        else:
            compiled = fxquant.compile(model, scheme, backend=backend)
        first = step(compiled, tokens)
        later = min(step(compiled, tokens) for _ in range(3))
    return {"backend": backend, "scheme": scheme or "(plain torch.compile)", "first_step_s": first, "step_s": later}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["inductor", "aot_eager"])
    parser.add_argument("--scheme", default="FA_linear_mxfp8")
    parser.add_argument("--json", "--out", dest="json", type=Path, default=None,
                        help="write the rows here (default: no file)")
    args = parser.parse_args()
    tokens = make_tokens(make_llama().cfg, batch=2, seq_len=64)
    rows = []
    for backend in args.backends:  # a throwaway case first: process-wide warm-up (imports, compiler workers)
        case(backend, None, make_tokens(make_llama().cfg, batch=1, seq_len=8))
    for backend in args.backends:
        plain = case(backend, None, tokens)
        fxq_bf16 = case(backend, "bf16", tokens)
        fxq = case(backend, args.scheme, tokens)
        for r in (plain, fxq_bf16, fxq):
            r["compile_ratio_vs_plain"] = r["first_step_s"] / plain["first_step_s"]
            rows.append(r)
    from tabulate import tabulate

    print(f"2-layer Llama (dim 64), batch 2 x 64 tokens, torch {torch.__version__}, {os.cpu_count()} CPU threads")
    print(tabulate([[r["backend"], r["scheme"], f"{r['first_step_s']:.2f}", f"{r['step_s'] * 1e3:.1f}",
                     f"{r['compile_ratio_vs_plain']:.2f}x"] for r in rows],
                   headers=["backend", "scheme", "first step (compile) s", "later step ms", "vs plain"]))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(strict_dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                                         "torch": torch.__version__, "environment": environment("cpu"),
                                         "rows": rows}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
