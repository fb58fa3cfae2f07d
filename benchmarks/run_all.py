"""One benchmark run for issue 7: device ceilings, quantize kernels, linear, attention, model step, capture,
compile time, side by side with the peers; prints markdown tables and writes JSON.

Sections (``--sections``, default all):
  ceilings   copy bandwidth (x.clone(), bytes read + written) and the bf16 GEMM rate (torch.mm)
  quantize   every format's quantize (benchmarks/bench_formats.py): Triton and the op lowered into Inductor's
             code (kernels="inductor") vs the copy, eager reference, torchao's to_mx and the predecessor's HiF8
             as peers
  fused      the fused quantize-on-load GEMM vs quantize kernel + cuBLAS, with the keep/drop verdict
             (benchmarks/bench_fused.py)
  linear     nn.Linear fwd+bwd, 4096x4096 and Llama-3.2-1B MLP shapes: torch.compile bf16 vs fxquant.compile
             per linear preset, with each quantize implementation (KERNELS: on the GPU the standalone Triton
             kernels and the Inductor lowering, side by side: the run that decides kernels="auto"); peers: torchao MX emulation (MXTensor round trip + bf16 matmul, eager) and the
             predecessor's approach (quantize with torch ops, then matmul, eager)
  attention  causal GQA attention fwd+bwd, seq 2k-8k, head dim 64/128: SDPA bf16 (flash) vs the quantized
             flash-attention kernel per FA scheme and the torch reference path (quantized_sdpa, eager; up to
             L = 2048: its [L, L] float32 matrices)
  model      a Llama-3.2-1B-shaped model with fewer layers, fwd+bwd step: the compiled baseline (bf16 with
             Inductor on a GPU, float32 with aot_eager on CPU; its row reads "baseline: ...", the columns
             "x baseline", "peak x baseline") vs fxquant.compile per preset and quantize implementation
             (KERNELS), with peak memory, and the predecessor's eager approach
  capture    capture writer throughput vs raw writes, step overhead (benchmarks/bench_capture.py); the
             model runs on the CPU, on a GPU machine too (its host CPU)
  compile    first-step (compile) time, fxquant.compile vs torch.compile (benchmarks/bench_compile.py); the
             model runs on the CPU, on a GPU machine too (its host CPU)
Timing: CUDA events around each call after warm-up, median of ``--repeat`` (CPU: perf_counter). Anything
that needs a GPU reads "n/a (no GPU)" on a machine without one. ``--quick`` shrinks every size for a
smoke run (minutes on a 2-core CPU).

One command must finish within 10 minutes (the GPU job limit): every section has a time budget
(``SECTION_BUDGET_S``, scaled by ``--budget-scale``; off with ``--quick``) checked before each measurement;
what does not fit reads "skipped: section time budget spent". JSON and markdown are rewritten after every
section, so a run that is killed keeps what it measured.

    python benchmarks/run_all.py --quick --json benchmarks/results/run_all_cpu.json          # CPU smoke run
    python benchmarks/run_all.py --json benchmarks/results/run_all_h100.json                 # H100 / H200
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_capture  # noqa: E402
import bench_compile  # noqa: E402
import bench_formats  # noqa: E402
import bench_fused  # noqa: E402
import envinfo  # noqa: E402

from fxquant.analysis.outputs import strict_dumps  # noqa: E402
import fxquant  # noqa: E402
from fxquant import kernels, lowering, schemes  # noqa: E402
from fxquant.passes.rewrite_sdpa import ENV as ATTENTION_ENV  # noqa: E402
from fxquant.qfunctions import quantized_linear, quantized_sdpa  # noqa: E402
from fxquant.schemes import Site, SiteKind  # noqa: E402
from tests.models import make_llama, make_tokens, next_token_loss  # noqa: E402

logger = logging.getLogger("fxquant.benchmarks.run_all")
SECTIONS = ("ceilings", "quantize", "fused", "linear", "attention", "model", "capture", "compile")
# Seconds per section on a GPU (the sum, plus start-up, stays under a 10-minute job).
SECTION_BUDGET_S = {"ceilings": 10, "quantize": 50, "fused": 40, "linear": 80, "attention": 90, "model": 150,
                    "capture": 25, "compile": 40}  # 485 s; one measurement may overrun its section's budget
SKIPPED = "skipped: section time budget spent"
REFERENCE_MAX_SEQ = 2048  # quantized_sdpa materialises [B, H, L, L] float32 matrices
NO_GPU = "n/a (no GPU)"
LINEAR_PRESETS = ("linear_mxfp8", "linear_hifp8", "linear_mxfp4", "linear_nvfp4")
FA_PRESETS = ("FA_mxfp8", "FA_QKPV_mxfp8", "FA_QKPV_hifp8", "FA_QKPV_mxfp4")
MODEL_PRESETS = ("linear_mxfp8", "FA_linear_mxfp8", "FA_linear_hifp8", "FA_linear_mxfp4")
TARGETS = {"linear_mxfp8": 1.15, "FA_linear_mxfp8": 1.35, "FA_linear_hifp8": 1.5, "FA_linear_mxfp4": 1.5,
           "linear_hifp8": 1.5, "linear_mxfp4": 1.5}


def kernel_choices(dev: torch.device, backend: str, preset: str) -> tuple[str, ...]:
    """The quantize implementations to compare (fxquant.lowering), what ``kernels="auto"`` picks first: on CUDA
    with Inductor the Inductor lowering ("auto" there) and the standalone Triton kernels, the lowering only for a
    preset whose formats it reproduces exactly on CUDA (not NVFP4: "inductor" is refused for it); elsewhere
    what "auto" picks."""
    if dev.type == "cuda" and backend == "inductor":
        scheme = schemes.get(preset)
        configs = [r.linear for r in scheme.rules] + [r.attention for r in scheme.rules]
        return ("triton",) if lowering.inexact_formats(configs, "cuda") else ("inductor", "triton")
    return ("auto",)


class Timer:
    """Median seconds of ``fn()`` after ``warmup`` calls: CUDA events on the GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device, repeat: int, warmup: int) -> None:
        self.device, self.repeat, self.warmup = device, repeat, warmup

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup - 1):  # make_timer warms up once more itself
            fn()
        return bench_formats.make_timer(self.device, self.repeat)(fn)[0]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _out_of_time(args) -> bool:
    """Whether the running section has spent its time budget (``main`` sets ``args.deadline``)."""
    return time.perf_counter() > getattr(args, "deadline", float("inf"))


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


