"""Tile sizes and launch settings of the quantized flash-attention kernels, swept per FA preset: the forward
launch over ``block_m`` x warps x pipelining stages, the backward launches over (``bwd_m``, ``bwd_n``) x warps
x stages (``FlashBlocks``), each timed alone (``flash_attention_launch.forward`` / ``backward``, median of
``triton.testing.do_bench``) and checked against the default ``FlashBlocks()`` on the same inputs (largest
difference of O, dQ, dK, dV relative to the largest value; only accumulation order may differ). ``block_n``
stays at its default: it is part of the forward's semantics (P is quantized per key tile).

    python benchmarks/bench_flash_tiles.py --json tiles.json                       # H100 / H200, ~3 minutes
    python benchmarks/bench_flash_tiles.py --presets bf16 --budget-s 60
    python benchmarks/bench_flash_tiles.py --head-dim 128 --grid warps                # the default tiles, 4 / 8 warps

The run stops starting configurations after ``--budget-s`` seconds (the rest read "skipped"); the JSON is
rewritten after every preset. On CPU it runs the kernels in Triton's interpreter at a toy size over a few
configurations (a check of the script; no timings).
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_flash_ab import attention_quant  # noqa: E402
from envinfo import environment  # noqa: E402
from fxquant.analysis.outputs import strict_dumps  # noqa: E402
from fxquant.kernels.flash_attention import FlashBlocks, FlashQuant  # noqa: E402

log = logging.getLogger("fxquant.benchmarks.bench_flash_tiles")
PRESETS = ("bf16", "FA_mxfp8", "FA_QKPV_mxfp8")
SKIPPED = "skipped: --budget-s spent"
# Only accumulation order may differ from the default: outputs and gradients within 2^-6 of the largest value (a
# few bf16 ulps, or one quantization step of a dS / P element moving a gradient); anything larger is a wrong result
TOLERANCE = 2.0 ** -6


def grids(on_gpu: bool, grid: str = "full") -> tuple[list[dict], list[dict]]:
    """The forward and backward settings to try (``FlashBlocks`` fields; the default's are tried first).
    ``grid="warps"``: the default tiles and stages at 4 and 8 warps only."""
    if grid == "warps":
        return [dict(fwd_warps=w) for w in (4, 8)], [dict(bwd_warps=w) for w in (4, 8)]
    if not on_gpu:
        return [dict(block_m=32), dict(fwd_warps=2)], [dict(bwd_m=32, bwd_n=32), dict(bwd_stages=1)]
    fwd = [dict(block_m=m, fwd_warps=w, fwd_stages=s) for m, w, s in itertools.product((64, 128), (4, 8), (2, 3))]
    bwd = [dict(bwd_m=m, bwd_n=n, bwd_warps=w, bwd_stages=s)
           for (m, n), w, s in itertools.product(((64, 64), (32, 64), (64, 32), (128, 64), (64, 128), (32, 32)), (4, 8), (2, 3))]
    return fwd, bwd


def _rel(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    """The largest |a - b| over the largest |b|, across the tensors (NaN anywhere gives NaN)."""
    worst = 0.0
    for x, y in zip(a, b):
        x, y = x.float(), y.float()
        if not bool(torch.isfinite(x).all()):
            return float("nan")
        worst = max(worst, (x - y).abs().max().item() / max(y.abs().max().item(), 1e-30))
    return worst


def sweep(preset: str, tensors, deadline: float, grid: str = "full") -> list[dict]:
    import triton

    import fxquant.kernels.flash_attention_launch as launch

    q, k, v, do = tensors
    on_gpu = q.is_cuda
    b, h, lq, d = q.shape
    group, scale = h // k.shape[1], d ** -0.5
    fq = FlashQuant(attention_quant(preset))
    base = FlashBlocks()
    base.check(fq)
    o0, lse0 = launch.forward(q, k, v, True, scale, group, fq, base)
    g0 = launch.backward(q, k, v, o0, lse0, do, True, scale, group, fq, base)
    fwd, bwd = grids(on_gpu, grid)
    rows = []
    for part, settings in (("forward", fwd), ("backward", bwd)):
        for change in [{}] + settings:  # an entry spelling out the default's settings repeats it: a noise check
            blocks = replace(base, **change)
            row = {"preset": preset, "part": part, **asdict(blocks),
                   "launch": blocks.launch(part == "backward"), "default": not change}
            if time.perf_counter() > deadline:
                rows.append({**row, "note": SKIPPED})
                continue
            try:
                blocks.check(fq)
            except ValueError as exc:
                rows.append({**row, "note": f"not valid for {preset}: {exc}"})
                continue
            if part == "forward":
                def run(blocks=blocks):
                    return launch.forward(q, k, v, True, scale, group, fq, blocks)
            else:
                def run(blocks=blocks):
                    return launch.backward(q, k, v, o0, lse0, do, True, scale, group, fq, blocks)
            t0 = time.perf_counter()
            try:
                out = run()
                if on_gpu:
                    torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001  (a setting the chip cannot run, e.g. out of shared memory)
                rows.append({**row, "note": f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
                log.warning("%s %s %s: %s", preset, part, change, rows[-1]["note"])
                continue
            row["first_call_s"] = time.perf_counter() - t0
            row["rel_diff_vs_default"] = _rel(out[:1] if part == "forward" else out, (o0,) if part == "forward" else g0)
            row["ms"] = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median") if on_gpu else None
            rows.append(row)
            log.info("%s %s %s: %s ms, rel diff %.2e", preset, part, change or "default", row["ms"], row["rel_diff_vs_default"])
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per preset: the default's forward + backward time and the fastest measured of each part."""
    out = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        best, default = {}, {}
        for part in ("forward", "backward"):
            timed = [r for r in rows if r["preset"] == preset and r["part"] == part and r.get("ms")]
            if not timed:
                continue
            default[part] = next(r for r in timed if r["default"])
            best[part] = min(timed, key=lambda r: r["ms"])
        if len(best) < 2:
            continue
        total_default = default["forward"]["ms"] + default["backward"]["ms"]
        total_best = best["forward"]["ms"] + best["backward"]["ms"]
        keys = {"forward": ("block_m", "fwd_warps", "fwd_stages"), "backward": ("bwd_m", "bwd_n", "bwd_warps", "bwd_stages")}
        out.append({"preset": preset, "default_ms": total_default, "best_ms": total_best,
                    "speedup": total_default / total_best,
                    **{f"best_{p}": {k: best[p][k] for k in keys[p]} | {"launch": best[p]["launch"]} for p in best},
                    **{f"best_{p}_rel_diff": best[p]["rel_diff_vs_default"] for p in best}})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default=",".join(PRESETS), help=f"comma-separated: bf16 and FA presets (default {','.join(PRESETS)})")
    p.add_argument("--batch", type=int, default=2, help="batch (GPU; default 2)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (GPU; default 2048)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (GPU; default 64; heads = 2048 / d, kv heads / 4)")
    p.add_argument("--budget-s", type=float, default=180.0, help="start no configuration after this many seconds")
    p.add_argument("--grid", choices=("full", "warps"), default="full",
                   help="full: tiles x warps x stages; warps: the default tiles at 4 and 8 warps (default full)")
    p.add_argument("--json", type=Path, help="write the rows and the summary here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    try:
        for name in presets:
            attention_quant(name)
    except ValueError as exc:
        p.error(str(exc))
    if not presets:
        p.error("--presets: none given")
    for flag in ("batch", "seq"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag}: {getattr(args, flag)} must be >= 1")
    if args.head_dim < 1 or 2048 % (4 * args.head_dim):
        p.error(f"--head-dim: {args.head_dim} must divide 512 (heads = 2048 / d, kv heads a quarter of them)")
    if args.budget_s < 0:
        p.error(f"--budget-s: {args.budget_s} must be >= 0")
    on_gpu = torch.cuda.is_available()
    dev = "cuda" if on_gpu else "cpu"
    b, lq, d = (args.batch, args.seq, args.head_dim) if on_gpu else (1, 64, 32)
    h = 2048 // d if on_gpu else 4
    g = torch.Generator(device=dev).manual_seed(0)
    tensors = tuple(torch.randn(b, n, lq, d, device=dev, dtype=torch.bfloat16, generator=g) for n in (h, h // 4, h // 4, h))
    deadline = time.perf_counter() + args.budget_s
    rows: list[dict] = []
    env = {**environment(dev, argv), "device": torch.cuda.get_device_name() if on_gpu else "cpu (interpreter)",
           "shape": f"B={b} L={lq} d={d} H={h}/{h // 4} bf16 causal"}
    for preset in presets:
        rows += sweep(preset, tensors, deadline, args.grid)
        if args.json:
            args.json.write_text(strict_dumps({"environment": env, "rows": rows, "summary": summary(rows)}, indent=1, default=str))
    for s in summary(rows):
        log.info("%s", json.dumps(s, default=str))
    bad = [r for r in rows if "rel_diff_vs_default" in r and not r["rel_diff_vs_default"] <= TOLERANCE]
    for r in bad:
        log.error("differs from the default beyond accumulation order: %s", r)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
