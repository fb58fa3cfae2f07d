"""The torch reference of the quantized flash-attention kernel (``fxquant.qfunctions.flash_reference``).

With nothing quantized it equals ``F.scaled_dot_product_attention`` (outputs and gradients; causal, GQA,
ragged lengths, dv != d, scale). With quantization its semantics (docs/flash_attention.md) are checked
against formulas written out by hand: the forward's unnormalised P~ quantized per BLOCK_N key tile with an
independent MXFP4 quantizer (a grid search, not fxquant.formats), and the backward's operands on whole
matrices computed in float64. Bad arguments raise ValueError/TypeError naming what is allowed.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fxquant.formats.tensor_quant import TensorQuant
from fxquant.kernels.flash_attention import FlashBlocks, flash_quantized_attention
from fxquant.qfunctions.flash_reference import flash_attention_reference
from fxquant.schemes import AttentionQuant, GemmQuant, MatmulQuant
from fxquant.schemes.presets import _all as all_gemms

REF = dict(impl="reference")


def make(shape, seed, dtype=torch.float32, spread=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-spread, spread + 1, shape, generator=g).float())
    return x.to(dtype)


def grads(fn, q, k, v, do, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v, **kw)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "causal,shape,scale,block_n",
    [
        (False, (2, 4, 2, 40, 50, 16, 16), None, 32),
        (True, (1, 2, 2, 70, 70, 32, 16), 0.3, 64),
        (True, (1, 3, 1, 33, 97, 24, 40), None, 32),  # Lq < Lk: SDPA's causal mask is top-left aligned
        (False, (2, 2, 1, 65, 17, 8, 8), 1.7, 16),
    ],
)
def test_unquantized_reference_equals_torch_sdpa(causal, shape, scale, block_n) -> None:
    b, hq, hk, lq, lk, d, dv = shape
    q, k, v, do = make((b, hq, lq, d), 1), make((b, hk, lk, d), 2), make((b, hk, lk, dv), 3), make((b, hq, lq, dv), 4)
    ours = grads(flash_quantized_attention, q, k, v, do, is_causal=causal, scale=scale, aq=AttentionQuant(),
                 blocks=FlashBlocks(block_n=block_n), **REF)
    theirs = grads(F.scaled_dot_product_attention, q, k, v, do, is_causal=causal, scale=scale, enable_gqa=hq != hk)
    for name, a, ref in zip(("o", "dq", "dk", "dv"), ours, theirs):
        assert torch.isfinite(a).all(), name
        assert rel(a, ref) < 1e-5, (name, rel(a, ref))


def test_unquantized_reference_bf16_rounds_p_like_sdpa_math() -> None:
    """bf16 inputs: P is rounded to bf16 before PV, as SDPA's math path does; the result agrees with SDPA
    computed in float64 to bf16 accuracy and the gradients to a few bf16 ulps."""
    q, k, v, do = (make(s, i, torch.bfloat16) for i, s in enumerate([(1, 2, 48, 32), (1, 2, 80, 32), (1, 2, 80, 32), (1, 2, 48, 32)]))
    ours = grads(flash_quantized_attention, q, k, v, do, is_causal=True, aq=AttentionQuant(), **REF)
    exact = grads(F.scaled_dot_product_attention, q.double(), k.double(), v.double(), do.double(), is_causal=True)
    for name, a, ref in zip(("o", "dq", "dk", "dv"), ours, exact):
        assert a.dtype == torch.bfloat16
        assert rel(a, ref) < 1.5e-2, (name, rel(a, ref))


# -- the forward's semantics, written out by hand --------------------------------------------------------
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def mxfp4_by_hand(x: torch.Tensor) -> torch.Tensor:
    """MXFP4 (floor scale, RNE) of a float64 row tensor along its last dim in 32-blocks, by grid search:
    X = 2**(floor(log2 amax) - 2), nearest E2M1 magnitude of |x| / X (ties to the even code, i.e. the
    lower index when its code is even), saturating at 6."""
    out = torch.empty_like(x)
    for idx in range(0, x.shape[-1], 32):
        blk = x[..., idx : idx + 32]
        amax = blk.abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(torch.where(amax > 0, amax, 1.0))) - 2), 1.0)
        a = (blk.abs() / scale).clamp(max=6.0)
        dist = (a[..., None] - E2M1_GRID).abs()
        best = dist.min(-1, keepdim=True).values
        cand = dist == best
        # among equally near grid points prefer the even code (index), E2M1's codes are the indices
        even = cand & (torch.arange(8) % 2 == 0)
        choice = torch.where(even.any(-1, keepdim=True), even, cand).to(torch.int64).argmax(-1)
        out[..., idx : idx + 32] = torch.sign(blk) * E2M1_GRID[choice] * scale
    return out


def test_forward_quantizes_unnormalised_p_per_key_tile() -> None:
    """Two key tiles of 32: O = (a q(P0) V0 + q(P1) V1) / (a l0 + l1) with P0 = exp(S0 - m0), P1 = exp(S1 - m1),
    m1 = max(m0, rowmax S1), a = exp(m0 - m1), l = rowsums of the unquantized P~, q = MXFP4 along Lk."""
    lq, lk, d = 5, 64, 8
    q, k, v = make((1, 1, lq, d), 11), make((1, 1, lk, d), 12), make((1, 1, lk, d), 13)
    tq = TensorQuant("mxfp4_e2m1")
    aq = AttentionQuant(pv=MatmulQuant(forward=GemmQuant(tq, None)))
    o = flash_quantized_attention(q, k, v, aq=aq, blocks=FlashBlocks(block_n=32), **REF)

    s = (q.double() @ k.double().transpose(-2, -1))[0, 0] / math.sqrt(d)
    s0, s1 = s[:, :32], s[:, 32:]
    m0 = s0.amax(-1, keepdim=True)
    m1 = torch.maximum(m0, s1.amax(-1, keepdim=True))
    p0, p1 = torch.exp(s0 - m0), torch.exp(s1 - m1)
    a = torch.exp(m0 - m1)
    v64 = v.double()[0, 0]
    expect = (a * (mxfp4_by_hand(p0) @ v64[:32]) + mxfp4_by_hand(p1) @ v64[32:]) / (a * p0.sum(-1, keepdim=True) + p1.sum(-1, keepdim=True))
    assert rel(o[0, 0], expect) < 1e-6
    # The tile size is part of the semantics: one tile of 64 quantizes P~ = exp(S - rowmax S) instead.
    one_tile = flash_quantized_attention(q, k, v, aq=aq, blocks=FlashBlocks(block_n=64), **REF)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    assert rel(one_tile[0, 0], (mxfp4_by_hand(p) @ v64) / p.sum(-1, keepdim=True)) < 1e-6
    assert rel(one_tile, o) > 1e-4


def test_backward_operands_on_whole_matrices() -> None:
    """Every backward GEMM operand quantized (mxfp8 along its GEMM's reduction axis, hifp8 for dS), checked
    against float64 whole-matrix formulas: P = softmax(S), dP = q(dO) q(V)^T, dS = scale P (dP - rowsum(dO O)),
    dV = q(P, Lq)^T q(dO, Lq), dK = q(dS, Lq)^T q(Q, Lq), dQ = q(dS, Lk) q(K, Lk)."""
    lq, lk, d, scale = 64, 40, 16, 0.37
    # Unit-variance inputs keep every probability well below 1: the floor scale of a block whose amax sits
    # on a power of two (P = 1.0 in float32 vs 0.9999993 in float64) would flip between the two precisions.
    q, k, v, do = (make(s, i, spread=0) for i, s in enumerate([(1, 1, lq, d), (1, 1, lk, d), (1, 1, lk, d), (1, 1, lq, d)], 21))
    mx, hf = TensorQuant("mxfp8_e4m3"), TensorQuant("hifp8")
    aq = AttentionQuant(
        qk=MatmulQuant(grad_a=GemmQuant(hf, mx), grad_b=GemmQuant(mx, hf)),
        pv=MatmulQuant(grad_a=GemmQuant(mx, mx), grad_b=GemmQuant(mx, mx)),
    )
    o, dq, dk, dv = grads(flash_quantized_attention, q, k, v, do, scale=scale, aq=aq, **REF)

    def qz(tq, x, dim):
        return tq.quantize(x.float(), dim).double()

    q2, k2, v2, do2 = (t[0, 0].double() for t in (q, k, v, do))
    p = torch.softmax(q2 @ k2.T * scale, -1)
    dp = qz(mx, do2, -1) @ qz(mx, v2, -1).T
    ds = scale * p * (dp - (do2 * o[0, 0].double()).sum(-1, keepdim=True))
    assert rel(dv[0, 0], qz(mx, p, -2).T @ qz(mx, do2, -2)) < 1e-5
    assert rel(dk[0, 0], qz(hf, ds, -2).T @ qz(mx, q2, -2)) < 1e-5
    assert rel(dq[0, 0], qz(hf, ds, -1) @ qz(mx, k2, -2)) < 1e-5


# -- refusals --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tq,match",
    [
        (TensorQuant("mxfp8", rounding="sr"), "stochastic"),
        (TensorQuant("nvfp4"), "NVFP4"),
        (TensorQuant("fp8_e4m3", scaling="tensor"), "scaling='tensor'"),
    ],
)
def test_unsupported_quantization_is_refused(tq, match) -> None:
    q = make((1, 1, 8, 16), 0)
    aq = AttentionQuant(pv=MatmulQuant(grad_b=GemmQuant(tq, None)))
    with pytest.raises(ValueError, match=match) as err:
        flash_attention_reference(q, q, q, aq=aq)
    assert "dv.p" in str(err.value)


def test_bad_arguments_are_refused() -> None:
    q = make((1, 2, 8, 16), 0)
    mx = AttentionQuant(pv=all_gemms(TensorQuant("mxfp8")))
    with pytest.raises(ValueError, match="multiple of 32"):
        flash_attention_reference(q, q, q, aq=mx, blocks=FlashBlocks(block_n=16))
    with pytest.raises(ValueError, match="power of two"):
        FlashBlocks(block_m=48)
    for bad in (dict(fwd_warps=3), dict(bwd_warps=32), dict(fwd_warps=-4), dict(bwd_stages=0), dict(fwd_stages=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            FlashBlocks(**bad)
    with pytest.raises(ValueError, match="4-D"):
        flash_attention_reference(q[0], q[0], q[0], aq=mx)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        flash_attention_reference(make((1, 3, 8, 16), 0), q, q, aq=mx)
    with pytest.raises(ValueError, match=r"has no query heads \(\[B, Hq, Lq, d\] needs Hq >= 1"):
        flash_attention_reference(make((1, 0, 8, 16), 0), q, q, aq=mx)  # its backward gave dK of 0 heads
    empty_d = make((1, 2, 8, 0), 0)
    with pytest.raises(ValueError, match="has no head dim"):
        flash_quantized_attention(empty_d, empty_d, empty_d, aq=mx)  # the default scale divided by sqrt(0)
    with pytest.raises(TypeError, match="AttentionQuant"):
        flash_attention_reference(q, q, q, aq="FA_mxfp8")
    with pytest.raises(ValueError, match="impl="):
        flash_quantized_attention(q, q, q, aq=mx, impl="cuda")
    with pytest.raises(ValueError, match="scale="):
        flash_attention_reference(q, q, q, aq=mx, scale=float("nan"))


def test_launch_settings_follow_the_tile_rule_unless_given() -> None:
    """0 warps: 4 for tiles of at most 64 x 64, else 8, whatever the head dimension; given warps and stages pass
    through."""
    b = FlashBlocks()
    assert (b.bwd_m, b.bwd_n) == (64, 32)
    assert b.launch(False) == dict(num_warps=4, num_stages=2)
    assert b.launch(True) == dict(num_warps=4, num_stages=2)
    assert FlashBlocks(block_m=128).launch(False)["num_warps"] == 8
    assert FlashBlocks(bwd_m=128).launch(False)["num_warps"] == 4  # the forward's tiles decide the forward
    assert FlashBlocks(bwd_m=128).launch(True)["num_warps"] == 4  # 128 x 32: no larger than 64 x 64
    assert FlashBlocks(bwd_m=128, bwd_n=64).launch(True)["num_warps"] == 8
    tuned = FlashBlocks(fwd_warps=2, bwd_warps=16, fwd_stages=3, bwd_stages=1)
    assert tuned.launch(False) == dict(num_warps=2, num_stages=3)
    assert tuned.launch(True) == dict(num_warps=16, num_stages=1)