ERRORS: list[str] = []  # every measurement or section that raised, in order: main's exit status is 1 if any


def _error(where: str, exc: BaseException) -> str:
    """Log ``exc`` with its traceback, remember it, and return the note a table shows for it."""
    logger.error("%s failed", where, exc_info=exc)
    note = f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    ERRORS.append(f"{where}: {note}")
    return note


def _attempt(fn: Callable[[], float], where: str = "measurement") -> tuple[float | None, str]:
    """Run a measurement. Out-of-memory becomes a note "OOM"; any other exception a note "error: ..." (logged
    with its traceback, and main then exits 1), so one failing variant does not end the run."""
    try:
        return fn(), ""
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, "OOM"
    except Exception as exc:  # noqa: BLE001  (a benchmark run keeps what the other variants measure)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None, _error(where, exc)


# -- (a) ceilings -------------------------------------------------------------------------------------------
def ceilings(args, dev: torch.device, timer: Timer) -> list[dict]:
    nbytes = (64 << 20) if args.quick else (2 << 30)
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    copy_s = timer(lambda: x.clone())
    n = 512 if args.quick else 8192
    a, b = (torch.randn(n, n, device=dev).to(torch.bfloat16) for _ in range(2))
    mm_s = timer(lambda: torch.mm(a, b))
    return [
        {"what": "copy bandwidth", "size": f"{nbytes >> 20} MiB bf16", "ms": copy_s * 1e3, "rate": 2 * nbytes / copy_s / 1e9, "unit": "GB/s"},
        {"what": "bf16 GEMM (torch.mm)", "size": f"{n}^3", "ms": mm_s * 1e3, "rate": 2 * n**3 / mm_s / 1e12, "unit": "TFLOP/s"},
    ]


