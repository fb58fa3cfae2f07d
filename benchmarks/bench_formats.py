"""Quantize throughput of every format: eager reference, torch.compile'd reference, Triton, beside a copy.

GB/s counts the bytes the quantize reads plus writes (2 * numel * itemsize, the same as ``x.clone()``),
so "x copy" is the fraction of the copy bandwidth measured in the same run. Peers, timed on the same
tensor and reported on the same byte basis: torchao's eager MX cast (``to_mx``: E8M0 scales + element
codes, an encode rather than a quantize-dequantize) and the predecessor's log2-based HiF8, re-implemented
below for comparison only. GPU timing uses CUDA events after a synchronize; CPU timing uses
``time.perf_counter``; each figure is the median of ``--repeat`` runs after one warm-up.

    python benchmarks/bench_formats.py --size 2^20 --dtype bf16 --json bench.json          # CPU
    python benchmarks/bench_formats.py --size 2^28 --dtype bf16 --device cuda --json h100.json

``--floor`` adds rows (format "(floor)") of Inductor kernels that do part of a quantize's work on the same
tensor, for the share of each part: the dtype round trip alone (``x`` to float32, a multiply by 2, back), the
block structure of an MX format without its rounding (per ``--floor-blocks`` elements: the block amax, a multiply
of the block by it), and an element format's rounding alone comes from its own row (``fp8_e4m3``).

GPU targets (issue 2): Triton at >= 0.85x copy for mxfp8_e4m3 and hifp8, >= 0.75x for mxfp4_e2m1 and
nvfp4 (2^28-element bf16). NVFP4 needs the tensor amax before any element is scaled, i.e. a second read
of x, which bounds it near 2/3 of copy bandwidth.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch._inductor.config
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from envinfo import device_name, environment, parse_device  # noqa: E402
from fxquant.analysis.outputs import strict_dumps  # noqa: E402
from fxquant import formats, kernels  # noqa: E402
from fxquant.formats.tensor_quant import TensorQuant  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TARGETS = {"mxfp8_e4m3": 0.85, "hifp8": 0.85, "mxfp4_e2m1": 0.75, "nvfp4": 0.75}
IMPLS = ("eager", "compiled", "inductor", "triton", "peers")
ROW_LEN = 4096  # x is [numel / 4096, 4096], blocked along the last dim


def predecessor_hifp8(x: torch.Tensor) -> torch.Tensor:
    """The predecessor's HiF8 method, re-implemented FOR COMPARISON ONLY (it is wrong; PREDECESSOR.md):
    exponents from per-element ``floor(log2 |x|)`` computed in bf16, tiny non-zero values clamped UP to
    2**-22, Inf clamped to 32768, ties away from zero on the tapered 3/2/1/0-bit mantissa grid."""
    xb = x.to(torch.bfloat16)
    a = xb.abs()
    a = torch.where(a == 0, a, torch.clamp(a, min=2.0**-22, max=32768.0))
    e = torch.floor(torch.log2(a))
    ae = e.abs()
    mbits = torch.where(ae <= 3, 3.0, torch.where(ae <= 7, 2.0, torch.where(ae <= 15, 1.0, 0.0))).to(torch.bfloat16)
    step = torch.exp2(e - mbits)
    q = torch.clamp(torch.floor(a / step + 0.5) * step, max=32768.0)
    return (torch.sign(xb) * q).to(x.dtype)


def _torchao_to_mx() -> tuple[Callable | None, dict[str, object], str]:
    """torchao's eager MX cast and the element dtype per MX format (torchao has no MXINT8)."""
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except ImportError as exc:  # torchao is a dev dependency; say so in the table instead of failing
        return None, {}, f"torchao not importable ({exc})"
    elem = {
        "mxfp8_e4m3": torch.float8_e4m3fn,
        "mxfp8_e5m2": torch.float8_e5m2,
        "mxfp6_e3m2": "fp6_e3m2",
        "mxfp6_e2m3": "fp6_e2m3",
        "mxfp4_e2m1": torch.float4_e2m1fn_x2,
    }
    return to_mx, elem, ""


def write_json(path: Path | None, result: dict) -> None:
    """Write ``result`` as indented JSON to ``path`` (``--json``; nothing when None) and say where."""
    if path is not None:
        path.write_text(strict_dumps(result, indent=2))
        print(f"# wrote {path}")


def make_timer(device: torch.device, repeat: int) -> Callable[[Callable[[], object]], tuple[float, float]]:
    """(median, min) seconds of ``fn()`` over ``repeat`` runs after one warm-up, synchronised on CUDA."""

    def run(fn: Callable[[], object]) -> tuple[float, float]:
        fn()
        times = []
        for _ in range(repeat):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times), min(times)

    return run


