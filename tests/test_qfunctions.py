"""fxquant.qfunctions against formulas written out by hand with ``formats.get(...).quantize`` called directly:
quantized_linear (fprop/dgrad/wgrad, block axes), quantized_matmul / bmm / baddbmm, and the quantize calls
each preset makes (counted per GEMM, with the blocked dim)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import fxquant
from fxquant import formats, schemes
from fxquant.formats.tensor_quant import TensorQuant
from fxquant.qfunctions import quantized_baddbmm, quantized_bmm, quantized_linear, quantized_matmul, quantized_sdpa
from fxquant.schemes import GemmQuant, LinearQuant, MatmulQuant, Site, SiteKind

LIN_SITE = Site.from_path("decoder.layers.0.mlp.linear_fc1", num_layers=2)
ATT_SITE = Site("decoder.layers.0.self_attention.core_attention", SiteKind.ATTENTION, 0, 2)


def q(x: torch.Tensor, fmt: str, dim: int, **opts) -> torch.Tensor:
    """The reference quantization, straight from fxquant.formats (not through the custom op)."""
    return formats.get(fmt).quantize(x, dim, **opts)


def spread(*shape: int, seed: int = 0) -> torch.Tensor:
    """Values whose magnitudes vary by 2**±6 element to element: blocking along a wrong axis shows."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 7, shape, generator=g).float())


def run_linear(x, w, b, lq, dy):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = quantized_linear(x, w, b, lq)
    y.backward(dy)
    return y, x.grad, w.grad, b.grad


def test_linear_hifp8_equals_hand_formula() -> None:
    lq = schemes.get("linear_hifp8").linear_for(LIN_SITE)
    x, w, b, dy = spread(3, 5, 16), spread(12, 16, seed=1), torch.randn(12), spread(3, 5, 12, seed=2)
    y, dx, dw, db = run_linear(x, w, b, lq, dy)
    h = lambda t: q(t, "hifp8", -1)  # noqa: E731  element-wise: the axis does not matter
    torch.testing.assert_close(y, F.linear(h(x), h(w)) + b, rtol=1e-6, atol=1e-6)
    assert torch.equal(y, F.linear(h(x), h(w), b))
    dy2, x2 = dy.reshape(-1, 12), x.reshape(-1, 16)
    assert torch.equal(dx, (h(dy2) @ h(w)).reshape(x.shape))
    assert torch.equal(dw, h(dy2).t() @ h(x2))
    assert torch.equal(db, dy2.sum(0))
    assert not torch.equal(dx, (dy2 @ w).reshape(x.shape))  # the quantization did something


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4_e2m1"])
def test_linear_mx_equals_hand_formula_with_block_axes(fmt: str) -> None:
    lq = schemes.get(f"linear_{fmt}").linear_for(LIN_SITE)
    m, k, n = 2 * 40, 64, 96  # M = 80 tokens: two full blocks and a short one along M
    x, w, b, dy = spread(2, 40, k), spread(n, k, seed=1), torch.randn(n), spread(2, 40, n, seed=2)
    y, dx, dw, db = run_linear(x, w, b, lq, dy)
    x2, dy2 = x.reshape(m, k), dy.reshape(m, n)
    assert torch.equal(y, F.linear(q(x, fmt, -1), q(w, fmt, 1), b))  # fprop: X, W along K
    assert torch.equal(dx, (q(dy2, fmt, 1) @ q(w, fmt, 0)).reshape(x.shape))  # dgrad: dY, W along N
    assert torch.equal(dw, q(dy2, fmt, 0).t() @ q(x2, fmt, 0))  # wgrad: dY, X along M
    assert torch.equal(db, dy2.sum(0))
    # the inputs tell the axes apart: blocking any operand along the other axis changes the result
    assert not torch.equal(y, F.linear(q(x, fmt, 0), q(w, fmt, 1), b))
    assert not torch.equal(y, F.linear(q(x, fmt, -1), q(w, fmt, 0), b))
    assert not torch.equal(dx, (q(dy2, fmt, 0) @ q(w, fmt, 0)).reshape(x.shape))
    assert not torch.equal(dx, (q(dy2, fmt, 1) @ q(w, fmt, 1)).reshape(x.shape))
    assert not torch.equal(dw, q(dy2, fmt, 1).t() @ q(x2, fmt, 0))
    assert not torch.equal(dw, q(dy2, fmt, 0).t() @ q(x2, fmt, 1))