# -- (b) quantize -----------------------------------------------------------------------------------------
def quantize(args, dev: torch.device, timer: Timer) -> list[dict]:
    ns = argparse.Namespace(size="2^18" if args.quick else "2^28", dtype="bf16", device=str(dev), formats="all",
                            impls="eager,inductor,triton,peers" if args.quick else "inductor,triton,peers",
                            repeat=args.repeat, floor=False)
    res = bench_formats.bench(ns)
    return [{k: r.get(k) for k in ("format", "impl", "ms", "GB/s", "x copy", "note")} for r in res["rows"]]


# -- (c) linear -------------------------------------------------------------------------------------------
class _Linear(nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.proj = nn.Linear(k, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _lq(preset: str):
    return schemes.get(preset).linear_for(Site.from_path("proj", SiteKind.LINEAR))


def _torchao_mx(x: torch.Tensor, elem: torch.dtype, dim: int) -> torch.Tensor:
    """torchao's MX emulation of one operand: to_mx along ``dim`` (made last), dequantized to bf16."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    xt = x.movedim(dim, -1).contiguous()
    return MXTensor.to_mx(xt, elem, 32).dequantize(torch.bfloat16).movedim(-1, dim)


class _TorchaoMXLinearFn(torch.autograd.Function):
    """fprop, dgrad, wgrad with both operands through torchao's MX cast round trip (emulation), bf16 matmuls."""

    @staticmethod
    def forward(ctx, x, w, elem):
        ctx.save_for_backward(x, w)
        ctx.elem = elem
        return _torchao_mx(x, elem, -1) @ _torchao_mx(w, elem, -1).t()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        e = ctx.elem
        dx = _torchao_mx(dy, e, -1) @ _torchao_mx(w, e, 0)
        dw = _torchao_mx(dy, e, 0).t() @ _torchao_mx(x, e, 0)
        return dx, dw, None


def _reference_ops(dev: torch.device):
    """Context: ``fxquant::quantize`` runs the pure-torch reference on ``dev`` and SDPA sites compile to the
    explicit-math ``quantized_sdpa`` (``FXQUANT_ATTENTION=math``): the predecessor's approach, quantize with
    torch ops, then matmul, eagerly."""

    class _Ctx:
        def __enter__(self):
            self.env = os.environ.get(ATTENTION_ENV)
            os.environ[ATTENTION_ENV] = "math"
            if dev.type == "cuda" and kernels.available():
                kernels.restore_reference("cuda")

        def __exit__(self, *exc):
            if self.env is None:
                os.environ.pop(ATTENTION_ENV, None)
            else:
                os.environ[ATTENTION_ENV] = self.env
            if dev.type == "cuda" and kernels.available():
                kernels.register("cuda")

    return _Ctx()


def linear(args, dev: torch.device, timer: Timer) -> list[dict]:
    m, shapes = bench_fused.linear_shapes(args.quick)
    dtype = torch.bfloat16
    backend = "aot_eager" if dev.type == "cpu" else "inductor"
    rows = []
    for label, k, n in shapes:
        x = torch.randn(m, k, device=dev, dtype=dtype, requires_grad=True)
        dy = torch.randn(m, n, device=dev, dtype=dtype)
        base = _Linear(k, n).to(dev, dtype)

        def step(fn):
            return lambda: (fn(x).backward(dy), x.grad.zero_() if x.grad is not None else None)

        torch._dynamo.reset()
        bf16_s = timer(step(torch.compile(base, backend=backend)))
        rows.append({"shape": label, "impl": f"bf16 torch.compile ({backend})", "ms": bf16_s * 1e3, "x bf16": 1.0})
        for preset in LINEAR_PRESETS if not args.quick else LINEAR_PRESETS[:2]:
            if _out_of_time(args):
                rows.append({"shape": label, "impl": f"fxquant {preset}", "note": SKIPPED})
                continue
            for k in kernel_choices(dev, backend, preset):
                torch._dynamo.reset()
                compiled = fxquant.compile(base, preset, backend=backend, kernels=k)
                s, note = _attempt(lambda: timer(step(compiled)), f"linear {label} {preset} kernels={k}")
                rows.append({"shape": label, "impl": f"fxquant {preset} ({backend}, kernels={k})",
                             "ms": s and s * 1e3, "x bf16": _ratio(s, bf16_s), "target": TARGETS.get(preset),
                             "note": note})
            lq = _lq(preset)
            with _reference_ops(dev):
                s, note = _attempt(lambda: timer(step(lambda t: quantized_linear(t, base.proj.weight, None, lq))),
                                   f"linear {label} {preset} predecessor")
            rows.append({"shape": label, "impl": f"predecessor approach {preset} (eager torch ops)",
                         "ms": s and s * 1e3, "x bf16": _ratio(s, bf16_s), "note": note})
            _log(f"  linear {label} {preset} done")
        try:
            s = timer(step(lambda t: _TorchaoMXLinearFn.apply(t, base.proj.weight, torch.float8_e4m3fn)))
            rows.append({"shape": label, "impl": "torchao MX emulation mxfp8 (eager)", "ms": s * 1e3, "x bf16": s / bf16_s})
        except ImportError as exc:
            rows.append({"shape": label, "impl": "torchao MX emulation mxfp8 (eager)", "note": f"n/a ({exc})"})
    return rows


# -- (d) attention ----------------------------------------------------------------------------------------
def _aq(preset: str):
    return schemes.get(preset).attention_for(Site.from_path("layers.0.self_attn", SiteKind.ATTENTION))


def attention(args, dev: torch.device, timer: Timer) -> list[dict]:
    from fxquant.kernels.flash_attention import FlashBlocks, flash_quantized_attention, triton_runs_on

    seqs = (256,) if args.quick else tuple(args.seq)
    heads = (64, 128)
    dtype = torch.bfloat16
    on_gpu = triton_runs_on(dev) and dev.type == "cuda"
    rows = []
    for lq in seqs:
        for d in heads:
            h = 2048 // d if not args.quick else 4
            hk = max(1, h // 4)
            q = torch.randn(1, h, lq, d, device=dev, dtype=dtype, requires_grad=True)
            k = torch.randn(1, hk, lq, d, device=dev, dtype=dtype, requires_grad=True)
            v = torch.randn(1, hk, lq, d, device=dev, dtype=dtype, requires_grad=True)
            do = torch.randn(1, h, lq, d, device=dev, dtype=dtype)
            label = f"L={lq} d={d} H={h}/{hk}"
            flops = 4 * lq * lq * d * h * 0.5 * 3.5  # causal fwd (2 GEMMs) + bwd (5 GEMMs), useful work

            def step(fn):
                def run():
                    fn().backward(do)
                    q.grad = k.grad = v.grad = None
                return run

            sdpa_s = timer(step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)))
            rows.append({"shape": label, "impl": "SDPA bf16 (flash on GPU)", "ms": sdpa_s * 1e3, "x sdpa": 1.0,
                         "TFLOP/s": flops / sdpa_s / 1e12})
            for preset in ("bf16",) + FA_PRESETS:
                if _out_of_time(args):
                    rows.append({"shape": label, "impl": f"flash kernel {preset}", "note": SKIPPED})
                    continue
                aq = schemes.AttentionQuant() if preset == "bf16" else _aq(preset)
                if on_gpu:
                    blocks = FlashBlocks()  # the default tiles, as fxquant.compile runs them
                    s, note = _attempt(lambda: timer(step(lambda: flash_quantized_attention(
                        q, k, v, is_causal=True, aq=aq, blocks=blocks))), f"attention {label} flash {preset}")
                    rows.append({"shape": label, "impl": f"flash kernel {preset}", "ms": s and s * 1e3,
                                 "x sdpa": _ratio(s, sdpa_s), "TFLOP/s": s and flops / s / 1e12, "note": note})
                else:
                    rows.append({"shape": label, "impl": f"flash kernel {preset}", "note": NO_GPU})
                if preset != "bf16" and lq > REFERENCE_MAX_SEQ:
                    rows.append({"shape": label, "impl": f"torch reference quantized_sdpa {preset} (eager)",
                                 "note": f"not run above L={REFERENCE_MAX_SEQ} ([L, L] float32 matrices)"})
                elif preset != "bf16":
                    s, note = _attempt(lambda: timer(step(lambda: quantized_sdpa(q, k, v, is_causal=True, enable_gqa=True, aq=aq))),
                                       f"attention {label} reference {preset}")
                    rows.append({"shape": label, "impl": f"torch reference quantized_sdpa {preset} (eager)",
                                 "ms": s and s * 1e3, "x sdpa": _ratio(s, sdpa_s), "note": note})
            _log(f"  attention {label} done")
            del q, k, v, do
    return rows


# -- (e) model step ---------------------------------------------------------------------------------------
def model_step(args, dev: torch.device, timer: Timer) -> list[dict]:
    if args.quick:
        cfg = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=384, vocab_size=512, max_seq_len=128)
        batch, seq = 2, 128
    else:  # llama32-1b's shapes (dim 2048, 32 heads, 8 kv heads, hidden 8192, vocab 128256), fewer layers
        cfg = dict(dim=2048, n_layers=args.layers, n_heads=32, n_kv_heads=8, hidden_dim=8192, vocab_size=128256,
                   max_seq_len=2048)
        batch, seq = 2, 2048
    backend = "aot_eager" if dev.type == "cpu" else "inductor"
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tokens = make_tokens(make_llama(**{**cfg, "n_layers": 1}).cfg, batch=batch, seq_len=seq).to(dev)
    rows = []

    def measure(label: str, make: Callable[[nn.Module], nn.Module], ref: float | None = None, eager_ops=False) -> float | None:
        if rows and _out_of_time(args):
            rows.append({"impl": label, "note": SKIPPED})
            return None
        torch._dynamo.reset()
        model = make_llama(**cfg).to(dev, dtype)
        run_model = make(model)

        def step():
            next_token_loss(run_model(tokens), tokens).backward()
            model.zero_grad(set_to_none=True)

        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        with _reference_ops(dev) if eager_ops else _nullctx():
            s, note = _attempt(lambda: timer(step), f"model {label}")
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
        rows.append({"model": f"{cfg['n_layers']} layers, dim {cfg['dim']}, {batch}x{seq} tokens, {dtype}".replace("torch.", ""),
                     "impl": label, "ms": s and s * 1e3, "x baseline": _ratio(s, ref), "peak GiB": peak,
                     "peak x baseline": _ratio(peak, rows[0]["peak GiB"] if rows and peak else None), "note": note or (
                         "" if dev.type == "cuda" else "peak memory: n/a on CPU")})
        _log(f"  model {label}: {s}")
        del model, run_model
        return s

    base_s = measure(f"baseline: {str(dtype)[6:]} torch.compile ({backend})",
                     lambda m: torch.compile(m, backend=backend))
    rows[0]["x baseline"] = 1.0
    # every preset with what "auto" picks first, the other implementation after: a spent budget drops comparison rows
    choices = {p: kernel_choices(dev, backend, p) for p in MODEL_PRESETS}
    runs = [(p, ks[0]) for p, ks in choices.items()] + [(p, k) for p, ks in choices.items() for k in ks[1:]]
    for preset, k in runs:
        measure(f"fxquant {preset} ({backend}, kernels={k})",
                lambda m: fxquant.compile(m, preset, backend=backend, kernels=k), base_s)
        rows[-1]["target"] = TARGETS.get(preset)
    legacy = "legacy_FA_linear_mxfp8"
    measure(f"predecessor approach {legacy} (eager torch ops, forward GEMMs only)", lambda m: fxquant.compile(m, legacy, backend="eager"),
            base_s, eager_ops=True)
    return rows


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -- (f) capture, (g) compile -----------------------------------------------------------------------------
def capture(args, dev: torch.device, timer: Timer) -> list[dict]:
    cargs = types.SimpleNamespace(dim=64 if args.quick else 256, layers=2 if args.quick else 4, heads=4 if args.quick else 8,
                                  vocab=1024, seq=64 if args.quick else 256, batch=2 if args.quick else 4,
                                  steps=3 if args.quick else 8, warmup=1 if args.quick else 2, backend="aot_eager")
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        nbytes = (64 if args.quick else 1024) << 20
        raw = max(bench_capture.raw_write(root, nbytes) for _ in range(2))
        wr = max(bench_capture.writer_throughput(root / f"w{i}", nbytes) for i in range(2))
        st = bench_capture.step_times(cargs, root)
    med = {m: statistics.median(t) for m, t in st["times"].items()}
    drain = statistics.median(st["drains"]) if st["drains"] else 0.0
    return [
        {"what": "raw sequential write", "value": raw, "unit": "GB/s"},
        {"what": "capture writer", "value": wr, "unit": "GB/s", "note": f"{wr / raw:.2f}x raw"},
        {"what": "step, no capture", "value": med["none"] * 1e3, "unit": "ms"},
        {"what": "step, capture configured, outside window", "value": med["inactive"] * 1e3, "unit": "ms",
         "note": f"{med['inactive'] / med['none']:.2f}x"},
        {"what": "step, capture active", "value": med["active"] * 1e3, "unit": "ms",
         "note": f"{med['active'] / med['none']:.2f}x, {st['records_per_step']:.0f} records, "
                 f"{st['stored_mb_per_step']:.1f} MB per step"},
        {"what": "writer drain after an active step", "value": drain * 1e3, "unit": "ms"},
    ]


