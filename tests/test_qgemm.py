"""The fused quantize-on-load GEMM (``fxquant.kernels.qgemm``) and ``fused_quantized_linear``.

- The operands the kernel multiplies are ``TensorQuant.quantize``'s values bit for bit: multiplying by an
  unquantized identity (exact in float32) returns q(A) along K, resp. q(B) along K, for element and MX
  formats, ragged K, transposed (strided) views and bf16 inputs.
- The GEMM equals quantize + float64 matmul within float32 accumulation tolerance.
- ``fused_quantized_linear`` (forward, dgrad, wgrad) equals ``quantized_linear`` with the same LinearQuant,
  with the reference implementation of ``fxquant::quantized_mm`` and with the Triton one routed through it;
  the op passes opcheck and runs under torch.compile bit for bit as eagerly.
Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), tiny sizes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fxquant import schemes
from fxquant.formats.tensor_quant import TensorQuant
from fxquant.qfunctions import fused_linear, quantized_linear
from fxquant.schemes import LinearQuant, Site, SiteKind
from tests.kernel_hooks import launches_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def values(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 9, shape, generator=g).float())
    return x.to(dtype).to(DEVICE)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def lq_of(preset: str) -> LinearQuant:
    return schemes.get(preset).linear_for(Site.from_path("layers.0.mlp.up_proj", SiteKind.FC1))


@pytest.fixture
def qgemm_mod():
    if DEVICE == "cpu":
        from fxquant.kernels import launch

        if not launch.INTERPRETED:
            pytest.skip("fxquant's Triton kernels were imported for a GPU, not for the interpreter")
    from fxquant.kernels import qgemm

    return qgemm


@pytest.fixture
def triton_mm(qgemm_mod):
    """fxquant::quantized_mm through the Triton kernel on this device (CUDA: registered at import). Yields the
    kernel's launches meanwhile (a pre-run hook of the kernel itself)."""
    if DEVICE == "cpu":
        fused_linear.register_triton("cpu")
    try:
        with launches_of(qgemm_mod._qgemm_kernel) as launches:
            yield launches
    finally:
        if DEVICE == "cpu":
            fused_linear.restore_reference("cpu")


FORMATS = [TensorQuant("mxfp8_e4m3"), TensorQuant("mxfp4_e2m1"), TensorQuant("mxfp8_e5m2", scale_mode="rceil"),
           TensorQuant("hifp8"), TensorQuant("fp8_e4m3", rounding="ta"), TensorQuant("mxint8", rounding="rz")]


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
@pytest.mark.parametrize("tq", FORMATS, ids=lambda t: t.spec())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operands_are_the_reference_quantizer_bitwise(qgemm_mod, tq, dtype):
    a = values((40, 72), 1, dtype)  # K = 72: two full 32-blocks and a short one
    eye_k = torch.eye(72, dtype=dtype, device=DEVICE)
    got_a = qgemm_mod.qgemm(a, eye_k, tq, None)
    torch.testing.assert_close(got_a, tq.quantize(a, -1), rtol=0, atol=0)
    bt = values((24, 72), 2, dtype)  # B = bt^T [72, 24], a strided view: quantized along its dim 0
    got_b = qgemm_mod.qgemm(eye_k, bt.t(), None, tq)
    torch.testing.assert_close(got_b, tq.quantize(bt.t(), 0), rtol=0, atol=0)


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
def test_gemm_equals_quantize_then_matmul(qgemm_mod):
    a_tq, b_tq = TensorQuant("mxfp8_e4m3"), TensorQuant("mxfp4_e2m1")
    a, b = values((48, 100), 3), values((100, 40), 4)
    ref = a_tq.quantize(a, -1).double() @ b_tq.quantize(b, 0).double()
    assert rel(qgemm_mod.qgemm(a, b, a_tq, b_tq), ref) <= 1e-6
    with pytest.raises(ValueError, match="nvfp4"):
        qgemm_mod.qgemm(a, b, TensorQuant("nvfp4"), None)
    with pytest.raises(ValueError, match=r"do not fit \[M, K\] @ \[K, N\]"):
        qgemm_mod.qgemm(a, a, None, None)


def linear_grads(fn, x, w, b, dy):
    xs = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    y = fn(*xs)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in xs]


@pytest.mark.parametrize("preset", ["linear_mxfp8", "linear_hifp8", "linear_mxfp4"])
def test_fused_linear_reference_equals_quantized_linear(preset):
    lq = lq_of(preset)
    x, w, b, dy = values((2, 20, 64), 5), values((48, 64), 6), values((48,), 7), values((2, 20, 48), 8)
    got = linear_grads(lambda x, w, b: fused_linear.fused_quantized_linear(x, w, b, lq), x, w, b, dy)
    ref = linear_grads(lambda x, w, b: quantized_linear(x, w, b, lq), x, w, b, dy)
    for name, g, r in zip(("y", "dx", "dw", "db"), got, ref):
        assert rel(g, r) <= 1e-5, f"{name}: {rel(g, r)}"


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
def test_fused_linear_triton_through_the_op_equals_reference(triton_mm):
    lq = lq_of("linear_mxfp8")
    x, w, b, dy = values((40, 64), 9), values((48, 64), 10), values((48,), 11), values((40, 48), 12)
    got = linear_grads(lambda x, w, b: fused_linear.fused_quantized_linear(x, w, b, lq), x, w, b, dy)
    assert len(triton_mm) >= 3, f"the op ran the Triton kernel {len(triton_mm)} times, not for y, dx and dw"
    ref = linear_grads(lambda x, w, b: quantized_linear(x, w, b, lq), x, w, b, dy)
    for name, g, r in zip(("y", "dx", "dw", "db"), got, ref):
        assert rel(g, r) <= 1e-5, f"{name}: {rel(g, r)}"


