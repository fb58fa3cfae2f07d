"""Benchmark: `fxquant report` over a synthetic capture set vs reading the same set once from disk.

Writes a capture set of about --size-mb MB through the real capture runtime and writer (linear inputs,
weights and grad_outputs of an L-layer model in high precision; every --quantized-every-th one an MXFP8 copy),
then, in the same run: (1) drops the set from the page cache (posix_fadvise DONTNEED) and reads every
shard once sequentially ("cold read"), (2) reads it again ("warm read"), (3) drops it again and runs the
report with --workers processes, tables only and then with figures. Prints a table and writes JSON.
The issue's target: report <= 2x the cold read, on a 2 GB set (--size-mb 2048).

    python benchmarks/bench_report.py [--size-mb 256] [--workers 2] [--dtype bf16] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from envinfo import environment  # noqa: E402
from fxquant.analysis.outputs import strict_dumps  # noqa: E402
from fxquant import analysis, capture  # noqa: E402
from fxquant.capture.runtime import RankInfo  # noqa: E402
from fxquant.capture.spec import Component, Copy, Gemm, ModuleKind, Role  # noqa: E402
from fxquant.capture.tap import Tap  # noqa: E402
from fxquant.formats.tensor_quant import TensorQuant  # noqa: E402

SPEC = "sections:\n  - name: all\n    points: [{component: linear}]\n    when: {iterations: {start: 0, end: 1000}}\n    what: full\n"


def write_set(root: Path, size_mb: int, dtype: torch.dtype, rows: int, cols: int, quantized_every: int) -> int:
    per = rows * cols * torch.empty((), dtype=dtype).element_size()
    n = max(1, (size_mb << 20) // per)
    roles = ((Role.INPUT, 1.0), (Role.WEIGHT, 0.02), (Role.GRAD_OUTPUT, 1e-5))
    g = torch.Generator().manual_seed(0)
    spec = capture.load_spec("bench.yaml", text=SPEC)
    with capture.start(spec, root, scheme="FA_linear_mxfp8", rank=RankInfo(0, 1), run_id="bench") as s:
        for i in range(n):
            layer, (role, scale) = i // 3, roles[i % 3]
            s.set_iteration(0)
            x = (torch.randn(rows, cols, generator=g) * scale).to(dtype)
            mod = f"decoder.layers.{layer}.mlp.linear_fc1"
            if quantized_every and i % quantized_every == quantized_every - 1:
                tq = TensorQuant("mxfp8_e4m3")
                tap = Tap(Component.LINEAR, role, mod, (0,), ModuleKind.FC1, layer, copy=Copy.QUANTIZED,
                          gemm=Gemm.FPROP, qspec=tq.spec(), dim=-1)
                torch.ops.fxquant.capture(tq.quantize(x, -1), tap.encode(), x)
            else:
                torch.ops.fxquant.capture(x, Tap(Component.LINEAR, role, mod, (0,), ModuleKind.FC1, layer).encode())
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


def drop_cache(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_once(root: Path, chunk: int = 16 << 20) -> float:
    t0 = time.perf_counter()
    buf = bytearray(chunk)
    for p in sorted(root.rglob("*.safetensors")):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=256, help="capture set size (default 256; the target is 2048)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--quantized-every", type=int, default=4, help="every Nth tensor is an MXFP8 copy (0: none)")
    ap.add_argument("--dir", default=None,
                    help="where to write the set, under DIR/capture, which must not exist or be empty "
                         "(default: a temporary directory, removed afterwards)")
    ap.add_argument("--json", default="bench_report.json")
    args = ap.parse_args(argv)
    for flag in ("size_mb", "workers", "rows", "cols"):  # refused before any capture is written
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: {getattr(args, flag)} must be >= 1")
    if args.quantized_every < 0:
        ap.error(f"--quantized-every: {args.quantized_every} must be >= 0 (0: no quantized copies)")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    base = Path(args.dir or tempfile.mkdtemp(prefix="fxquant-bench-report-"))
    root = base / "capture"
    if root.exists() and any(root.iterdir()):  # the capture writer would append, and the figures count it all
        ap.error(f"--dir {base}: {root} already holds a capture set; give a new or empty --dir")
    try:
        t0 = time.perf_counter()
        nbytes = write_set(root, args.size_mb, dtype, args.rows, args.cols, args.quantized_every)
        t_write = time.perf_counter() - t0
        drop_cache(root)
        t_cold = read_once(root)
        t_warm = read_once(root)
        drop_cache(root)
        kw = {"workers": args.workers, "progress": False, "sample_blocks": 128}
        r1 = analysis.report([root], base / "report-tables", plots=False, **kw)
        drop_cache(root)
        r2 = analysis.report([root], base / "report", plots=True, **kw)
        rows = [["write (capture writer)", t_write, nbytes / t_write / 1e6, None],
                ["read once, cold cache", t_cold, nbytes / t_cold / 1e6, 1.0],
                ["read once, warm cache", t_warm, nbytes / t_warm / 1e6, t_warm / t_cold],
                [f"report, tables ({args.workers} workers)", r1.seconds, nbytes / r1.seconds / 1e6, r1.seconds / t_cold],
                [f"report, full ({args.workers} workers)", r2.seconds, nbytes / r2.seconds / 1e6, r2.seconds / t_cold]]
        print(f"capture set: {nbytes / 1e6:.0f} MB, {r2.records} tensors of {args.rows}x{args.cols} {args.dtype}; "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
        print(tabulate([[r[0], f"{r[1]:.2f}", f"{r[2]:.0f}", "-" if r[3] is None else f"{r[3]:.2f}x"] for r in rows],
                       headers=["step", "seconds", "MB/s", "vs cold read"]))
        result = {"bytes": nbytes, "tensors": r2.records, "dtype": args.dtype, "shape": [args.rows, args.cols],
                  "workers": args.workers, "cpus": os.cpu_count(), "torch": torch.__version__,
                  "seconds": {"write": t_write, "read_cold": t_cold, "read_warm": t_warm, "report_tables": r1.seconds,
                              "report_full": r2.seconds},
                  "ratio_vs_cold_read": {"report_tables": r1.seconds / t_cold, "report_full": r2.seconds / t_cold},
                  "target": "report <= 2x the cold read of a 2 GB set", "environment": environment("cpu", argv)}
        Path(args.json).write_text(strict_dumps(result, indent=1))
        print(f"wrote {args.json}")
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
