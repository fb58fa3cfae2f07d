"""Capture benchmark: writer throughput vs raw sequential writes, and step time with capture
active / configured-but-outside-its-window / absent, on a Llama-style model (every linear's input and
grad_output, the shipped ``linear_io`` spec). Prints a table and writes JSON (``--out``).

    python benchmarks/bench_capture.py [--dim 256 --layers 4 --seq 256 --batch 4 --steps 8 --backend aot_eager]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxquant import capture, schemes  # noqa: E402
from fxquant.backend import FxquantBackend  # noqa: E402
from fxquant.capture.spec import Span, Window  # noqa: E402
from fxquant.capture.writer import Item, ShardWriter  # noqa: E402
from fxquant.passes.capture_taps import insert_capture_taps  # noqa: E402
from tests.models import make_llama, make_tokens, next_token_loss  # noqa: E402


def raw_write(directory: Path, nbytes: int, chunk: int = 64 << 20) -> float:
    """GB/s of one sequential write of ``nbytes`` (64 MiB writes, one fsync at the end)."""
    buf = os.urandom(chunk)
    t0 = time.perf_counter()
    with open(directory / "raw.bin", "wb") as f:
        left = nbytes
        while left > 0:
            f.write(buf[: min(chunk, left)])
            left -= chunk
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    (directory / "raw.bin").unlink()
    return nbytes / dt / 1e9


def writer_throughput(directory: Path, nbytes: int, tensor_bytes: int = 4 << 20) -> float:
    """GB/s of the capture writer (checksums, safetensors shards, manifest, fsyncs) for ``nbytes`` of tensors."""
    n = max(1, nbytes // tensor_bytes)
    tensors = [torch.randn(tensor_bytes // 4) for _ in range(min(n, 16))]
    w = ShardWriter(directory / "w", shard_bytes=256 << 20)
    t0 = time.perf_counter()
    for i in range(n):
        t = tensors[i % len(tensors)]
        w.put(Item({"key": f"t{i:09d}", "seq": i}, t, None, nbytes=t.numel() * 4))
    state = w.close()
    dt = time.perf_counter() - t0
    assert state.error is None, state.error_reason
    return n * tensor_bytes / dt / 1e9


class _Backend(FxquantBackend):
    def __init__(self, spec, **kw):
        super().__init__(schemes.get("bf16"), **kw)
        self.spec = spec

    def compile_inner(self, gm, example_inputs):
        if self.spec is not None:
            insert_capture_taps(gm, self.spec)
        return super().compile_inner(gm, example_inputs)


def step_times(args, root: Path) -> tuple[dict[str, list[float]], int]:
    """Median-ready step times of three compiled copies of one model, run round-robin (so load on the machine
    hits them alike): no taps; taps with the session outside its window; taps inside the window."""
    base = capture.load_spec("linear_io")  # every iteration: bound it so that "outside the window" exists
    window = Window(Span(0, 10**6))
    spec = dataclasses.replace(base, sections=tuple(dataclasses.replace(x, when=window) for x in base.sections))
    models, tokens = {}, None
    for mode in ("none", "inactive", "active"):
        torch.manual_seed(0)
        model = make_llama(dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4, hidden_dim=args.dim * 3,
                           vocab_size=1024, max_seq_len=args.seq)
        tokens = make_tokens(model.cfg, batch=args.batch, seq_len=args.seq)
        backend = _Backend(None if mode == "none" else spec, inner=args.backend, root=model)
        models[mode] = (model, torch.compile(model, backend=backend))
    outside = 10**9
    session = capture.start(spec, root / "cap", start_iteration=0)
    times: dict[str, list[float]] = {m: [] for m in models}
    try:
        for i in range(args.warmup + args.steps):
            for mode, (model, compiled) in models.items():
                session.set_iteration(i if mode == "active" else outside)
                t0 = time.perf_counter()
                next_token_loss(compiled(tokens), tokens).backward()
                if mode == "active":
                    session.flush() if args.sync_flush else None
                dt = time.perf_counter() - t0
                if i >= args.warmup:
                    times[mode].append(dt)
                model.zero_grad(set_to_none=True)
    finally:
        summary = session.close()
    return times, summary["records"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="aot_eager", choices=["aot_eager", "inductor"])
    p.add_argument("--write-mib", type=int, default=1024)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--sync-flush", action="store_true", help="commit the shard after every active step (durability)")
    p.add_argument("--out", default="bench_capture.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        root = Path(d)
        nbytes = args.write_mib << 20
        raw = [raw_write(root, nbytes) for _ in range(2)]
        wr = [writer_throughput(root / f"w{i}", nbytes) for i in range(2)]
        times, records = step_times(args, root)
    med = {m: statistics.median(t) for m, t in times.items()}
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
                   f"{'cuda' if torch.cuda.is_available() else 'cpu'}",
        "raw_write_gbps": max(raw), "writer_gbps": max(wr), "writer_vs_raw": max(wr) / max(raw),
        "step_s": med, "records_active": records,
        "active_vs_none": med["active"] / med["none"], "inactive_vs_none": med["inactive"] / med["none"],
        "config": vars(args),
    }
    print(tabulate([["raw sequential write (GB/s)", f"{max(raw):.3f}"], ["capture writer (GB/s)", f"{max(wr):.3f}"],
                    ["writer / raw", f"{result['writer_vs_raw']:.2f}"],
                    ["step, no capture (s)", f"{med['none']:.4f}"],
                    ["step, capture outside window (s)", f"{med['inactive']:.4f}  ({result['inactive_vs_none']:.3f}x)"],
                    ["step, capture active (s)", f"{med['active']:.4f}  ({result['active_vs_none']:.3f}x)"],
                    ["records captured (active)", records]], headers=["measure", "value"]))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