def test_quantized_mm_op_opcheck_and_compile():
    a, b = values((24, 40), 13).requires_grad_(False), values((40, 16), 14)
    spec = TensorQuant("mxfp8_e4m3").spec()
    torch.library.opcheck(torch.ops.fxquant.quantized_mm.default, (a, b, spec, ""))
    torch.library.opcheck(torch.ops.fxquant.quantized_mm.default, (a, b.t().contiguous().t(), "", spec))
    lq = lq_of("linear_mxfp8")
    x, w, bias, dy = values((40, 64), 15), values((48, 64), 16), values((48,), 17), values((40, 48), 18)
    fn = lambda x, w, b: fused_linear.fused_quantized_linear(x, w, b, lq)  # noqa: E731
    torch._dynamo.reset()
    compiled = linear_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), x, w, bias, dy)
    eager = linear_grads(fn, x, w, bias, dy)
    for g, r in zip(compiled, eager):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot fuse this scheme"):
        fused_linear.fused_quantized_linear(x, w, bias, lq_of("linear_nvfp4"))


@pytest.mark.gpu
@pytest.mark.triton
def test_fused_linear_on_gpu_real_sizes():
    lq = lq_of("linear_mxfp8")
    x, w, b, dy = (values(s, i, torch.bfloat16) for i, s in enumerate([(4096, 2048), (8192, 2048), (8192,), (4096, 8192)]))
    got = linear_grads(lambda x, w, b: fused_linear.fused_quantized_linear(x, w, b, lq), x, w, b, dy)
    ref = linear_grads(lambda x, w, b: quantized_linear(x, w, b, lq), x, w, b, dy)
    for name, g, r in zip(("y", "dx", "dw", "db"), got, ref):
        assert rel(g, r) <= 4e-3, f"{name}: {rel(g, r)}"  # bf16 outputs: one rounding


_SM90_BUILD = r'''
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fxquant.formats.tensor_quant import TensorQuant
from fxquant.kernels import qgemm
from fxquant.kernels.flash_attention_spec import operand_code

mx = operand_code(TensorQuant("mxfp8_e4m3"))
c = dict(A_CODE=mx, B_CODE=mx, BF16=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8)
scalars = ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn")
sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16"} | {n: "i32" for n in scalars} | {k: "constexpr" for k in c}
k = triton.compile(ASTSource(fn=qgemm._qgemm_kernel, signature=sig, constexprs=c), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 8, "num_stages": 3, "enable_fp_fusion": False})
ptx = k.asm["ptx"]
print(json.dumps({"cubin": len(k.asm["cubin"]), "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
                  "local": len(re.findall(r"\b(?:ld|st)\.local", ptx))}))
'''


@pytest.mark.triton
def test_kernel_compiles_for_sm90_with_the_launch_config():
    """The GPU configuration of ``qgemm`` (128x128x64, 8 warps, 3 stages) built for Hopper by Triton's own
    compiler (no driver needed): bf16 wgmma GEMMs, nothing spilled to local memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _SM90_BUILD], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["cubin"] > 0 and r["wgmma"] > 0 and r["local"] == 0, r


@pytest.mark.parametrize("triton_v, numpy_v, refused", [
    ("3.6.0", "2.4.6", True), ("3.6.0+git1b2c3d", "2.4.0rc1", True), ("3.6.0", "2.3.5", False),
    ("3.7.0", "2.4.6", False), ("3.9.0", "2.5.0", False), ("2.3.1", "1.26.4", False),
])
def test_interpreter_loop_problem_names_the_versions_and_the_fix(triton_v, numpy_v, refused):
    from fxquant import kernels

    problem = kernels.interpreter_loop_problem(triton_v, numpy_v)
    if refused:
        assert triton_v in problem and numpy_v in problem and "numpy<2.4 or triton>=3.7" in problem
    else:
        assert problem is None


@pytest.mark.triton
def test_interpreted_launch_refuses_an_incompatible_triton_numpy_pair(qgemm_mod, monkeypatch):
    """Under the interpreter, a GEMM or flash launch with Triton < 3.7 and numpy >= 2.4 raises the reason (Triton
    itself would fail inside the kernel with "only 0-dimensional arrays can be converted to Python scalars")."""
    if DEVICE != "cpu":
        pytest.skip("the check applies to Triton's interpreter (CPU)")
    from fxquant import kernels
    from fxquant.kernels import flash_attention_launch

    fake = {"triton": "3.6.0", "numpy": "2.4.6"}
    monkeypatch.setattr(kernels.importlib.metadata, "version", lambda name: fake[name])
    kernels.check_interpreter_loops.cache_clear()
    try:
        a = values((8, 32), 0)
        with pytest.raises(RuntimeError, match="Triton 3.6.0's interpreter cannot run"):
            qgemm_mod.qgemm(a, a.t(), TensorQuant("mxfp8_e4m3"), None)
        with pytest.raises(RuntimeError, match="install numpy<2.4 or triton>=3.7"):
            flash_attention_launch._check_device(a)
    finally:
        monkeypatch.undo()
        kernels.check_interpreter_loops.cache_clear()
    kernels.check_interpreter_loops()  # the installed pair passes (this suite runs the interpreter)