def compile_time(args, dev: torch.device, timer: Timer) -> list[dict]:
    tokens = make_tokens(make_llama().cfg, batch=2, seq_len=64)
    backends = ("aot_eager",) if args.quick else ("inductor", "aot_eager")
    rows = []
    for backend in backends:
        if rows and _out_of_time(args):
            rows.append({"backend": backend, "scheme": "-", "note": SKIPPED})
            continue
        bench_compile.case(backend, None, make_tokens(make_llama().cfg, batch=1, seq_len=8))  # process warm-up
        plain = bench_compile.case(backend, None, tokens)
        for scheme in (None, "bf16", "FA_linear_mxfp8"):
            r = plain if scheme is None else bench_compile.case(backend, scheme, tokens)
            rows.append({"backend": backend, "scheme": r["scheme"], "first step s": r["first_step_s"],
                         "later step ms": r["step_s"] * 1e3, "x plain": r["first_step_s"] / plain["first_step_s"]})
    return rows


def fused(args, dev: torch.device, timer: Timer) -> list[dict]:
    return bench_fused.fused(args, dev, timer, lambda: _out_of_time(args))


RUNNERS = {"ceilings": ceilings, "quantize": quantize, "fused": fused, "linear": linear, "attention": attention,
           "model": model_step, "capture": capture, "compile": compile_time}


