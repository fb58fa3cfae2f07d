"""Quantized training step vs the plain compiled step: fxquant.compile presets, the opaque-op baseline and
eager fake-quant, round-robin in one process; prints a table and writes JSON.

Models (``--models``): ``torch`` is a Llama-style ``nn.Module`` (tests.models: RMSNorm, RoPE, GQA SDPA,
SwiGLU; nn.Linear + F.scaled_dot_product_attention); ``megatron`` is a Megatron-core GPTModel (single
process, local gloo group; Column/RowParallelLinear, SDPA core attention); ``hf`` is Hugging Face
transformers' ``LlamaForCausalLM`` built from a ``LlamaConfig`` (SDPA attention, its own loss), the model
issue 12 was measured on (transformers is not a dependency: install it to run this one). All: ``--dim`` 512,
2 layers, 8 heads, SwiGLU hidden ``--ffn`` 1376, vocabulary ``--vocab`` 8192, batch x seq = 2 x 256 tokens, float32,
forward + backward (the gradient zeroing and the loss included), Inductor.

Variants per model, each on its own copy of the same weights:
  plain            torch.compile(model) (Inductor), the 1.0x reference
  <preset>         fxquant.compile(model, preset) with kernels="auto" (on CPU: the Inductor lowering)
  <preset> [ref]   the same with kernels="reference": the quantize op opaque, the eager reference per operand
  <preset> [eager] fxquant.compile(..., backend="eager"): the rewritten graph run op by op by the Python
                   interpreter, the reference per operand: eager fake-quant at equal work, no compiler
Timing: every variant is built and warmed up (its first call, the compile, is reported as ``compile_s``;
one Inductor cache directory per process, so a variant after the first finds the kernels it shares with
earlier ones compiled; ``--cold-compile`` adds ``cold_compile_s``, plain's and each preset's compile call and
first step in a fresh process with an empty cache, and where it went: Inductor's code generation, gcc summed
over the compile workers, the kernel libraries and KB of C++ written; and ``warm_compile_s``, the same in
another fresh process on the cache the first filled: a rerun on the same machine), then ``--rounds`` rounds
each time one step of every variant in turn; a variant's figure is the median over rounds of its step time
divided by plain's in the same round. Targets (issue 12, 2-core CPU, hidden 512): linear_mxfp8 <= 1.3x,
linear_hifp8 <= 1.4x, FA_linear_mxfp8 <= 1.6x, linear_mxfp4 / linear_nvfp4 <= 1.5x, every preset >= 2x faster
than eager; compile time <= 1.5x plain's.

    python benchmarks/bench_step.py --json benchmarks/results/bench_step_cpu.json
"""
from __future__ import annotations

import argparse
import atexit
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

if __name__ == "__main__" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    # Before torch is imported (Inductor settles on its cache directory as it loads): a fresh cache, removed at exit.
    _cache = tempfile.mkdtemp(prefix="bench_step_inductor_")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _cache

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fxquant.analysis.outputs import strict_dumps  # noqa: E402
import fxquant  # noqa: E402
from fxquant import cpp_prebuild, schemes  # noqa: E402
from envinfo import environment  # noqa: E402
from tests.models import make_llama, next_token_loss  # noqa: E402

PRESETS = ("linear_mxfp8", "linear_hifp8", "FA_linear_mxfp8", "linear_mxfp4", "linear_nvfp4")
TARGETS = {"linear_mxfp8": 1.3, "linear_hifp8": 1.4, "FA_linear_mxfp8": 1.6, "linear_mxfp4": 1.5, "linear_nvfp4": 1.5}
PLAIN = "plain torch.compile"


class Variant:
    """One way of running the step: a callable doing forward + backward + zero_grad, and its timings."""

    def __init__(self, label: str, preset: str | None, step: Callable[[], None]) -> None:
        self.label, self.preset, self.step = label, preset, step
        self.compile_s = 0.0
        self.times: list[float] = []

    def warm_up(self) -> None:
        t0 = time.perf_counter()
        self.step()
        self.compile_s = time.perf_counter() - t0
        self.step()

    def time_once(self) -> float:
        t0 = time.perf_counter()
        self.step()
        s = time.perf_counter() - t0
        self.times.append(s)
        return s


