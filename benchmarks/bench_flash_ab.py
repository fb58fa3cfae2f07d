"""The quantized flash-attention kernels of this checkout against those of an earlier commit, in one process:
forward + backward through ``flash_attention_launch`` (no autograd wrapper), per FA preset; the time of each
(median, ``triton.testing.do_bench``), the first call (Triton's compile included) and whether the two give the
same bits (output, dQ, dK, dV). Writes JSON.

The earlier kernels are ``fxquant/kernels/flash_attention_kernels.py`` and ``flash_attention_launch.py`` of
``--rev`` (taken with ``git show``; a GPU machine without the repository's history gets them extracted here with
``--extract DIR`` and pass ``--old DIR`` there). Both versions share the rest of the package (tiles,
primitives, spec), so the comparison is meaningful only while those are unchanged between the two.

    python benchmarks/bench_flash_ab.py --extract benchmarks/.flash_old --rev e1866d9        # on this machine
    python benchmarks/bench_flash_ab.py --old benchmarks/.flash_old --json ab.json            # on the GPU

On CPU it runs the kernels in Triton's interpreter at a toy size (a check of the script; no timings).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from envinfo import environment  # noqa: E402
from fxquant.analysis.outputs import strict_dumps  # noqa: E402
from fxquant import schemes  # noqa: E402
from fxquant.kernels.flash_attention import FlashBlocks, FlashQuant  # noqa: E402
from fxquant.schemes import Site, SiteKind  # noqa: E402

log = logging.getLogger("fxquant.benchmarks.bench_flash_ab")
FILES = {"kernels": "flash_attention_kernels.py", "launch": "flash_attention_launch.py"}
PRESETS = ("bf16", "FA_mxfp8", "FA_QKPV_mxfp8", "FA_QKPV_hifp8", "FA_QKPV_mxfp4")


def extract(rev: str, out: Path) -> None:
    """Write ``rev``'s two kernel files to ``out``, the launch importing the kernels beside it."""
    out.mkdir(parents=True, exist_ok=True)
    for key, name in FILES.items():
        src = subprocess.run(["git", "show", f"{rev}:fxquant/kernels/{name}"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        if key == "launch":
            src = src.replace("from fxquant.kernels.flash_attention_kernels import", "from _old_flash_attention_kernels import")
        (out / f"_old_{name}").write_text(src)
    (out / "REV").write_text(rev + "\n")


def load_old(old: Path):
    """The earlier launch module (its kernels imported from the same directory)."""
    if not (old / "_old_flash_attention_launch.py").is_file():
        raise SystemExit(f"--old {old}: no _old_flash_attention_launch.py there; make it with --extract")
    sys.path.insert(0, str(old))
    spec = importlib.util.spec_from_file_location("_old_flash_launch", old / "_old_flash_attention_launch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def attention_quant(preset: str) -> schemes.AttentionQuant:
    """The attention quantization of ``preset`` ("bf16": none) as the flash kernels take it; ValueError naming the
    preset for an unknown one, one without an attention rule or one the kernels cannot run."""
    if preset == "bf16":
        return schemes.AttentionQuant()
    if preset not in schemes.names():
        raise ValueError(f"--presets: unknown {preset!r}")
    aq = schemes.get(preset).attention_for(Site.from_path("layers.0.self_attn", SiteKind.ATTENTION))
    if aq is None:
        raise ValueError(f"--presets: {preset!r} quantizes no attention (give bf16 or an FA_ preset)")
    try:
        FlashQuant(aq)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--presets: {preset!r}: {exc}") from None
    return aq


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--extract", type=Path, help="write --rev's kernel files to this directory and exit")
    p.add_argument("--rev", default="HEAD", help="the earlier commit for --extract (default HEAD)")
    p.add_argument("--old", type=Path, help="a directory made by --extract: the earlier kernels to compare with")
    p.add_argument("--presets", default=",".join(PRESETS), help=f"comma-separated FA presets (default {','.join(PRESETS)})")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (GPU; default 2048)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (GPU; default 64; heads = 2048 / d, kv heads / 4)")
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    try:
        aqs = {preset: attention_quant(preset) for preset in presets}
    except ValueError as exc:
        p.error(str(exc))
    if not presets:
        p.error("--presets: none given")
    if args.seq < 1:
        p.error(f"--seq: {args.seq} must be >= 1")
    if args.head_dim < 1 or 2048 % (4 * args.head_dim):
        p.error(f"--head-dim: {args.head_dim} must divide 512 (heads = 2048 / d, kv heads a quarter of them)")
    if args.extract:
        extract(args.rev, args.extract)
        log.info("wrote %s's flash kernels to %s", args.rev, args.extract)
        return 0
    if args.old is None:
        p.error("give --old DIR (made by --extract) or --extract DIR")

    import triton

    import fxquant.kernels.flash_attention_launch as new

    old = load_old(args.old)
    on_gpu = torch.cuda.is_available()
    dev = "cuda" if on_gpu else "cpu"
    lq, d = (args.seq, args.head_dim) if on_gpu else (128, 32)
    h = 2048 // d if on_gpu else 4
    hk = max(1, h // 4)
    blocks = FlashBlocks(128, 64, 64, 64) if on_gpu else FlashBlocks(64, 64, 64, 64)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(1, n, lq, d, device=dev, dtype=torch.bfloat16, generator=g) for n in (h, hk, hk, h))
    scale = d ** -0.5
    rows = []
    for preset, aq in aqs.items():
        fq = FlashQuant(aq)
        out, row = {}, {"preset": preset, "shape": f"L={lq} d={d} H={h}/{hk}", "device": torch.cuda.get_device_name() if on_gpu else "cpu (interpreter)"}
        for name, mod in (("old", old), ("new", new)):
            def run(mod=mod):
                o, lse = mod.forward(q, k, v, True, scale, h // hk, fq, blocks)
                return (o,) + tuple(mod.backward(q, k, v, o, lse, do, True, scale, h // hk, fq, blocks))

            t0 = time.perf_counter()
            out[name] = run()
            if on_gpu:
                torch.cuda.synchronize()
            row[f"{name}_first_call_s"] = time.perf_counter() - t0
            row[f"{name}_ms"] = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median") if on_gpu else None
        row["bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(out["old"], out["new"]))
        row["max_abs_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(out["old"], out["new"]))
        if on_gpu:
            row["old_over_new"] = row["old_ms"] / row["new_ms"]
        rows.append(row)
        log.info("%s", json.dumps(row))
    if args.json:
        args.json.write_text(strict_dumps({"old": (args.old / "REV").read_text().strip() if (args.old / "REV").is_file() else None,
                                         "environment": environment(dev, argv), "rows": rows}, indent=1))
    return 0 if all(r["bitwise_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