def test_linear_and_matmul_under_autocast_run_every_gemm_in_the_autocast_dtype() -> None:
    """Under torch.autocast the forward GEMM casts its quantized operands to bf16 and the backward runs outside
    autocast: the backward GEMMs cast theirs too (they mixed bf16 and float32 and failed), and each gradient
    reaches its float32 input as float32."""
    fmt, bf = "mxfp8", torch.bfloat16
    lq = schemes.get(f"linear_{fmt}").linear_for(LIN_SITE)
    x, w = spread(6, 64).requires_grad_(), spread(32, 64, seed=1).requires_grad_()
    with torch.autocast("cpu", dtype=bf):
        y = quantized_linear(x, w, None, lq)
    dy = spread(6, 32, seed=2).to(bf)
    y.backward(dy)
    assert y.dtype == bf and x.grad.dtype == w.grad.dtype == torch.float32
    assert torch.equal(y, F.linear(q(x.detach(), fmt, -1).to(bf), q(w.detach(), fmt, 1).to(bf)))
    assert torch.equal(x.grad, (q(dy, fmt, 1) @ q(w.detach(), fmt, 0).to(bf)).float())
    assert torch.equal(w.grad, (q(dy, fmt, 0).t() @ q(x.detach(), fmt, 0).to(bf)).float())
    mq = MatmulQuant(*(GemmQuant(TensorQuant(fmt), TensorQuant(fmt)) for _ in range(3)))
    a, b = spread(2, 8, 64).requires_grad_(), spread(64, 32, seed=3).requires_grad_()
    with torch.autocast("cpu", dtype=bf):
        c = quantized_matmul(a, b, mq)
    c.backward(spread(2, 8, 32, seed=4).to(bf))
    assert c.dtype == bf and a.grad.dtype == b.grad.dtype == torch.float32


