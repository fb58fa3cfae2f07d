"""Benchmark: fxquant.kernels.host's one-pass numba reductions against their pure-torch twins (the definitions),
on one CPU thread, as the analysis workers run them. Prints a table and writes JSON. "GB/s read" counts every
tensor a reduction reads: both the quantized copy and its source for the pair sums.

    python benchmarks/bench_host.py [--rows 2048 --cols 4096 --repeat 7 --json bench_host.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from envinfo import environment  # noqa: E402
from fxquant.analysis.outputs import strict_dumps  # noqa: E402
from fxquant.capture import stats as capture_stats  # noqa: E402
from fxquant.formats.tensor_quant import TensorQuant  # noqa: E402
from fxquant.kernels import host  # noqa: E402


def median_ms(fn, repeat: int) -> float:
    fn()  # first call: compile / load
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", default="bench_host.json")
    args = ap.parse_args(argv)
    for flag in ("rows", "cols", "repeat"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag}: {getattr(args, flag)} must be >= 1")
    if host.backend() != "numba":
        print("numba is not installed (or FXQUANT_HOST_KERNELS=torch): nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x32 = torch.randn(args.rows, args.cols, generator=g)
    x16 = x32.bfloat16()
    q16 = TensorQuant("mxfp8_e4m3").quantize(x16, -1)
    q32 = q16.float()
    cases = [  # (name, the tensors the reduction reads, numba, torch twin)
        ("bf16 counts (patterns + block-relative)", (x16,), lambda: host.bf16_counts(x16),
         lambda: host.bf16_counts_torch(x16)),
        ("float32 counts (histograms + moments)", (x32,), lambda: host.f32_counts(x32),
         lambda: host.f32_counts_torch(x32)),
        ("pair sums, bf16", (q16, x16), lambda: host.pair_sums(q16, x16), lambda: host.pair_sums_torch(q16, x16)),
        ("pair sums, float32", (q32, x32), lambda: host.pair_sums(q32, x32), lambda: host.pair_sums_torch(q32, x32)),
        ("capture statistics, bf16", (x16,), lambda: capture_stats.pack_tensor_stats(x16),
         lambda: capture_stats.pack_tensor_stats_torch(x16)),
        ("capture statistics, float32", (x32,), lambda: capture_stats.pack_tensor_stats(x32),
         lambda: capture_stats.pack_tensor_stats_torch(x32)),
    ]
    rows, out = [], []
    for name, inputs, fast, ref in cases:
        t_fast, t_ref = median_ms(fast, args.repeat), median_ms(ref, args.repeat)
        nbytes = sum(t.numel() * t.element_size() for t in inputs)
        gbs = nbytes / t_fast / 1e6
        rows.append([name, f"{t_fast:.1f}", f"{t_ref:.1f}", f"{t_ref / t_fast:.1f}x", f"{gbs:.2f}"])
        out.append({"case": name, "numba_ms": t_fast, "torch_ms": t_ref, "speedup": t_ref / t_fast,
                    "bytes_read": nbytes, "numba_gb_per_s": gbs})
    print(f"{args.rows}x{args.cols} elements, 1 thread; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}")
    print(tabulate(rows, headers=["reduction", "numba ms", "torch twin ms", "speed-up", "GB/s read"]))
    Path(args.json).write_text(strict_dumps({"shape": [args.rows, args.cols], "torch": torch.__version__,
                                           "cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
                                           "environment": environment("cpu", argv), "results": out}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