def torch_model(args):
    """(make_model, step_of(module)) for the plain PyTorch Llama."""
    cfg = dict(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.heads, hidden_dim=args.ffn,
               vocab_size=args.vocab, max_seq_len=args.seq)
    base = make_llama(**cfg)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def step_of(module, model):
        def step():
            next_token_loss(module(tokens), tokens).backward()
            model.zero_grad(set_to_none=True)
        return step

    return lambda: copy.deepcopy(base), step_of


def megatron_model(args):
    """(make_model, step_of(module)) for a Megatron-core GPTModel in one process."""
    from fxquant.megatron_glue import parallel
    from fxquant.megatron_glue.config import tiny_llama_config
    from fxquant.megatron_glue.graph_breaks import traceable_megatron
    from fxquant.megatron_glue.model import build_gpt_model, causal_attention_mask, position_ids

    parallel.initialize_parallel()
    cfg = tiny_llama_config(num_layers=args.layers, hidden_size=args.dim, ffn_hidden_size=args.ffn,
                            num_attention_heads=args.heads, num_query_groups=args.heads, vocab_size=args.vocab,
                            max_position_embeddings=args.seq)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    pos, mask = position_ids(args.batch, args.seq), causal_attention_mask(args.seq)

    def step_of(module, model):
        def step():
            with traceable_megatron():
                loss = module(ids, pos, mask, labels=ids).mean()
            loss.backward()
            model.zero_grad(set_to_none=True)
        return step

    return lambda: build_gpt_model(cfg, attention="sdpa", seed=7), step_of  # same seed: same weights


def hf_model(args):
    """(make_model, step_of(module)) for transformers' LlamaForCausalLM, randomly initialised from a config."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise SystemExit("bench_step: --models hf needs Hugging Face transformers (pip install transformers); "
                         f"importing it failed: {e}") from e
    cfg = LlamaConfig(hidden_size=args.dim, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
                      max_position_embeddings=args.seq, attn_implementation="sdpa")
    torch.manual_seed(7)
    base = LlamaForCausalLM(cfg)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def step_of(module, model):
        def step():
            module(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        return step

    return lambda: copy.deepcopy(base), step_of


MODELS = {"torch": torch_model, "megatron": megatron_model, "hf": hf_model}


def variants(args, make_model, step_of) -> list[Variant]:
    out = []

    def add(label, preset, wrap):
        model = make_model()
        out.append(Variant(label, preset, step_of(wrap(model), model)))

    add(PLAIN, None, lambda m: torch.compile(m))
    for preset in args.presets:
        add(preset, preset, lambda m, p=preset: fxquant.compile(m, p))
    for preset in args.reference:
        add(f"{preset} [ref]", preset, lambda m, p=preset: fxquant.compile(m, p, kernels="reference"))
    for preset in args.eager:
        add(f"{preset} [eager]", preset, lambda m, p=preset: fxquant.compile(m, p, backend="eager"))
    return out


def compile_only(name: str, label: str, args) -> dict[str, float]:
    """Child of ``--cold-compile``: build one variant (plain or a preset, kernels='auto') and time the compile
    call with its first step (``torch.compile(model)`` imports Inductor's compiler as it is called, and
    ``fxquant.compile`` at the first step: counting both keeps the two comparable), and say where the time
    went: Inductor's code generation (Python), gcc (summed over the compile workers, which run in parallel),
    the kernel libraries and C++ source it wrote (this process's cache directory; the copies of fxquant's
    kernel bundles kept for reruns, ``fxquant.cpp_prebuild``, not counted twice), the graphs loaded from
    Inductor's FX-graph and AOT-autograd caches."""
    from torch._dynamo.utils import compile_times, counters

    make_model, step_of = MODELS[name](args)
    model = make_model()
    t0 = time.perf_counter()
    compiled = torch.compile(model) if label == PLAIN else fxquant.compile(model, label)
    step = step_of(compiled, model)
    step()
    first = time.perf_counter() - t0
    keys, values = compile_times(repr="csv", aggregate=True)
    times = {k: float(v) for k, v in zip(keys, values)}
    cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    return {"first_step_s": first, "fx_graph_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
            "aot_autograd_cache_hits": counters["aot_autograd"]["autograd_cache_hit"],
            "codegen_s": times.get("Scheduler.codegen", 0.0),
            "gcc_s": times.get("compile_file", 0.0), "kernel_libraries": len(list(cache.rglob("*.so"))),
            "cpp_kb": sum(f.stat().st_size for f in cache.rglob("*.cpp") if cpp_prebuild.STORE not in f.parts) / 1024}


