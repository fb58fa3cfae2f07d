"""Launch settings of the standalone Triton quantize kernels (``fxquant.kernels.launch.KernelLaunch``): elements
per program x warps per program, per format, each timed alone through ``launch.quantize`` (median of
``triton.testing.do_bench``) beside ``x.clone()`` and the ``abs_max`` pre-pass on the same tensor, and each
checked bit for bit against the default settings' result (the settings change speed only).

    python benchmarks/bench_kernel_launch.py --json launch.json                 # H100 / H200, ~2 minutes
    python benchmarks/bench_kernel_launch.py --formats nvfp4 --budget-s 30

The run stops starting settings after ``--budget-s`` seconds (the rest read "skipped"); the JSON is rewritten
after every format. On CPU it runs the kernels in Triton's interpreter on a small tensor over a few settings (a
check of the script; no timings).
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from envinfo import environment  # noqa: E402
from fxquant.analysis.outputs import strict_dumps  # noqa: E402
from fxquant import formats  # noqa: E402
from fxquant.formats.tensor_quant import TensorQuant  # noqa: E402

log = logging.getLogger("fxquant.benchmarks.bench_kernel_launch")
FORMATS = ("nvfp4", "mxfp8_e4m3", "mxfp4_e2m1", "hifp8", "fp8_e4m3")
SKIPPED = "skipped: --budget-s spent"


def grid(blocked: bool, on_gpu: bool) -> list[dict]:
    """The settings to try (``KernelLaunch`` fields), after the default."""
    if not on_gpu:
        return [dict(elements=1024), dict(elements=4096, warps=2)]
    warps = (2, 4, 8) if blocked else (4, 8)
    return [dict(elements=e, warps=w) for e, w in itertools.product((1024, 2048, 4096, 8192), warps)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN payloads included)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


def sweep(name: str, x: torch.Tensor, deadline: float, bench) -> list[dict]:
    import fxquant.kernels.launch as launch

    tq = TensorQuant(name)
    blocked = not isinstance(tq.fmt, formats.ElementFormat)
    y0 = launch.quantize(x, tq)
    rows = []
    for change in [{}] + grid(blocked, x.is_cuda):
        setting = launch.KernelLaunch(**change)
        row = {"format": name, **asdict(setting), "default": not change,
               "per_program": setting.per_program(), "num_warps": setting.num_warps(blocked)}
        if time.perf_counter() > deadline:
            rows.append({**row, "note": SKIPPED})
            continue

        def run(setting=setting):
            return launch.quantize(x, tq, launch=setting)

        try:
            y = run()
        except Exception as exc:  # noqa: BLE001  (a setting the chip cannot run)
            rows.append({**row, "note": f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
            log.warning("%s %s: %s", name, change, rows[-1]["note"])
            continue
        row["same_bits"] = same_bits(y, y0)
        row["ms"] = bench(run)
        rows.append(row)
        log.info("%s %s: %s ms, same bits %s", name, change or "default", row["ms"], row["same_bits"])
    return rows


def summary(rows: list[dict], copy_ms: float | None) -> list[dict]:
    """Per format: the default's time and the fastest setting's, and each as a fraction of the copy's speed."""
    out = []
    for name in dict.fromkeys(r["format"] for r in rows):
        timed = [r for r in rows if r["format"] == name and r.get("ms")]
        if not timed or copy_ms is None:
            continue
        default = next(r for r in timed if r["default"])
        best = min(timed, key=lambda r: r["ms"])
        out.append({"format": name, "default_ms": default["ms"], "default_x_copy": copy_ms / default["ms"],
                    "best_ms": best["ms"], "best_x_copy": copy_ms / best["ms"],
                    "best": {"elements": best["per_program"], "warps": best["num_warps"]}})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated (default {','.join(FORMATS)})")
    p.add_argument("--size", default="2^28", help="elements of the bf16 tensor on a GPU (default 2^28; CPU: 2^13)")
    p.add_argument("--budget-s", type=float, default=150.0, help="start no setting after this many seconds")
    p.add_argument("--json", type=Path, help="write the rows and the summary here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = [s.strip() for s in args.formats.split(",") if s.strip()]
    for name in names:
        if name not in formats.names():
            p.error(f"--formats: unknown {name!r} (known: {', '.join(formats.names())})")
    try:
        base, _, exp = args.size.partition("^")
        n = int(base) ** int(exp) if exp else int(base)
    except ValueError:
        p.error(f"--size: {args.size!r} is not an integer or a power like 2^28")
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        n = 1 << 13
    if n < 4096 or n % 4096:
        p.error(f"--size: {n} must be a multiple of 4096 (the tensor is [n / 4096, 4096])")
    if args.budget_s < 0:
        p.error(f"--budget-s: {args.budget_s} must be >= 0")
    dev = "cuda" if on_gpu else "cpu"
    x = torch.randn(n // 4096, 4096, device=dev, generator=torch.Generator(device=dev).manual_seed(0)).to(torch.bfloat16)
    if on_gpu:
        import triton

        def bench(fn):
            return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    else:
        def bench(fn):
            return None
    import fxquant.kernels.launch as launch

    copy_ms, amax_ms = bench(x.clone), bench(lambda: launch.abs_max(x))
    env = {**environment(dev, argv), "device": torch.cuda.get_device_name() if on_gpu else "cpu (interpreter)",
           "tensor": f"[{n // 4096}, 4096] bf16", "copy_ms": copy_ms, "abs_max_ms": amax_ms}
    log.info("%s", env)
    deadline = time.perf_counter() + args.budget_s
    rows: list[dict] = []
    for name in names:
        rows += sweep(name, x, deadline, bench)
        if args.json:
            args.json.write_text(strict_dumps({"environment": env, "rows": rows, "summary": summary(rows, copy_ms)},
                                            indent=1, default=str))
    for s in summary(rows, copy_ms):
        log.info("%s", json.dumps(s, default=str))
    bad = [r for r in rows if r.get("same_bits") is False]
    for r in bad:
        log.error("differs from the default settings' result: %s", r)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
