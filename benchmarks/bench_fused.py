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
    python benchmarks/bench_fused.py [--quick] [--json bench_fused.json]   # the same; run_all.py's other options

Run as a script it is ``run_all.py --sections fused`` (JSON written to ``bench_fused.json`` unless ``--json``).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxquant import kernels  # noqa: E402
from fxquant.formats.tensor_quant import TensorQuant  # noqa: E402

NO_GPU = "n/a (no GPU)"
FORMATS = ("mxfp8_e4m3", "hifp8", "mxfp4_e2m1")
# A linear's shapes, (name, K in, N out) at full size, with M = 8192 tokens; --quick divides K and N by 8, M = 256
LINEAR_SHAPES = (("square", 4096, 4096), ("llama1b fc1 (gate/up)", 2048, 8192), ("llama1b fc2 (down)", 8192, 2048))


def linear_shapes(quick: bool) -> tuple[int, list[tuple[str, int, int]]]:
    """(M, [(label, K, N)]) of the linear and fused sections; each label names the sizes run, and with ``quick``
    says that they are the layer's divided by 8 ("llama1b fc1 (gate/up) / 8: K=256 N=1024 M=256")."""
    m, div = (256, 8) if quick else (8192, 1)
    return m, [(f"{name}{f' / {div}' if div > 1 else ''}: K={k // div} N={n // div} M={m}", k // div, n // div)
               for name, k, n in LINEAR_SHAPES]


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
    m, shapes = linear_shapes(args.quick)
    if dev.type != "cuda" or not kernels.available():
        return [{"shape": label, "impl": "fused qgemm vs quantize + cuBLAS", "note": NO_GPU} for label, _, _ in shapes]
    rows, wins = [], []
    for shape, k, n in shapes:
        x, w, dy = (torch.randn(*s, device=dev, dtype=torch.bfloat16) for s in ((m, k), (n, k), (m, n)))
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


def main(argv: list[str] | None = None) -> int:
    """``run_all.py --sections fused`` with run_all.py's other options (``--quick``, ``--device``, ``--repeat``, ...);
    the JSON goes to ``bench_fused.json`` unless ``--json`` says where."""
    import run_all

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--sections" or a.startswith("--sections=") for a in argv):
        print("bench_fused.py: runs the fused section only; for others: python benchmarks/run_all.py --sections ...",
              file=sys.stderr)
        return 2
    return run_all.main(["--sections", "fused", "--json", "bench_fused.json", *argv])


if __name__ == "__main__":
    raise SystemExit(main())
