"""The Triton implementation behind ``torch.ops.fxquant.quantize``: registration, routing, opcheck, and a
GPU compile check that runs without a GPU.

On CPU the op's CPU implementation is routed through the kernels in Triton's interpreter
(``fxquant.kernels.register(device="cpu")``, ARCHITECTURE.md trap 7) for the duration of one fixture, then
disabled again so that the rest of the suite keeps the reference. The compile check builds the kernels
for an sm_90 target with Triton's own compiler (no driver needed) and inspects the PTX for the properties
bit-exactness depends on: IEEE divisions, no FMA contraction, flush-to-zero only where inputs are normal.
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before fxquant.kernels defines its kernels (see test_kernels.py)

import pytest

import fxquant.ops  # noqa: F401  (defines torch.ops.fxquant.quantize)
from fxquant import kernels
from fxquant.formats.tensor_quant import TensorQuant
from tests.kernel_hooks import launches_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")]


@pytest.fixture
def triton_op():
    """torch.ops.fxquant.quantize dispatching to the Triton kernels on DEVICE; counts kernel launches."""
    from fxquant.kernels import _quantize, launch

    kernels.register(DEVICE)
    watched = (_quantize._quantize_element_kernel, _quantize._quantize_mx_kernel, _quantize._quantize_nvfp4_kernel)
    try:
        with launches_of(*(watched if launch.INTERPRETED else ())) as launches:
            yield launches
    finally:
        if DEVICE == "cpu":
            kernels.restore_reference("cpu")  # the rest of the suite runs the reference on CPU


def _inputs() -> list[tuple[torch.Tensor, str, int]]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 40, generator=g).to(DEVICE)
    return [
        (x, TensorQuant("mxfp8_e4m3").spec(), -1),
        (x.to(torch.bfloat16).t(), TensorQuant("mxfp4", rounding="sr").spec(), 0),
        (x, TensorQuant("hifp8", scaling="tensor").spec(), 1),
        (x.to(torch.float16), TensorQuant("nvfp4").spec(), -1),
        (x.t(), TensorQuant("nvfp4", rounding="sr", block_2d=True).spec(), 0),  # 16x16 tiles: the kernels too
    ]


def test_op_routes_through_the_kernels_and_equals_the_reference(triton_op) -> None:
    for x, qspec, dim in _inputs():
        got = torch.ops.fxquant.quantize(x, qspec, dim, 17)
        want = TensorQuant.from_spec(qspec).quantize(x.cpu(), dim, seed=17)
        assert got.dtype == x.dtype and got.shape == x.shape and got.is_contiguous()
        assert torch.equal(got.cpu().float().view(torch.int32), want.float().view(torch.int32))
    if DEVICE == "cpu":
        assert triton_op == [
            "_quantize_mx_kernel",
            "_quantize_mx_kernel",
            "_quantize_element_kernel",
            "_quantize_nvfp4_kernel",
            "_quantize_nvfp4_kernel",
        ]


def test_opcheck_with_the_triton_implementation(triton_op) -> None:
    for x, qspec, dim in _inputs():
        torch.library.opcheck(torch.ops.fxquant.quantize.default, (x, qspec, dim, 5))
    if DEVICE == "cpu":
        assert len(triton_op) >= 5, "opcheck never reached the Triton kernels"


def test_restore_reference_routes_cpu_back(triton_op) -> None:
    if DEVICE != "cpu":
        pytest.skip("the CPU routing exists only under the interpreter")
    kernels.restore_reference("cpu")
    x, qspec, dim = _inputs()[0]
    torch.ops.fxquant.quantize(x, qspec, dim, None)
    assert triton_op == []


def test_register_rejects_unknown_devices() -> None:
    with pytest.raises(ValueError, match="device='tpu'.*allowed"):
        kernels.register("tpu")


@pytest.mark.slow
def test_register_cpu_follows_what_triton_decided_at_import() -> None:
    """Kernels decorated without the interpreter cannot run on CPU: register says why; TRITON_INTERPRET=on, which
    Triton reads as true, registers (it was refused for not being "1"). Fresh processes."""
    code = (
        "import os; os.environ.pop('TRITON_INTERPRET', None)\n"
        "import fxquant.kernels.launch as l; assert not l.INTERPRETED\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from fxquant import kernels\n"
        "try:\n    kernels.register('cpu')\nexcept RuntimeError as e:\n    print('RuntimeError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "RuntimeError: device='cpu' runs the Triton kernels in Triton's interpreter" in out.stdout, out.stderr
    assert "before fxquant.kernels.launch is first imported" in out.stdout
    code = ("import os; os.environ['TRITON_INTERPRET'] = 'on'\nimport torch\nfrom fxquant import kernels\n"
            "from fxquant.formats.tensor_quant import TensorQuant\n"
            "kernels.register('cpu')\nx = torch.randn(4, 64)\ntq = TensorQuant('mxfp8_e4m3')\n"
            "print(kernels.registered('cpu'), torch.equal(kernels.quantize(x, tq, -1), tq.quantize(x, -1)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "True True", (out.stdout, out.stderr)


# -- the GPU build, checked on any machine -----------------------------------------------------------------
_GPU_COMPILE = r'''
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fxquant.formats.element import E2M1, E4M3, E5M2, HIF8, INT8
from fxquant.kernels import launch
from fxquant.kernels._quantize import _quantize_element_kernel, _quantize_mx_kernel, _quantize_nvfp4_kernel

ec = launch.element_constexprs
block = {"n_rows": "i32", "n_cols": "i32", "n_blocks_row": "i32", "seed_key": "i64"}
cases = [
    (_quantize_element_kernel, {"x_ptr": "*bf16", "y_ptr": "*bf16", "k_ptr": "*i32", "n_elements": "i64", "seed_key": "i64"},
     dict(BLOCK=2048, HAS_SCALE=True, ROUNDING="sr", OVERFLOW_INF=True, TAPERED=True, **ec(HIF8))),
    (_quantize_element_kernel, {"x_ptr": "*fp16", "y_ptr": "*fp16", "k_ptr": "*fp16", "n_elements": "i32", "seed_key": "i32"},
     dict(BLOCK=2048, HAS_SCALE=False, ROUNDING="rne", OVERFLOW_INF=False, TAPERED=False, **ec(E4M3))),
    (_quantize_mx_kernel, {"x_ptr": "*bf16", "y_ptr": "*bf16", **block},
     dict(BLOCK_SIZE=32, BLOCK_B=64, EVEN_COLS=True, SCALE_MODE="rceil", ROUNDING="rne", ELEM_EMAX=8, MANT_SCALE=8.0, TAPERED=False, **ec(E4M3))),
    (_quantize_mx_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", **block},
     dict(BLOCK_SIZE=32, BLOCK_B=64, EVEN_COLS=False, SCALE_MODE="even", ROUNDING="sr", ELEM_EMAX=0, MANT_SCALE=64.0, TAPERED=False, **ec(INT8))),
    (_quantize_mx_kernel, {"x_ptr": "*fp16", "y_ptr": "*fp16", **block},
     dict(BLOCK_SIZE=32, BLOCK_B=64, EVEN_COLS=True, SCALE_MODE="ceil", ROUNDING="ta", ELEM_EMAX=15, MANT_SCALE=4.0, TAPERED=False, **ec(E5M2))),
    (_quantize_nvfp4_kernel, {"x_ptr": "*bf16", "y_ptr": "*bf16", "amax_ptr": "*fp32", "block_amax_ptr": "*bf16", **block},
     dict(BLOCK_SIZE=16, BLOCK_B=128, EVEN_COLS=True, HAS_BLOCK_AMAX=False, ROUNDING="rz", GLOBAL_DIVISOR=2688.0, **ec(E2M1), **ec(E4M3, "S_"), S_MIN_SUBNORMAL=2.0**-9)),
    (_quantize_nvfp4_kernel, {"x_ptr": "*fp16", "y_ptr": "*fp16", "amax_ptr": "*fp32", "block_amax_ptr": "*fp32", **block},
     dict(BLOCK_SIZE=16, BLOCK_B=128, EVEN_COLS=False, HAS_BLOCK_AMAX=True, ROUNDING="sr", GLOBAL_DIVISOR=2688.0, **ec(E2M1), **ec(E4M3, "S_"), S_MIN_SUBNORMAL=2.0**-9)),
]
report = []
for fn, sig, consts in cases:
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})
    ptx = c.asm["ptx"]
    report.append({
        "kernel": fn.__name__, "cubin": len(c.asm["cubin"]),
        "ftz_ops": sorted(set(re.findall(r"\b([a-z]+(?:\.[a-z0-9]+)*\.ftz(?:\.[a-z0-9]+)*)", ptx))),
        "fma": len(re.findall(r"\bfma\.", ptx)),
        "div_rn": len(re.findall(r"\bdiv\.rn\.f32", ptx)),
        "div_other": len(re.findall(r"\bdiv\.(?:full|approx)", ptx)) + len(re.findall(r"\brcp\.approx", ptx)),
        "max_f32": len(re.findall(r"\bmax(?:\.[a-z]+)*\.f32", ptx)),
    })
print(json.dumps(report))
'''


def test_kernels_compile_for_sm90_with_exact_arithmetic() -> None:
    """Compiled for the GPU (Triton's own compiler, no driver): the PTX has only correctly rounded divisions,
    no FMA contraction, and flushes subnormals only in ``floor`` (``cvt.rmi.ftz``), whose input is always
    0 or >= 2**-126 by construction (``round_integer`` runs on ``r = m * 2**k``, k >= -126)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _GPU_COMPILE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report) == 7
    for r in report:
        assert r["cubin"] > 0, r
        assert r["ftz_ops"] in ([], ["cvt.rmi.ftz.f32.f32"]), r
        assert r["fma"] == 0 and r["div_other"] == 0, r
    assert report[5]["div_rn"] > 0 and report[6]["div_rn"] > 0  # NVFP4's g, amax_b / 6 / g, (1 / g) / b
    assert report[2]["div_rn"] > 0  # rceil's amax / max_normal