def test_linear_with_a_vector_weight_is_the_one_row_linear() -> None:
    """F.linear accepts a 1-D weight [K] (the result drops N = 1): quantized as the weight [1, K], compiled too."""
    fmt = "mxfp8"
    lq = schemes.get(f"linear_{fmt}").linear_for(LIN_SITE)
    x, w, b, dy = spread(3, 5, 64), spread(64, seed=1), torch.randn(()), spread(3, 5, seed=2)
    y, dx, dw, db = run_linear(x, w, b, lq, dy)
    y1, dx1, dw1, db1 = run_linear(x, w[None], b.reshape(1), lq, dy[..., None])
    assert y.shape == (3, 5) and dw.shape == (64,) and db.shape == ()
    assert torch.equal(y, y1.squeeze(-1)) and torch.equal(dx, dx1) and torch.equal(dw, dw1[0]) and torch.equal(db, db1[0])
    assert torch.equal(y, F.linear(q(x, fmt, -1), q(w[None], fmt, 1), b.reshape(1)).squeeze(-1))
    with pytest.raises(ValueError, match=r"takes a 0-dim bias \(as F.linear\), got bias \(1,\)"):
        quantized_linear(x, w, b.reshape(1), lq)  # F.linear refuses it too

    class Pool(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.score = torch.nn.Parameter(w.clone())

        def forward(self, h):
            return F.linear(h, self.score)

    torch._dynamo.reset()
    compiled = fxquant.compile(Pool(), "linear_mxfp8", backend="aot_eager", strict=True)
    assert torch.equal(compiled(x).detach(), F.linear(q(x, fmt, -1), q(w[None], fmt, 1)).squeeze(-1))
    assert [s.status.value for s in fxquant.compile_state(compiled).sites()] == ["rewritten"]


def test_linear_operands_quantized_independently_per_gemm() -> None:
    """Each GEMM quantizes from the high-precision tensors: a mixed scheme with a different format per
    operand equals the hand formula with exactly those formats."""
    e4, e5, hi, n4 = (TensorQuant(f) for f in ("mxfp8_e4m3", "mxfp8_e5m2", "hifp8", "nvfp4"))
    lq = LinearQuant(GemmQuant(e4, hi), GemmQuant(e5, None), GemmQuant(None, n4))
    x, w, dy = spread(64, 32), spread(48, 32, seed=1), spread(64, 48, seed=2)
    y, dx, dw, _ = run_linear(x, w, torch.zeros(48), lq, dy)
    assert torch.equal(y, F.linear(q(x, "mxfp8_e4m3", 1), q(w, "hifp8", 1), torch.zeros(48)))
    assert torch.equal(dx, q(dy, "mxfp8_e5m2", 1) @ w)
    assert torch.equal(dw, dy.t() @ q(x, "nvfp4", 0))


def test_linear_without_bias_and_no_grad_inputs() -> None:
    lq = schemes.get("linear_mxfp8").linear_for(LIN_SITE)
    x, w = spread(4, 32), spread(8, 32, seed=1).requires_grad_()
    y = quantized_linear(x, w, None, lq)  # x needs no grad: only wgrad runs
    y.sum().backward()
    assert torch.equal(w.grad, q(torch.ones(4, 8), "mxfp8", 0).t() @ q(x, "mxfp8", 0))
    with pytest.raises(ValueError, match="weight \\[N, K\\]"):
        quantized_linear(x, torch.zeros(8, 31), None, lq)
    with pytest.raises(TypeError, match="lq must be"):
        quantized_linear(x, w, None, "linear_mxfp8")  # type: ignore[arg-type]


# -- matmul ------------------------------------------------------------------------------------------------
def test_matmul_hand_formula_batched_and_broadcast() -> None:
    e4, e5, hi = TensorQuant("mxfp8"), TensorQuant("mxfp8_e5m2"), TensorQuant("hifp8")
    mq = MatmulQuant(GemmQuant(e4, e5), GemmQuant(hi, e4), GemmQuant(e5, e4))
    a = spread(2, 3, 40, 64).requires_grad_()
    b = spread(64, 48, seed=1).requires_grad_()  # broadcast over the batch dims
    dc = spread(2, 3, 40, 48, seed=2)
    c = quantized_matmul(a, b, mq)
    c.backward(dc)
    assert torch.equal(c, q(a, "mxfp8", -1) @ q(b, "mxfp8_e5m2", 0))
    assert torch.equal(a.grad, q(dc, "hifp8", -1) @ q(b, "mxfp8", 1).t())
    db = (q(a, "mxfp8_e5m2", -2).transpose(-2, -1) @ q(dc, "mxfp8", -2)).sum((0, 1))
    torch.testing.assert_close(b.grad, db, rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        quantized_matmul(torch.zeros(4), torch.zeros(4, 2), mq)


@settings(max_examples=12, deadline=None)
@given(
    m=st.integers(1, 40), k=st.integers(1, 70), n=st.integers(1, 40), shift=st.integers(-5, 5),
    fmt=st.sampled_from(["mxfp8", "mxfp6_e3m2", "mxfp4", "mxint8"]), seed=st.integers(0, 2**16),
)
def test_matmul_laws(m: int, k: int, n: int, shift: int, fmt: str, seed: int) -> None:
    """MX: power-of-two scaling commutes with every quantized GEMM (q(2^s x) = 2^s q(x)), and C^T computed as
    B^T @ A^T with ``mq.transposed()`` quantizes the same operands along the same axes."""
    tq = TensorQuant(fmt)
    mq = MatmulQuant(GemmQuant(tq, tq), GemmQuant(tq, None), GemmQuant(None, tq))
    a, b, dc = spread(m, k, seed=seed), spread(k, n, seed=seed + 1), spread(m, n, seed=seed + 2)

    def run(a, b, mq, dc):
        a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
        c = quantized_matmul(a, b, mq)
        c.backward(dc)
        return c, a.grad, b.grad

    c, da, db = run(a, b, mq, dc)
    s = 2.0**shift
    c2, da2, db2 = run(a * s, b, mq, dc * s)
    assert torch.equal(c2, c * s) and torch.equal(da2, da * s) and torch.equal(db2, db * s * s)
    ct, dbt, dat = run(b.t(), a.t(), mq.transposed(), dc.t())
    for got, want in ((ct.t(), c), (dat.t(), da), (dbt.t(), db)):  # fp32 sums in another order: relative to the scale
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))