def _fmt(v: object) -> object:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else v


def render(name: str, rows: list[dict]) -> str:
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    table = tabulate([[_fmt(r.get(c)) for c in cols] for r in rows], headers=cols, tablefmt="github")
    return f"### {name}\n\n{table}\n"


def environment(dev: torch.device, argv: list[str] | None = None) -> dict:
    """``envinfo.environment`` (device, host CPU, torch, python, date, argv) with the triton and torchao versions."""
    tv = None
    if kernels.available():
        import triton

        tv = triton.__version__
    try:
        import torchao

        ao = torchao.__version__
    except ImportError:
        ao = None
    return {**envinfo.environment(dev, argv), "triton": tv, "torchao": ao}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="all", help=f"comma-separated subset of {','.join(SECTIONS)}, or 'all'")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run that proves every section works")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeat", type=int, default=None, help="timed repeats per figure (default 20 on GPU, 3 on CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 5 on GPU, 1 on CPU)")
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192], help="attention sequence lengths")
    p.add_argument("--layers", type=int, default=2, help="model section: layers of the llama32-1b-shaped model")
    p.add_argument("--budget-scale", type=float, default=1.0,
                   help="multiply every section's time budget (SECTION_BUDGET_S) by this; 0 = no budgets")
    p.add_argument("--json", default="benchmarks/results/run_all.json")
    p.add_argument("--markdown", default=None, help="also write the tables to this file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sections = SECTIONS if args.sections == "all" else tuple(s.strip() for s in args.sections.split(","))
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {list(SECTIONS)}")
    dev = check_args(p, args)
    gpu = dev.type == "cuda"
    args.repeat = args.repeat if args.repeat is not None else (20 if gpu else 3)
    args.warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    timer = Timer(dev, args.repeat, args.warmup)
    env = environment(dev, argv)
    result = {"environment": env, "args": {k: v for k, v in vars(args).items()}, "sections": {}}
    out = [f"## fxquant benchmarks ({'quick' if args.quick else 'full'})\n",
           f"{env['device']}; torch {env['torch']}, triton {env['triton']}, torchao {env['torchao']}; {env['date']}; "
           f"median of {args.repeat} after {args.warmup} warm-up\n"]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    for name in sections:
        _log(f"[{name}]")
        t0 = time.perf_counter()
        budget = SECTION_BUDGET_S[name] * args.budget_scale
        args.deadline = t0 + budget if budget > 0 and not args.quick else float("inf")
        try:
            rows = RUNNERS[name](args, dev, timer)
        except Exception as exc:  # noqa: BLE001  (the other sections still run; main exits 1)
            rows = [{"section": name, "note": _error(f"section {name}", exc)}]
        result["sections"][name] = {"rows": rows, "wall_s": time.perf_counter() - t0}
        result["errors"] = list(ERRORS)
        out.append(render(name, rows))
        print(out[-1], flush=True)
        Path(args.json).write_text(strict_dumps(result, indent=1, default=str))  # after every section: a killed
        if args.markdown:  # run keeps what it measured
            Path(args.markdown).write_text("\n".join(out))
    _log(f"wrote {args.json}")
    for e in ERRORS:
        _log(f"ERROR {e}")
    return 1 if ERRORS else 0


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """The device; refuse (``p.error``: one line, exit 2) counts and sizes the sections would fail on, before any
    runs. ``--repeat`` and ``--warmup`` left out (None) take the device's defaults."""
    if args.repeat is not None and args.repeat < 1:
        p.error(f"--repeat: {args.repeat} must be >= 1 (leave it out for the default)")
    if args.warmup is not None and args.warmup < 0:
        p.error(f"--warmup: {args.warmup} must be >= 0 (leave it out for the default)")
    if any(s < 1 for s in args.seq):
        p.error(f"--seq: {args.seq}: every sequence length must be >= 1")
    if args.layers < 1:
        p.error(f"--layers: {args.layers} must be >= 1")
    if args.budget_scale < 0:
        p.error(f"--budget-scale: {args.budget_scale} must be >= 0 (0: no budgets)")
    return envinfo.parse_device(p, args.device)


if __name__ == "__main__":
    raise SystemExit(main())
