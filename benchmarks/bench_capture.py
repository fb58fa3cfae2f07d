"""Capture benchmark (issue 4, "Speed"): writer throughput vs a raw sequential write measured in the same run,
and the training step time of a Llama-style model with capture active / configured but outside its window /
absent (every linear's input and grad_output: the shipped ``linear_io`` spec). Prints tables, writes JSON.

    python benchmarks/bench_capture.py                                   # small: dim 256, 2 layers
    python benchmarks/bench_capture.py --dim 1024 --layers 2 --steps 8  # a realistic width (GEMMs dominate)

Step times are taken round-robin over four compiled copies of one model (so load on the machine hits them
alike): ``none`` and ``none_b`` (two copies without taps: their ratio is the noise floor of the
measurement), ``inactive`` (taps compiled in, session outside its window) and ``active``. After each active
step the benchmark waits until the writer has processed the step's tensors (``drain``), outside the timed
step, so no mode pays for another's writes; ``active + drain`` is the cost if nothing overlapped with the
next step (an upper bound). Ratios are medians of per-round ratios against ``none`` of the same round, and
ratios of the fastest step of each mode (other load on the machine only ever adds time). Last, the cost of one
op call outside the window, from a stack of tiny linears where the calls dominate the step.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import xxhash
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from envinfo import environment  # noqa: E402
from fxquant.analysis.outputs import strict_dumps  # noqa: E402
from fxquant import capture, schemes  # noqa: E402
from fxquant.backend import FxquantBackend  # noqa: E402
from fxquant.capture.spec import Span, Window  # noqa: E402
from fxquant.capture.writer import Item, ShardWriter  # noqa: E402
from tests.models import make_llama, make_tokens, next_token_loss  # noqa: E402

MODES = ("none", "none_b", "inactive", "active")


def hash_speeds(nbytes: int = 64 << 20) -> dict[str, float]:
    """GB/s of candidate checksums over one buffer (best of 3)."""
    data = memoryview(torch.randn(nbytes // 4).numpy()).cast("B")
    fns = {"crc32 (zlib)": zlib.crc32, "xxh3_64": xxhash.xxh3_64_intdigest,
           "sha256": lambda b: hashlib.sha256(b).digest()}
    out = {}
    for name, fn in fns.items():
        best = min(_timed(fn, data) for _ in range(3))
        out[name] = nbytes / best / 1e9
    return out


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def raw_write(directory: Path, nbytes: int, chunk: int = 64 << 20, source_bytes: int = 64 << 20) -> float:
    """GB/s of one sequential write of ``nbytes`` (``chunk``-byte writes walking a 64 MiB source, as many distinct
    bytes as the writer benchmark's tensors; one fsync at the end)."""
    src = memoryview(os.urandom(source_bytes))
    t0 = time.perf_counter()
    with open(directory / "raw.bin", "wb") as f:
        done = 0
        while done < nbytes:
            off = done % source_bytes
            n = min(chunk, nbytes - done, source_bytes - off)
            f.write(src[off: off + n])
            done += n
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    (directory / "raw.bin").unlink()
    return nbytes / dt / 1e9


def writer_throughput(directory: Path, nbytes: int, tensor_bytes: int = 4 << 20) -> float:
    """GB/s of the capture writer (checksums, safetensors shards, manifest, fsyncs) for ``nbytes`` of tensors."""
    n = max(1, nbytes // tensor_bytes)
    tensors = [torch.randn(tensor_bytes // 4) for _ in range(min(n, 16))]
    w = ShardWriter(directory, shard_bytes=256 << 20)
    t0 = time.perf_counter()
    for i in range(n):
        t = tensors[i % len(tensors)]
        w.put(Item({"key": f"t{i:09d}", "seq": i}, t, nbytes=t.numel() * 4))
    state = w.close()
    dt = time.perf_counter() - t0
    shutil.rmtree(directory)  # as raw_write unlinks its file: both start from the same page-cache state
    if state.error is not None:
        raise RuntimeError(f"writer failed: {state.error_reason}")
    return n * tensor_bytes / dt / 1e9


def step_times(args, root: Path) -> dict:
    """Per-mode step times (and drain times after active steps), records and bytes per active step."""
    base = capture.load_spec("linear_io")  # every iteration: bound it so that "outside the window" exists
    window = Window(Span(0, 10**6))
    spec = dataclasses.replace(base, sections=tuple(dataclasses.replace(x, when=window) for x in base.sections))
    models = {}
    tokens = None
    for mode in MODES:
        model = make_llama(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.heads // 2,
                           hidden_dim=args.dim * 3, vocab_size=args.vocab, max_seq_len=args.seq)
        tokens = make_tokens(model.cfg, batch=args.batch, seq_len=args.seq)
        backend = FxquantBackend(schemes.get("bf16"), inner=args.backend, root=model,
                                 capture=None if mode.startswith("none") else spec)
        models[mode] = (model, torch.compile(model, backend=backend))
    outside = 10**9
    session = capture.start(spec, root / "cap", start_iteration=0)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    drains: list[float] = []
    try:
        for i in range(args.warmup + args.steps):
            for k in range(len(MODES)):  # rotate the order so no mode always runs first
                mode = MODES[(i + k) % len(MODES)]
                model, compiled = models[mode]
                session.set_iteration(i if mode == "active" else outside)
                t0 = time.perf_counter()
                next_token_loss(compiled(tokens), tokens).backward()
                dt = time.perf_counter() - t0
                if mode == "active":
                    t1 = time.perf_counter()
                    session.writer.wait_idle()
                    drain = time.perf_counter() - t1
                    if i >= args.warmup:
                        drains.append(drain)
                if i >= args.warmup:
                    times[mode].append(dt)
                model.zero_grad(set_to_none=True)
    finally:
        summary = session.close()
    n_active = args.warmup + args.steps
    return {"times": times, "drains": drains, "records_per_step": summary["records"] / n_active,
            "stored_mb_per_step": summary["bytes"] / n_active / 1e6}


def per_call_cost(backend: str, rounds: int = 30, reps: int = 100) -> dict:
    """Cost of one ``fxquant::capture`` call outside the window: a 10-layer stack of 8x8 linears (so the
    calls dominate), compiled without and with taps on every linear point, alternating in rounds."""
    spec = capture.load_spec("per-call.yaml", text="sections:\n  - name: all\n    points: [{component: linear}]\n"
                                                   "    when: {iterations: {start: 0, end: 1000000}}\n")
    x = torch.randn(4, 8, requires_grad=True)
    compiled = {}
    for mode in ("none", "taps"):
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(10)])
        be = FxquantBackend(schemes.get("bf16"), inner=backend, root=m, capture=None if mode == "none" else spec)
        compiled[mode] = torch.compile(m, backend=be)
    with tempfile.TemporaryDirectory() as d:
        with capture.start(spec, d, start_iteration=10**9) as session:
            for fn in compiled.values():
                for _ in range(20):
                    fn(x).sum().backward()
            times: dict[str, list[float]] = {m: [] for m in compiled}
            for _ in range(rounds):
                for mode, fn in compiled.items():
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn(x).sum().backward()
                    times[mode].append((time.perf_counter() - t0) / reps)
            calls = [0]  # count the op's calls in one step (the op calls the session once per call)
            inner = session.capture

            def counting(*a, **k):
                calls[0] += 1
                return inner(*a, **k)

            session.capture = counting
            compiled["taps"](x).sum().backward()
            del session.capture
    none, taps = statistics.median(times["none"]), statistics.median(times["taps"])
    n = calls[0]
    return {"backend": backend, "step_us_none": none * 1e6, "step_us_taps": taps * 1e6, "calls_per_step": n,
            "us_per_call": (taps - none) / n * 1e6 if n else None}


def _ratios(times: dict[str, list[float]], mode: str, extra: list[float] | None = None) -> float:
    """Median over rounds of (mode [+ extra]) / none of the same round."""
    vals = times[mode] if extra is None else [a + b for a, b in zip(times[mode], extra)]
    return statistics.median(v / n for v, n in zip(vals, times["none"]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--backend", default="aot_eager", choices=["aot_eager", "inductor"])
    p.add_argument("--write-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3, help="raw-write / writer measurements (best kept)")
    p.add_argument("--skip-io", action="store_true", help="only the step-time part")
    p.add_argument("--skip-steps", action="store_true", help="only the write part")
    p.add_argument("--dir", default=None,
                   help="directory under which a temporary one is written and removed (created if missing; default: "
                   "the system's temporary directory)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads for training (default: torch's)")
    p.add_argument("--out", default="bench_capture.json")
    args = p.parse_args(argv)
    check_args(p, args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    io: dict = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        root = Path(d)
        if not args.skip_io:
            io["hash_gbps"] = hash_speeds()
            raw, wr = [], []
            for i in range(args.repeats):  # interleaved, so both see the same load; raw: the faster write size
                raw.append(max(raw_write(root, args.write_mib << 20, chunk) for chunk in (1 << 20, 64 << 20)))
                wr.append(writer_throughput(root / f"w{i}", args.write_mib << 20))
            io.update(raw_write_gbps=raw, writer_gbps=wr, writer_vs_raw=max(wr) / max(raw))
        st = None if args.skip_steps else step_times(args, root)
        per_call = None if args.skip_steps else per_call_cost(args.backend)
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
                   f"{'cuda' if torch.cuda.is_available() else 'cpu'}, {torch.get_num_threads()} intra-op threads",
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), **io, "config": vars(args),
        "environment": environment("cpu", argv),
    }
    if io:
        print(tabulate([[k, f"{v:.2f}"] for k, v in io["hash_gbps"].items()], headers=["checksum", "GB/s"]))
        print()
        print(tabulate([["raw sequential write (GB/s)", f"{max(io['raw_write_gbps']):.3f}"],
                        ["capture writer (GB/s)", f"{max(io['writer_gbps']):.3f}"],
                        ["writer / raw", f"{io['writer_vs_raw']:.2f}"]], headers=["write", "value"]))
        print()
    if st is not None:
        result.update(_step_report(args, st))
        result["per_call_outside_window"] = per_call
        print(f"one fxquant::capture call outside the window ({args.backend}): {per_call['us_per_call']:.1f} us "
              f"({per_call['calls_per_step']} calls per step of a 10-layer 8x8 stack: {per_call['step_us_none']:.0f} "
              f"-> {per_call['step_us_taps']:.0f} us)")
        result["loadavg_after"] = os.getloadavg()
        print(f"load average {load_before[0]:.2f} -> {result['loadavg_after'][0]:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(strict_dumps(result, indent=1))
    print(f"wrote {args.out}")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``p.error``: one line, exit 2) sizes and counts the run would fail on, before anything is written
    or compiled."""
    for flag in ("dim", "layers", "vocab", "seq", "batch", "steps", "write_mib", "repeats"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: {getattr(args, flag)} must be >= 1")
    if args.warmup < 0:
        p.error(f"--warmup: {args.warmup} must be >= 0")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads: {args.threads} must be >= 1")
    if args.heads < 2 or args.heads % 2:  # the model has heads / 2 kv heads
        p.error(f"--heads: {args.heads} must be even and >= 2 (the kv heads are half of them)")
    if args.dim % (2 * args.heads):  # RoPE rotates pairs of a head's dimensions
        p.error(f"--dim: {args.dim} must be a multiple of 2 x --heads ({2 * args.heads}): an even head dimension")
    if args.skip_io and args.skip_steps:
        p.error("--skip-io and --skip-steps together leave nothing to measure")


def _step_report(args, st: dict) -> dict:
    """Print the step-time table; the JSON fields of the step part."""
    times = st["times"]
    med = {m: statistics.median(t) for m, t in times.items()}
    out = {
        "step_s_median": med, "step_s_all": times, "drain_s_all": st["drains"],
        "ratio_none_b": _ratios(times, "none_b"), "ratio_inactive": _ratios(times, "inactive"),
        "ratio_active": _ratios(times, "active"), "ratio_active_plus_drain": _ratios(times, "active", st["drains"]),
        "min_ratio": {m: min(times[m]) / min(times["none"]) for m in MODES},
        "records_per_active_step": st["records_per_step"], "stored_mb_per_active_step": st["stored_mb_per_step"],
    }
    rows = [[m, f"{med[m]:.4f}", f"{out['ratio_' + m]:.3f}x" if m != "none" else "",
             f"{min(times[m]):.4f}", f"{out['min_ratio'][m]:.3f}x" if m != "none" else ""] for m in MODES]
    rows.append(["active + drain", f"{med['active'] + statistics.median(st['drains']):.4f}",
                 f"{out['ratio_active_plus_drain']:.3f}x", "", ""])
    print(tabulate(rows, headers=[f"step (dim {args.dim}, {args.layers} layers, {args.backend})", "median s",
                                  "median of round ratios", "min s", "min / min none"]))
    print(f"records per active step: {st['records_per_step']:.0f}, stored: {st['stored_mb_per_step']:.1f} MB")
    return out


if __name__ == "__main__":
    main()