def parse_size(text: str) -> int:
    """'1048576', '2^20' or '2**20' -> elements, rounded up to whole rows of 4096; ValueError for anything else
    (not an integer or a power of two, or not positive)."""
    bad = f"--size: {text!r} is not an integer or a power of two like 2^22"
    base, caret, exp = text.strip().replace("**", "^").partition("^")
    try:
        n, power = int(base), (int(exp) if caret else None)
    except ValueError:
        raise ValueError(bad) from None
    if power is not None:
        if n != 2 or power < 0:
            raise ValueError(bad)
        n = 2**power
    if n <= 0:
        raise ValueError(f"--size: {text!r} must be positive")
    return -(-n // ROW_LEN) * ROW_LEN


def parse_blocks(text: str) -> list[int]:
    """'32,512' -> [32, 512] (``--floor-blocks``); ValueError unless every entry is a positive integer."""
    try:
        blocks = [int(b) for b in text.split(",")]
    except ValueError:
        raise ValueError(f"--floor-blocks: {text!r} is not a comma-separated list of integers") from None
    if any(b < 1 for b in blocks):
        raise ValueError(f"--floor-blocks: {text!r}: every block size must be >= 1")
    return blocks


def bench(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    n = parse_size(args.size)
    names = formats.names() if args.formats == "all" else [formats.canonical_name(f) for f in args.formats.split(",")]
    impls = IMPLS if args.impls == "all" else tuple(args.impls.split(","))
    timer = make_timer(device, args.repeat)
    x = torch.randn(n // ROW_LEN, ROW_LEN, device=device).to(dtype)
    nbytes = 2 * x.numel() * x.element_size()
    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    copy_s, copy_min = timer(lambda: x.clone())
    if "inductor" in impls:  # the same-run reference for the fused op: Inductor's own copy kernel
        torch._dynamo.reset()
        copy_c = torch.compile(lambda t: t * 1, dynamic=False)
        copy_c(x)
        copy_cs, _ = timer(lambda: copy_c(x))
    on_gpu = device.type == "cuda" and kernels.available()
    to_mx, torchao_elem, torchao_note = _torchao_to_mx()
    rows = [{"format": "(copy)", "impl": "x.clone()", "ms": copy_s * 1e3, "GB/s": gbs(copy_s), "x copy": 1.0,
             "min_ms": copy_min * 1e3}]

    def add(name: str, impl: str, fn: Callable[[], object] | None, note: str = "", extra: dict | None = None) -> None:
        if fn is None:
            rows.append({"format": name, "impl": impl, "ms": None, "GB/s": None, "x copy": None, "note": note})
            return
        s, s_min = timer(fn)
        row = {"format": name, "impl": impl, "ms": s * 1e3, "GB/s": gbs(s), "x copy": copy_s / s, "note": note,
               "min_ms": s_min * 1e3}
        rows.append({**row, **(extra or {})})
        print(f"  {name:12s} {impl:22s} {s * 1e3:9.2f} ms {gbs(s):8.2f} GB/s", file=sys.stderr, flush=True)

    if "inductor" in impls:
        rows.append({"format": "(copy)", "impl": "x * 1 (Inductor)", "ms": copy_cs * 1e3, "GB/s": gbs(copy_cs),
                     "x copy": copy_s / copy_cs})
    if args.floor:
        for impl, fn in _floor_kernels(x, args.floor_blocks):
            add("(floor)", impl, fn)
    for name in names:
        tq = TensorQuant(name)
        if "eager" in impls:
            add(name, "reference (eager)", lambda: tq.quantize(x, -1))
        if "compiled" in impls:
            # One code object serves every format: without a reset Dynamo hits its recompile limit after 8
            # formats and silently runs the rest eagerly.
            torch._dynamo.reset()
            compiled = torch.compile(lambda t: tq.quantize(t, -1), dynamic=False)
            t0 = time.perf_counter()
            compiled(x)
            compile_s = time.perf_counter() - t0
            add(name, "reference (compiled)", lambda: compiled(x), f"first call {compile_s:.1f} s", {"compile_s": compile_s})
        if "inductor" in impls:
            add(name, *_inductor_quantize(tq, x))
        if "triton" in impls:
            if on_gpu:
                target = TARGETS.get(name)
                add(name, "triton", lambda: kernels.quantize(x, tq, -1), f"target >= {target}x copy" if target else "")
            else:
                add(name, "triton", None, "n/a (no GPU)")
        if "peers" in impls:
            if name in torchao_elem:
                add(name, "torchao to_mx (eager)", lambda: to_mx(x, torchao_elem[name], 32), "encode only")
            elif name.startswith("mx") and to_mx is None:
                add(name, "torchao to_mx (eager)", None, torchao_note)
            if name == "hifp8":
                add(name, "predecessor log2 HiF8", lambda: predecessor_hifp8(x), "comparison only, wrong numerics")
    return {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "numel": x.numel(),
        "shape": list(x.shape),
        "dtype": str(dtype),
        "repeat": args.repeat,
        "inductor_cpp_simdlen": torch._inductor.config.cpp.simdlen,
        "bytes_per_call": nbytes,
        "rows": rows,
    }


def _inductor_quantize(tq: TensorQuant, x: torch.Tensor) -> tuple:
    """(impl, fn, note, extra) of ``fxquant::quantize`` lowered into Inductor's code (``kernels="inductor"``)."""
    import fxquant.ops  # noqa: F401  (defines the op)
    from fxquant import lowering

    torch._dynamo.reset()
    spec = tq.spec()
    compiled = torch.compile(lambda t: torch.ops.fxquant.quantize(t, spec, -1, None), backend=lowering.inductor_backend)
    t0 = time.perf_counter()
    compiled(x)
    compile_s = time.perf_counter() - t0
    return "fxquant::quantize (Inductor)", lambda: compiled(x), f"first call {compile_s:.1f} s", {"compile_s": compile_s}


def _floor_kernels(x: torch.Tensor, blocks: list[int]) -> list[tuple[str, Callable[[], object]]]:
    """(impl, fn) of the ``--floor`` kernels on ``x``, each compiled by Inductor (and run once)."""
    out = []

    def compiled(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        torch._dynamo.reset()
        c = torch.compile(fn, dynamic=False)
        c(x)
        return lambda: c(x)

    out.append(("float32 round trip, x * 2 (Inductor)", compiled(lambda t: (t.float() * 2).to(t.dtype))))
    for b in blocks:
        if x.numel() % b:
            raise ValueError(f"--floor-blocks: {b} does not divide {x.numel()} elements")
        out.append((f"block amax x block, {b} (Inductor)", compiled(functools.partial(block_scale, block=b))))
    return out


def block_scale(t: torch.Tensor, block: int) -> torch.Tensor:
    """An MX block's structure without its rounding: each ``block`` elements times their amax (``--floor``)."""
    tb = t.view(-1, block).float()
    return (tb * tb.abs().amax(-1, keepdim=True)).to(t.dtype).view(t.shape)


def _triton_version() -> str | None:
    if not kernels.available():
        return None
    import triton

    return triton.__version__


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="2^22", help="elements (e.g. 4194304, 2^28); default 2^22")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--formats", default="all", help=f"comma-separated, or 'all': {','.join(formats.names())}")
    p.add_argument("--impls", default="all", help=f"comma-separated subset of {','.join(IMPLS)}, or 'all'")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--floor", action="store_true", help="also time the parts of a quantize's work (Inductor)")
    p.add_argument("--floor-blocks", default="32,512",
                   help="block sizes of --floor's block-structure rows, each dividing the tensor (default 32,512)")
    p.add_argument("--simdlen", type=int, default=None,
                   help="Inductor's C++ vector width in bits (cpp.simdlen; default: Inductor's choice for the CPU)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    check_args(p, args)
    if args.simdlen is not None:
        torch._inductor.config.cpp.simdlen = args.simdlen
    result = bench(args)
    result["environment"] = environment(args.device, argv)
    print(f"# {result['device']}, torch {result['torch']}, triton {result['triton']}, {result['date']}")
    print(f"# x: {result['shape']} {result['dtype']}, GB/s = (bytes read + written) / time, median of {args.repeat}")
    table = [[r["format"], r["impl"], r["ms"], r.get("min_ms"), r["GB/s"], r["x copy"], r.get("note", "")]
             for r in result["rows"]]
    headers = ["format", "impl", "ms (median)", "ms (min)", "GB/s", "x copy", "note"]
    print(tabulate(table, headers=headers, floatfmt=".3g", missingval="n/a"))
    write_json(args.json, result)
    return 0


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``p.error``: one line, exit 2) what ``bench`` would fail on, before anything runs; ``--floor-blocks``
    becomes a list of ints."""
    try:
        n = parse_size(args.size)
        args.floor_blocks = parse_blocks(args.floor_blocks)
        if args.formats != "all":
            args.formats = ",".join(formats.canonical_name(f) for f in args.formats.split(","))
    except ValueError as exc:
        p.error(str(exc) if str(exc).startswith("--") else f"--formats: {exc}")
    for b in args.floor_blocks if args.floor else ():
        if n % b:
            p.error(f"--floor-blocks: {b} does not divide the {n} elements of --size {args.size}")
    if args.repeat < 1:
        p.error(f"--repeat: {args.repeat} must be >= 1")
    if args.simdlen is not None and args.simdlen not in (0, 128, 256, 512):
        p.error(f"--simdlen: {args.simdlen} is not one of 0 (scalar), 128, 256, 512")
    unknown = set(args.impls.split(",")) - set(IMPLS) if args.impls != "all" else set()
    if unknown:
        p.error(f"--impls: unknown {sorted(unknown)}; allowed {list(IMPLS)}")
    parse_device(p, args.device)


if __name__ == "__main__":
    raise SystemExit(main())