def test_unquantized_matmul_is_torch_matmul() -> None:
    a, b, dc = spread(3, 8, 33), spread(3, 33, 9, seed=1), spread(3, 8, 9, seed=2)
    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
    quantized_matmul(a1, b1, MatmulQuant()).backward(dc)
    a2, b2 = a.clone().requires_grad_(), b.clone().requires_grad_()
    torch.matmul(a2, b2).backward(dc)
    assert torch.equal(a1.grad, a2.grad) and torch.equal(b1.grad, b2.grad)


def test_baddbmm_and_bmm() -> None:
    mq = schemes.get("FA_QKPV_mxfp8").attention_for(ATT_SITE)
    q_, kt = spread(4, 40, 32).requires_grad_(), spread(4, 32, 40, seed=1).requires_grad_()
    garbage = torch.full((4, 40, 40), float("nan"))
    alpha = 0.125
    s = quantized_baddbmm(garbage, q_, kt, beta=0.0, alpha=alpha, mq=mq.qk)
    assert not s.isnan().any()
    assert torch.equal(s, (q(q_, "mxfp8", -1) @ q(kt, "mxfp8", 1)) * alpha)
    ds = spread(4, 40, 40, seed=3)
    s.backward(ds)
    dc = ds * alpha  # dS of the GEMM's own output
    assert torch.equal(q_.grad, q(dc, "mxfp8", -1) @ q(kt, "mxfp8", -1).transpose(1, 2))
    assert torch.equal(kt.grad, q(q_, "mxfp8", 1).transpose(1, 2) @ q(dc, "mxfp8", 1))
    inp = torch.randn(4, 40, 40)
    s2 = quantized_baddbmm(inp, q_, kt, beta=0.5, alpha=2.0, mq=mq.qk)
    assert torch.equal(s2, inp * 0.5 + (q(q_, "mxfp8", -1) @ q(kt, "mxfp8", 1)) * 2.0)
    p, v = torch.rand(4, 40, 40), spread(4, 40, 16, seed=4)
    assert torch.equal(quantized_bmm(p, v, mq=mq.pv), q(p, "mxfp8", -1) @ q(v, "mxfp8", 1))
    with pytest.raises(ValueError, match="3-D"):
        quantized_bmm(p[0], v[0], mq=mq.pv)


