"""Section ``fused`` of benchmarks/run_all.py: the fused quantize-on-load GEMM (``fxquant.kernels.qgemm``)
against "quantize kernel + cuBLAS" (what ``quantized_linear`` does), for a linear's three GEMMs.

Per shape (M tokens x K in -> N out) and format, one timed call runs fprop ``X W^T``, dgrad ``dY W`` and
wgrad ``dY^T X``:
    bf16 cuBLAS         three torch.matmul on bf16 tensors (the ceiling)
    quantize + cuBLAS   six fxquant::quantize launches (Triton), each operand along its GEMM's reduction
                        dim, then three bf16 torch.matmul
    fused qgemm         three qgemm launches on the tensors as they are (no quantized copy, no transpose)
The verdict (issue 7: keep a fusion only where it wins) is "keep" when the fused GEMMs are faster for
every shape and format, "drop" when slower for every one, otherwise "mixed" with the winning cases named.
Needs a CUDA device: on a machine without one every row reads "n/a (no GPU)".

    python benchmarks/run_all.py --sections fused
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from fxquant import kernels
from fxquant.formats.tensor_quant import TensorQuant

NO_GPU = "n/a (no GPU)"
FORMATS = ("mxfp8_e4m3", "hifp8", "mxfp4_e2m1")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _gemms_unfused(x, w, dy, spec: str):
    q = torch.ops.fxquant.quantize
    y = torch.matmul(q(x, spec, -1, None), q(w, spec, -1, None).t())
    dx = torch.matmul(q(dy, spec, -1, None), q(w, spec, 0, None))
    dw = torch.matmul(q(dy, spec, 0, None).t(), q(x, spec, 0, None))
    return y, dx, dw


def _gemms_fused(x, w, dy, tq: TensorQuant):
    from fxquant.kernels.qgemm import qgemm

    return qgemm(x, w.t(), tq, tq), qgemm(dy, w, tq, tq), qgemm(dy.t(), x, tq, tq)


def fused(args, dev: torch.device, timer: Callable[[Callable[[], object]], float],
          out_of_time: Callable[[], bool] = lambda: False) -> list[dict]:
    m = 256 if args.quick else 8192
    div = 8 if args.quick else 1
    shapes = [("4096x4096", 4096 // div, 4096 // div), ("llama1b fc1", 2048 // div, 8192 // div),
              ("llama1b fc2", 8192 // div, 2048 // div)]
    if dev.type != "cuda" or not kernels.available():
        return [{"shape": label, "impl": "fused qgemm vs quantize + cuBLAS", "note": NO_GPU} for label, _, _ in shapes]
    rows, wins = [], []
    for label, k, n in shapes:
        x, w, dy = (torch.randn(*s, device=dev, dtype=torch.bfloat16) for s in ((m, k), (n, k), (m, n)))
        shape = f"{label} M={m}"
        bf16_s = timer(lambda: (torch.matmul(x, w.t()), torch.matmul(dy, w), torch.matmul(dy.t(), x)))
        rows.append({"shape": shape, "format": "-", "impl": "bf16 cuBLAS (3 GEMMs)", "ms": bf16_s * 1e3, "x bf16": 1.0})
        for fmt in FORMATS:
            if out_of_time():
                rows.append({"shape": shape, "format": fmt, "note": "skipped: section time budget spent"})
                continue
            tq = TensorQuant(fmt)
            t0 = time.perf_counter()
            ref, got = _gemms_unfused(x, w, dy, tq.spec()), _gemms_fused(x, w, dy, tq)  # also compiles the kernels
            err = max(_rel(g, r) for g, r in zip(got, ref))
            unfused_s = timer(lambda: _gemms_unfused(x, w, dy, tq.spec()))
            fused_s = timer(lambda: _gemms_fused(x, w, dy, tq))
            wins.append((shape, fmt, fused_s < unfused_s))
            rows.append({"shape": shape, "format": fmt, "impl": "quantize + cuBLAS", "ms": unfused_s * 1e3,
                         "x bf16": unfused_s / bf16_s})
            rows.append({"shape": shape, "format": fmt, "impl": "fused qgemm", "ms": fused_s * 1e3, "x bf16": fused_s / bf16_s,
                         "x unfused": fused_s / unfused_s, "rel err vs unfused": err,
                         "note": f"first call {time.perf_counter() - t0:.1f} s"})
        del x, w, dy
    rows.append({"shape": "verdict", "impl": verdict(wins)})
    return rows


def verdict(wins: list[tuple[str, str, bool]]) -> str:
    """keep / drop / mixed, from (shape, format, fused faster) per measured case."""
    if not wins:
        return "none measured"
    if all(w for _, _, w in wins):
        return "keep: the fused GEMM wins in every case"
    if not any(w for _, _, w in wins):
        return "drop: quantize + cuBLAS wins in every case (fused_quantized_linear stays opt-in, unused by fxquant.compile)"
    return "mixed: fused wins for " + ", ".join(f"{s} {f}" for s, f, w in wins if w)
