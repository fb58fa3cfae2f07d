"""fxquant.compile with Inductor (the default backend): a few end-to-end cases (ARCHITECTURE.md trap 11).

Per site, Inductor's code equals the eager run of the same quantized functions bit for bit (the quantize op
and the GEMMs are the same kernels; SDPA's softmax included). Bias gradients are sums whose order Inductor
chooses, and in a whole model Inductor's own RMSNorm / RoPE / softmax kernels round differently from
ATen's (as they do under plain torch.compile): there the comparison is to a tolerance.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxquant
from tests.models import make_llama, make_tokens
from tests.test_compile import compiled_step

pytestmark = pytest.mark.slow


class OneLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 96)

    def forward(self, x):
        return self.fc1(x)


class OneAttention(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _run(module, backend, scheme, *inputs, **options):
    torch._dynamo.reset()
    module.zero_grad(set_to_none=True)
    compiled = fxquant.compile(module, scheme, backend=backend, strict=True, **options)
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = compiled(*xs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.device))
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    return out.detach(), [x.grad for x in xs], grads, fxquant.compile_state(compiled).kernels()


def test_inductor_linear_site_is_bitwise_equal_to_eager():
    torch.manual_seed(0)
    module, x = OneLinear(), torch.randn(4, 8, 64)
    ref, got = _run(module, "eager", "linear_mxfp8", x), _run(module, "inductor", "linear_mxfp8", x)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1][0], ref[1][0], rtol=0, atol=0)  # dgrad
    torch.testing.assert_close(got[2]["fc1.weight"], ref[2]["fc1.weight"], rtol=0, atol=0)  # wgrad
    torch.testing.assert_close(got[2]["fc1.bias"], ref[2]["fc1.bias"], rtol=1e-5, atol=1e-5)  # a sum: order differs


@pytest.mark.parametrize("scheme, tol", [("FA_QKPV_mxfp8", 0.0), ("FA_mxfp8", 1e-6), ("FA_PV_mxfp8", 1e-6)])
def test_inductor_sdpa_site_equals_eager(scheme, tol):
    """Bit for bit where both attention GEMMs quantize every operand (FA_QKPV: the roundings take the softmax's
    last bits, forward and backward); where an operand stays in high precision, Inductor's softmax and its
    backward round their last bits differently from ATen's, as under plain torch.compile (docs/compile.md
    "Known limits")."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 40, 32, generator=g), torch.randn(2, 2, 40, 32, generator=g), torch.randn(2, 2, 40, 32, generator=g)
    ref = _run(OneAttention(), "eager", scheme, q, k, v)
    got = _run(OneAttention(), "inductor", scheme, q, k, v)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=tol)
    for a, b in zip(got[1], ref[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=tol)


def test_inductor_llama_matches_eager_reference():
    tokens = [make_tokens(make_llama().cfg)]
    (ref,), _ = compiled_step("FA_linear_mxfp8", "eager", tokens)
    torch._dynamo.reset()
    (got,), model = compiled_step("FA_linear_mxfp8", "inductor", tokens)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-4)  # loss
    torch.testing.assert_close(got[0], ref[0], rtol=1e-3, atol=1e-3)  # logits
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], rtol=0.05, atol=2e-3, msg=lambda m: f"{name}: {m}")
    assert all(s.status.value == "rewritten" for s in fxquant.compile_state(model).sites() if s.selected)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["linear_mxfp8", "linear_hifp8", "linear_mxfp4", "linear_nvfp4"])
def test_cuda_linear_site_same_bits_with_every_quantize_implementation(scheme):
    """On CUDA, the Triton kernels and Inductor's lowering (Triton code generation) give the reference op's
    forward, dgrad and wgrad bit for bit; the eager rewritten graph agrees to float32 GEMM rounding (cuBLAS
    may pick another algorithm for another operand layout). "auto" lowers every format but NVFP4, whose
    lowering is not exact on CUDA: there it runs the Triton kernels, and "inductor" is refused."""
    from fxquant.lowering import Kernels

    torch.manual_seed(0)
    module, x = OneLinear().cuda(), torch.randn(4, 8, 64, device="cuda")
    ref = _run(module, "inductor", scheme, x, kernels="reference")
    lowered = scheme != "linear_nvfp4"
    for kernels in ("triton", "auto") + (("inductor",) if lowered else ()):
        got = _run(module, "inductor", scheme, x, kernels=kernels)
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0, msg=lambda m: f"{kernels} out: {m}")
        torch.testing.assert_close(got[1][0], ref[1][0], rtol=0, atol=0, msg=lambda m: f"{kernels} dgrad: {m}")
        torch.testing.assert_close(got[2]["fc1.weight"], ref[2]["fc1.weight"], rtol=0, atol=0,
                                   msg=lambda m: f"{kernels} wgrad: {m}")
        if kernels == "auto":
            assert got[3] == [Kernels.INDUCTOR if lowered else Kernels.TRITON]
    if not lowered:
        with pytest.raises(ValueError, match="does not reproduce the reference bit for bit for nvfp4"):
            _run(module, "inductor", scheme, x, kernels="inductor")
    eager = _run(module, "eager", scheme, x, kernels="reference")
    torch.testing.assert_close(eager[0], ref[0])
    torch.testing.assert_close(eager[1][0], ref[1][0])
    torch.testing.assert_close(eager[2]["fc1.weight"], ref[2]["fc1.weight"])


@pytest.mark.gpu
def test_cuda_math_sdpa_site_same_bits_with_every_quantize_implementation():
    """quantized_sdpa on CUDA under Inductor: the Triton kernels and the lowering give the reference op's bits."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, 40, 32, generator=g).cuda() for h in (4, 2, 2))
    ref = _run(OneAttention(), "inductor", "FA_QKPV_mxfp8", q, k, v, kernels="reference", attention="math")
    for kernels in ("triton", "inductor"):
        got = _run(OneAttention(), "inductor", "FA_QKPV_mxfp8", q, k, v, kernels=kernels, attention="math")
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0, msg=lambda m: f"{kernels} out: {m}")
        for name, a, b in zip("qkv", got[1], ref[1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{kernels} d{name}: {m}")