def _child_compile(name: str, label: str, argv: list[str], cache: str) -> dict[str, float]:
    """``compile_only`` in a fresh process with Inductor's cache in ``cache``."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    cmd = [sys.executable, __file__, *argv, "--models", name, "--compile-only", label]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("COMPILE ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"compile of {label!r} ({name}) in a fresh process failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def cold_compiles(name: str, args, argv: list[str]) -> dict[str, dict[str, float]]:
    """Compile call and first step of plain and every preset, each in a fresh process with an empty Inductor
    cache, with the breakdown ``compile_only`` reports; then again in another fresh process on the cache the
    first one filled (``warm_s``: a rerun of the same model on the same machine, the compiled graphs loaded
    from Inductor's FX-graph and AOT-autograd caches)."""
    out = {}
    for label in [PLAIN, *args.presets]:
        with tempfile.TemporaryDirectory(prefix="bench_step_cold_") as cache:
            out[label] = _child_compile(name, label, argv, cache)
            warm = _child_compile(name, label, argv, cache)
            out[label].update(warm_s=warm["first_step_s"], warm_fx_graph_cache_hits=warm["fx_graph_cache_hits"],
                              warm_aot_autograd_cache_hits=warm["aot_autograd_cache_hits"])
        c = out[label]
        print(f"  {name}: {label} cold compile {c['first_step_s']:.1f} s (fresh process, empty cache; code generation "
              f"{c['codegen_s']:.1f} s, gcc {c['gcc_s']:.1f} s over the workers, {c['kernel_libraries']} kernel "
              f"libraries, {c['cpp_kb']:.0f} KB of C++), warm {c['warm_s']:.1f} s", file=sys.stderr, flush=True)
    return out


def run_model(name: str, args, argv: list[str]) -> list[dict]:
    cold = cold_compiles(name, args, argv) if args.cold_compile else {}
    make_model, step_of = MODELS[name](args)
    vs = variants(args, make_model, step_of)
    for v in vs:
        v.warm_up()
        print(f"  {name}: {v.label} compiled in {v.compile_s:.1f} s", file=sys.stderr, flush=True)
    ratios: dict[str, list[float]] = {v.label: [] for v in vs}
    for r in range(args.rounds):
        plain_s = vs[0].time_once()
        for v in vs[1:]:
            ratios[v.label].append(v.time_once() / plain_s)
        print(f"  {name}: round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    plain = vs[0]
    eager_ms = {v.preset: statistics.median(v.times) * 1e3 for v in vs if v.label.endswith("[eager]")}
    rows = []
    for v in vs:
        ms = statistics.median(v.times) * 1e3
        x_plain = 1.0 if v is plain else statistics.median(ratios[v.label])
        target = TARGETS.get(v.label)
        rows.append({
            "model": name, "variant": v.label, "step_ms": ms, "min_ms": min(v.times) * 1e3, "x_plain": x_plain,
            "target": target, "meets": None if target is None else x_plain <= target,
            "eager_over_this": (eager_ms[v.preset] / ms) if v.preset in eager_ms and v.preset == v.label else None,
            "compile_s": v.compile_s, "compile_x_plain": v.compile_s / plain.compile_s,
            "cold_compile_s": cold[v.label]["first_step_s"] if v.label in cold else None, "cold_compile_x_plain":
                cold[v.label]["first_step_s"] / cold[PLAIN]["first_step_s"] if v.label in cold else None,
            "warm_compile_s": cold[v.label]["warm_s"] if v.label in cold else None, "warm_compile_x_plain":
                cold[v.label]["warm_s"] / cold[PLAIN]["warm_s"] if v.label in cold else None,
            "cold_compile": cold.get(v.label),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="torch,megatron", help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--presets", default=",".join(PRESETS), help="fxquant presets (kernels='auto'), comma-separated")
    p.add_argument("--reference", default="linear_mxfp8", help="presets also run with kernels='reference' ('' for none)")
    p.add_argument("--eager", default=",".join(PRESETS), help="presets also run eagerly (backend='eager'; '' for none)")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1376)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", default=None, help="write the rows and the environment here")
    p.add_argument("--cold-compile", action="store_true",
                   help="also time plain's and each preset's compile call and first step in a fresh process with an "
                        "empty Inductor cache (cold_compile_s: the compile a user sees on a new machine), then in "
                        "another on the cache that filled (warm_compile_s: a rerun on the same machine)")
    p.add_argument("--compile-only", default=None, metavar="LABEL",
                   help="compile one variant of the first --models model in this process and print its COMPILE line "
                        "(JSON: compile call, first step, breakdown); LABEL: a preset name or 'plain torch.compile'; "
                        "--cold-compile runs it in fresh processes")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    args.presets, args.reference, args.eager = split(args.presets), split(args.reference), split(args.eager)
    models = split(args.models)
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        p.error(f"--models: unknown {bad}; choose from {list(MODELS)}")
    check_args(p, args)
    torch._dynamo.config.cache_size_limit = 64  # one code object, many compiled copies
    torch._dynamo.config.accumulated_cache_size_limit = 512
    if args.compile_only is not None:
        print(f"COMPILE {strict_dumps(compile_only(models[0], args.compile_only, args))}", flush=True)
        return 0
    child_argv = [a for a in _without(raw, ("--models", "--json", "--rounds")) if a != "--cold-compile"]
    rows = []
    for name in models:
        rows += run_model(name, args, child_argv)
    cols = ["model", "variant", "step_ms", "x_plain", "target", "meets", "eager_over_this", "compile_s", "compile_x_plain"]
    if args.cold_compile:
        cols += ["cold_compile_s", "cold_compile_x_plain"]
        for r in rows:  # where the cold compile went, flattened for the table
            for k, v in (r.get("cold_compile") or {}).items():
                r[f"cold_{k}"] = v
        cols += ["cold_codegen_s", "cold_gcc_s", "cold_kernel_libraries", "cold_cpp_kb", "warm_compile_s",
                 "warm_compile_x_plain"]
    print(tabulate([[r.get(c) for c in cols] for r in rows], headers=cols, floatfmt=".2f"))
    if args.json:
        env = {**environment("cpu", raw), "load_average": os.getloadavg()}
        if "hf" in models:
            import transformers

            env["transformers"] = transformers.__version__
        Path(args.json).write_text(strict_dumps({"environment": env, "args": vars(args), "rows": rows}, indent=1))
    return 0


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``p.error``: one line, exit 2) sizes and presets the run would fail on, before anything compiles."""
    for flag in ("dim", "layers", "heads", "ffn", "vocab", "batch", "seq", "rounds"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag}: {getattr(args, flag)} must be >= 1")
    if args.dim % (2 * args.heads):  # RoPE rotates pairs of a head's dimensions
        p.error(f"--dim: {args.dim} must be a multiple of 2 x --heads ({2 * args.heads}): an even head dimension")
    for flag in ("presets", "reference", "eager"):
        for name in getattr(args, flag):
            try:
                schemes.get(name)
            except (ValueError, OSError) as exc:  # an unknown name, a YAML file missing or wrong
                p.error(f"--{flag}: {str(exc).split(';')[0]}")
    if args.compile_only not in (None, PLAIN):
        try:
            schemes.get(args.compile_only)
        except (ValueError, OSError) as exc:
            p.error(f"--compile-only: {args.compile_only!r} is not {PLAIN!r}, and {str(exc).split(';')[0]}")


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` less the given options and their values (``--opt v`` and ``--opt=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not a.startswith(tuple(o + "=" for o in options)):
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
