"""Where an MX block's structure costs time in Inductor's C++ code (CPU): its generated loop, transcribed, beside
variants that each change one thing, all built with Inductor's own compiler flags for this machine's vector ISA.

The work is what ``bench_formats.py --floor`` calls "block amax x block": per block of 32 bf16 values, the amax of
their magnitudes (stored, float32) and the block multiplied by it (bf16 out). Variants (``KERNELS``):

  inductor        the loop Inductor generates for it: one block per iteration, the amax by ``at::vec::maximum``
                  (NaN-propagating: a compare, a mask-to-vector and an or beside every max) over the block's
                  vectors and then across lanes (``vec_reduce_all``), then the multiply
  plain max       the same with a max that does not propagate NaN (``at::vec::clamp_min``): equal results for
                  NaN-free input
  two blocks      the same as ``inductor`` with two blocks per iteration (both reductions, then both multiplies)
  reduction only  the amaxes alone
  multiply only   the multiplies alone, from the stored amaxes

Each is timed writing into a reused output (the kernel's own time) and into a freshly allocated one, as a
compiled op does on every call (the first touch of a new 64 MiB buffer faults its pages in); the Inductor row is
``torch.compile`` of the same computation (fresh output). All variants are checked equal to the Inductor row
before timing (NaN-free input).

    python benchmarks/bench_block_reduction.py --json benchmarks/results/bench_block_reduction_cpu.json
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_formats import block_scale, make_timer, write_json  # noqa: E402
from envinfo import device_name, environment  # noqa: E402

BLOCK = 32
KERNELS = ("inductor", "plain max", "two blocks", "reduction only", "multiply only")
BLOCK_SCALE = functools.partial(block_scale, block=BLOCK)  # the computation, as bench_formats.py --floor compiles it

SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
using Vbf = at::vec::Vectorized<at::BFloat16>;
using VN = at::vec::VectorizedN<float, 2>;
constexpr int64_t B = 32;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
static_assert(B % Vbf::size() == 0, "a block is whole bf16 vectors");

static inline VN load(const at::BFloat16* p) { return at::vec::convert<float, 2, at::BFloat16, 1>(Vbf::loadu(p)); }
static inline void store(at::BFloat16* p, const VN& v) { at::vec::convert<at::BFloat16, 1, float, 2>(v).store(p); }

template <bool NAN_MAX>
static inline VN vmax(const VN& a, const VN& b) {
    if constexpr (NAN_MAX) return at::vec::maximum(a, b);
    VN r;
    for (int i = 0; i < 2; ++i) r[i] = at::vec::clamp_min(a[i], b[i]);
    return r;
}

template <bool NAN_MAX>
static inline float block_amax(const at::BFloat16* x) {
    VN acc(NEG_INF);
    for (int64_t j = 0; j < B; j += Vbf::size()) acc = vmax<NAN_MAX>(acc, load(x + j).abs());
    if constexpr (NAN_MAX) {
        return max_propagate_nan(NEG_INF, at::vec::vec_reduce_all<float, 2>(
            [](at::vec::Vectorized<float>& a, at::vec::Vectorized<float>& b) { return at::vec::maximum(a, b); }, acc));
    } else {
        return at::vec::vec_reduce_all<float, 2>(
            [](at::vec::Vectorized<float>& a, at::vec::Vectorized<float>& b) { return at::vec::clamp_min(a, b); }, acc);
    }
}

static inline void block_mul(const at::BFloat16* x, float a, at::BFloat16* out) {
    for (int64_t j = 0; j < B; j += Vbf::size()) store(out + j, load(x + j) * VN(a));
}

extern "C" void inductor(const at::BFloat16* x, float* amax, at::BFloat16* out, int64_t nb) {
    #pragma omp parallel for
    for (int64_t b = 0; b < nb; ++b) {
        amax[b] = block_amax<true>(x + B * b);
        block_mul(x + B * b, amax[b], out + B * b);
    }
}

extern "C" void plain_max(const at::BFloat16* x, float* amax, at::BFloat16* out, int64_t nb) {
    #pragma omp parallel for
    for (int64_t b = 0; b < nb; ++b) {
        amax[b] = block_amax<false>(x + B * b);
        block_mul(x + B * b, amax[b], out + B * b);
    }
}

extern "C" void two_blocks(const at::BFloat16* x, float* amax, at::BFloat16* out, int64_t nb) {
    #pragma omp parallel for
    for (int64_t b = 0; b < nb; b += 2) {
        amax[b] = block_amax<true>(x + B * b);
        amax[b + 1] = block_amax<true>(x + B * (b + 1));
        block_mul(x + B * b, amax[b], out + B * b);
        block_mul(x + B * (b + 1), amax[b + 1], out + B * (b + 1));
    }
}

extern "C" void reduction_only(const at::BFloat16* x, float* amax, at::BFloat16* out, int64_t nb) {
    #pragma omp parallel for
    for (int64_t b = 0; b < nb; ++b) amax[b] = block_amax<true>(x + B * b);
}

extern "C" void multiply_only(const at::BFloat16* x, float* amax, at::BFloat16* out, int64_t nb) {
    #pragma omp parallel for
    for (int64_t b = 0; b < nb; ++b) block_mul(x + B * b, amax[b], out + B * b);
}
"""