# -- what each preset quantizes, counted at run time --------------------------------------------------------
class QuantizeCalls(TorchDispatchMode):
    """Records (format, dim normalised, shape) of every fxquant::quantize call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.fxquant.quantize.default:
            x, spec, dim = args[0], args[1], args[2]
            self.calls.append((spec.split(":")[0], dim % x.dim(), tuple(x.shape)))
        return func(*args, **(kwargs or {}))


def linear_calls(lq: LinearQuant | None):
    x, w = spread(2, 40, 64).requires_grad_(), spread(96, 64, seed=1).requires_grad_()
    with QuantizeCalls() as rec:
        y = quantized_linear(x, w, None, lq) if lq is not None else F.linear(x, w)
        y.backward(torch.ones_like(y))
    return sorted(rec.calls)


def attention_calls(aq):
    qt, kt, vt = spread(1, 2, 40, 32), spread(1, 2, 40, 32, seed=1), spread(1, 2, 40, 16, seed=2)
    qt, kt, vt = (t.requires_grad_() for t in (qt, kt, vt))
    with QuantizeCalls() as rec:
        o = quantized_sdpa(qt, kt, vt, is_causal=True, aq=aq) if aq is not None else F.scaled_dot_product_attention(qt, kt, vt)
        o.backward(torch.ones_like(o))
    return sorted(rec.calls)


@pytest.mark.parametrize("x", ["mxfp8", "hifp8", "nvfp4"])
def test_each_preset_runs_exactly_its_quantize_calls(x: str) -> None:
    f = TensorQuant(x).format
    # linear: x [2,40,64] (M=80, K=64), W [96,64], dY [80,96]
    lin = sorted([(f, 2, (2, 40, 64)), (f, 1, (96, 64)),  # fprop: X, W along K
                  (f, 1, (80, 96)), (f, 0, (96, 64)),  # dgrad: dY, W along N
                  (f, 0, (80, 96)), (f, 0, (80, 64))])  # wgrad: dY, X along M
    # attention: Q, K [1,2,40,32] (d = 32), V [1,2,40,16]; K^T is [1,2,32,40]; S, P [1,2,40,40]
    qk = [(f, 3, (1, 2, 40, 32)), (f, 2, (1, 2, 32, 40)),  # S = Q K^T: along d
          (f, 3, (1, 2, 40, 40)), (f, 3, (1, 2, 32, 40)),  # dQ = dS K: along Lk
          (f, 2, (1, 2, 40, 32)), (f, 2, (1, 2, 40, 40))]  # dK = dS^T Q: along Lq
    pv = [(f, 3, (1, 2, 40, 40)), (f, 2, (1, 2, 40, 16)),  # O = P V: along Lk
          (f, 3, (1, 2, 40, 16)), (f, 3, (1, 2, 40, 16)),  # dP = dO V^T: along d
          (f, 2, (1, 2, 40, 40)), (f, 2, (1, 2, 40, 16))]  # dV = P^T dO: along Lq
    expect = {
        "bf16": ([], []),
        f"linear_{x}": (lin, []),
        f"FA_{x}": ([], sorted(qk)),
        f"FA_QK_{x}": ([], sorted(qk)),
        f"FA_PV_{x}": ([], sorted(pv)),
        f"FA_QKPV_{x}": ([], sorted(qk + pv)),
        f"FA_linear_{x}": (lin, sorted(qk)),
    }
    for name, (lin_exp, att_exp) in expect.items():
        s = schemes.get(name)
        assert linear_calls(s.linear_for(LIN_SITE)) == lin_exp, name
        assert attention_calls(s.attention_for(ATT_SITE)) == att_exp, name


def test_legacy_preset_runs_forward_gemms_and_dgrad_dy_only() -> None:
    s = schemes.get("legacy_FA_linear_mxfp4")
    assert linear_calls(s.linear_for(LIN_SITE)) == sorted(
        [("mxfp4_e2m1", 2, (2, 40, 64)), ("mxfp4_e2m1", 1, (96, 64)), ("mxfp8_e5m2", 1, (80, 96))]
    )
    assert attention_calls(s.attention_for(ATT_SITE)) == sorted(
        [("mxfp8_e5m2", 3, (1, 2, 40, 32)), ("mxfp8_e5m2", 2, (1, 2, 32, 40)),
         ("mxfp4_e2m1", 3, (1, 2, 40, 40)), ("mxfp4_e2m1", 2, (1, 2, 40, 16))]
    )


def test_empty_token_dimension() -> None:
    """Zero tokens (M = 0): blocks along M are empty; every GEMM still runs and gives empty / zero grads."""
    lq = schemes.get("linear_mxfp8").linear_for(LIN_SITE)
    x, w = torch.zeros(0, 32, requires_grad=True), spread(8, 32).requires_grad_()
    y = quantized_linear(x, w, None, lq)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 32) and torch.equal(w.grad, torch.zeros(8, 32))


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 70), k=st.integers(1, 40), n=st.integers(1, 40), seed=st.integers(0, 2**16),
       fmt=st.sampled_from(["mxfp8", "nvfp4", "hifp8", "mxfp6_e2m3"]))
def test_linear_is_matmul_with_as_matmul(m: int, k: int, n: int, seed: int, fmt: str) -> None:
    """``quantized_linear(x, w, b, lq)`` == ``quantized_matmul(x, w^T, lq.as_matmul()) + b``: the two autograd
    Functions agree on which operand is blocked along which axis, short blocks included."""
    tq = TensorQuant(fmt)
    lq = LinearQuant(GemmQuant(tq, None), GemmQuant(None, tq), GemmQuant(tq, tq))
    x, w, dy = spread(m, k, seed=seed), spread(n, k, seed=seed + 1), spread(m, n, seed=seed + 2)
    y1, dx1, dw1, _ = run_linear(x, w, torch.zeros(n), lq, dy)
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y2 = quantized_matmul(x2, w2.t(), lq.as_matmul())
    y2.backward(dy)
    for got, want in ((y1, y2), (dx1, x2.grad), (dw1, w2.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))