def build(workdir: Path) -> ctypes.CDLL:
    """The variants as one shared library, built with Inductor's flags for this machine's vector ISA."""
    from torch._inductor import cpp_builder, cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    if not isa:
        raise RuntimeError("Inductor finds no vector ISA on this CPU; its C++ code would be scalar")
    src = workdir / "block_reduction.cpp"
    src.write_text(SOURCE)
    builder = cpp_builder.CppBuilder(name="block_reduction", sources=[str(src)],
                                     BuildOption=cpp_builder.CppTorchOptions(vec_isa=isa, shared=True),
                                     output_dir=str(workdir))
    builder.build()
    return ctypes.CDLL(builder.get_target_file_path())


def kernels(lib: ctypes.CDLL) -> dict[str, Callable]:
    """Name -> ``f(x, amax, out)`` running that variant over contiguous bf16 ``x`` (a multiple of two blocks)."""
    def wrap(fn: Callable) -> Callable:
        def run(x: torch.Tensor, amax: torch.Tensor, out: torch.Tensor) -> None:
            fn(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(amax.data_ptr()), ctypes.c_void_p(out.data_ptr()),
               ctypes.c_int64(x.numel() // BLOCK))
        return run

    return {name: wrap(getattr(lib, name.replace(" ", "_"))) for name in KERNELS}


def check(x: torch.Tensor, fns: dict[str, Callable], inductor: Callable | None = None) -> None:
    """Every variant that writes the output writes Inductor's result (``inductor``: the computation compiled, else
    compiled here); every amax is the block's."""
    expect = (inductor or torch.compile(BLOCK_SCALE, dynamic=False))(x)
    want_amax = x.view(-1, BLOCK).float().abs().amax(-1)
    for name, fn in fns.items():
        amax = want_amax.clone() if name == "multiply only" else torch.full_like(want_amax, float("nan"))
        out = torch.empty_like(x)
        fn(x, amax, out)
        if not torch.equal(amax, want_amax):
            raise AssertionError(f"{name}: block amaxes differ from the reference")
        if name != "reduction only" and not torch.equal(out, expect):
            raise AssertionError(f"{name}: output differs from Inductor's")


def bench(args: argparse.Namespace) -> dict:
    n = args.elements
    if n % (2 * BLOCK):
        raise ValueError(f"--elements must be a multiple of {2 * BLOCK}, got {n}")
    x = torch.randn(n).bfloat16()
    with tempfile.TemporaryDirectory(prefix="bench_block_reduction_") as tmp:
        fns = kernels(build(Path(tmp)))
        compiled = torch.compile(BLOCK_SCALE, dynamic=False)
        check(x, fns, compiled)
        median = make_timer(torch.device("cpu"), args.repeat)
        t = lambda fn: median(fn)[0]  # noqa: E731
        amax = x.view(-1, BLOCK).float().abs().amax(-1)
        out = torch.empty_like(x)
        rows = [{"kernel": "x.clone()", "reused_ms": None, "fresh_ms": t(lambda: x.clone()) * 1e3},
                {"kernel": "torch.compile (Inductor)", "reused_ms": None, "fresh_ms": t(lambda: compiled(x)) * 1e3}]
        for name, fn in fns.items():
            reused = t(lambda: fn(x, amax, out))
            fresh = t(lambda: fn(x, torch.empty_like(amax), torch.empty_like(x)))
            rows.append({"kernel": name, "reused_ms": reused * 1e3, "fresh_ms": fresh * 1e3})
    from torch._inductor import cpu_vec_isa

    return {"device": device_name(torch.device("cpu")), "torch": torch.__version__,
            "vec_isa": str(cpu_vec_isa.pick_vec_isa()), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "elements": n, "block": BLOCK, "repeat": args.repeat, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=1 << 25,
                   help=f"bf16 elements, a multiple of {2 * BLOCK} (default 2^25: 64 MiB)")
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.elements < 2 * BLOCK or args.elements % (2 * BLOCK):
        p.error(f"--elements: {args.elements} must be a positive multiple of {2 * BLOCK} (whole pairs of blocks)")
    if args.repeat < 1:
        p.error(f"--repeat: {args.repeat} must be >= 1")
    result = bench(args)
    result["environment"] = environment("cpu", argv)
    print(f"# {result['device']}, torch {result['torch']}, Inductor ISA {result['vec_isa']}, {result['date']}")
    print(f"# {result['elements']} bf16 elements, blocks of {BLOCK}, median of {args.repeat}")
    print(tabulate([[r["kernel"], r["reused_ms"], r["fresh_ms"]] for r in result["rows"]],
                   headers=["kernel", "ms, reused output", "ms, fresh output"], floatfmt=".3g", missingval=""))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
