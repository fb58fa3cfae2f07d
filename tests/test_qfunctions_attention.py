"""quantized_sdpa: equals F.scaled_dot_product_attention with nothing quantized, and a hand-written
quantized formula (each GEMM operand blocked per FORMATS.md) with an MX scheme, incl. GQA, causal and
bool/additive masks, scale and dropout; torch.compile (aot_eager, inductor) equals eager bit for bit."""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from fxquant import formats, schemes
from fxquant.formats.tensor_quant import TensorQuant
from fxquant.qfunctions import quantized_baddbmm, quantized_bmm, quantized_linear, quantized_sdpa
from fxquant.schemes import AttentionQuant, GemmQuant, MatmulQuant, Site, SiteKind

ATT_SITE = Site("layers.0.attn", SiteKind.ATTENTION, 0, 1)
B, HQ, HK, LQ, LK, D, DV = 2, 4, 2, 40, 36, 32, 16


def q(x, fmt, dim):
    return x if fmt is None else formats.get(fmt).quantize(x, dim)


def inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(s, generator=g) * torch.exp2(torch.randint(-3, 4, s, generator=g).float())).to(dtype)  # noqa: E731
    return mk(B, HQ, LQ, D), mk(B, HK, LK, D), mk(B, HK, LK, DV), mk(B, HQ, LQ, DV)


def run(fn, qt, kt, vt, do, **kw):
    qt, kt, vt = (t.clone().requires_grad_() for t in (qt, kt, vt))
    o = fn(qt, kt, vt, **kw)
    o.backward(do)
    return o, qt.grad, kt.grad, vt.grad


MASKS = {
    "none": {},
    "causal": {"is_causal": True},
    "bool": {"attn_mask": torch.rand(LQ, LK, generator=torch.Generator().manual_seed(5)) > 0.3},
    "additive": {"attn_mask": torch.randn(B, 1, LQ, LK, generator=torch.Generator().manual_seed(6))},
}


@pytest.mark.parametrize("mask", list(MASKS))
def test_unquantized_equals_torch_sdpa(mask: str) -> None:
    qt, kt, vt, do = inputs()
    kw = dict(MASKS[mask], enable_gqa=True, scale=0.3 if mask == "bool" else None)
    ours = run(quantized_sdpa, qt, kt, vt, do, aq=AttentionQuant(), **kw)
    ref = run(F.scaled_dot_product_attention, qt, kt, vt, do, **kw)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mask", ["bool", "additive"])
def test_attn_mask_and_is_causal_both_apply(mask: str) -> None:
    """Both given: the mask and the causal mask apply (torch's CPU SDPA does so; its math backend refuses), as
    one combined mask given to SDPA."""
    qt, kt, vt, do = inputs()
    m = MASKS[mask]["attn_mask"]
    causal = torch.ones(LQ, LK, dtype=torch.bool).tril()
    combined = m & causal if mask == "bool" else m + torch.zeros(LQ, LK).masked_fill(~causal, float("-inf"))
    ours = run(quantized_sdpa, qt, kt, vt, do, aq=AttentionQuant(), attn_mask=m, is_causal=True, enable_gqa=True)
    ref = run(F.scaled_dot_product_attention, qt, kt, vt, do, attn_mask=combined, enable_gqa=True)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_fully_masked_rows_give_zero_like_sdpa() -> None:
    qt, kt, vt, do = inputs()
    mask = torch.ones(LQ, LK, dtype=torch.bool)
    mask[3] = False
    ours = run(quantized_sdpa, qt, kt, vt, do, aq=AttentionQuant(), attn_mask=mask, enable_gqa=True)
    ref = run(F.scaled_dot_product_attention, qt, kt, vt, do, attn_mask=mask, enable_gqa=True)
    assert torch.isfinite(ours[0]).all() and torch.isfinite(ours[1]).all()
    assert (ours[0][:, :, 3] == 0).all()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def hand_attention(qt, kt, vt, do, fmts, *, mask_kw, scale=None, dropout_p=0.0, seed=None):
    """The quantized attention written out: fmts names the format of every operand of the six GEMMs."""
    rep = HQ // HK
    k_r, v_r = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
    scale = 1 / math.sqrt(D) if scale is None else scale
    f32 = lambda t: t.to(torch.promote_types(t.dtype, torch.float32))  # noqa: E731
    # Q, K quantized in their own dtype, the scores' GEMMs in float32 (at least)
    s = f32(q(qt, fmts["qk.q"], -1)) @ f32(q(k_r, fmts["qk.k"], -1)).transpose(-2, -1)  # Q, K along d
    s_leaf = s.detach().requires_grad_()
    z = s_leaf * scale
    if mask_kw.get("is_causal"):
        z = z.masked_fill(~torch.ones(LQ, LK, dtype=torch.bool).tril(), float("-inf"))
    m = mask_kw.get("attn_mask")
    if m is not None:
        z = z.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else z + m
    p = torch.softmax(z, -1).to(qt.dtype)
    if dropout_p:
        torch.manual_seed(seed)
        keep = torch.empty_like(p).bernoulli_(1 - dropout_p)
        p = p * keep / (1 - dropout_p)
    o = q(p, fmts["pv.p"], -1) @ q(v_r, fmts["pv.v"], -2)  # P, V along Lk
    dp = q(do, fmts["dp.do"], -1) @ q(v_r, fmts["dp.v"], -1).transpose(-2, -1)  # dO, V along d
    dv_r = q(p, fmts["dv.p"], -2).transpose(-2, -1) @ q(do, fmts["dv.do"], -2)  # P, dO along Lq
    (ds,) = torch.autograd.grad(p, s_leaf, dp)  # softmax/mask/dropout by torch's autograd
    dq = (q(ds, fmts["dq.ds"], -1) @ f32(q(k_r, fmts["dq.k"], -2))).to(qt.dtype)  # dS (float32), K along Lk
    dk_r = (q(ds, fmts["dk.ds"], -2).transpose(-2, -1) @ f32(q(qt, fmts["dk.q"], -2))).to(qt.dtype)  # dS, Q along Lq
    fold = lambda t: t.reshape(B, HK, rep, *t.shape[2:]).sum(2)  # noqa: E731  GQA: the heads' grads sum back
    return o, dq, fold(dk_r), fold(dv_r)


OPERANDS = ["qk.q", "qk.k", "dq.ds", "dq.k", "dk.ds", "dk.q", "pv.p", "pv.v", "dp.do", "dp.v", "dv.p", "dv.do"]


def aq_from(fmts):
    g = lambda a, b: GemmQuant(*(None if fmts[n] is None else TensorQuant(fmts[n]) for n in (a, b)))  # noqa: E731
    return AttentionQuant(
        qk=MatmulQuant(g("qk.q", "qk.k"), g("dq.ds", "dq.k"), g("dk.q", "dk.ds")),
        pv=MatmulQuant(g("pv.p", "pv.v"), g("dp.do", "dp.v"), g("dv.p", "dv.do")),
    )


@pytest.mark.parametrize("mask", list(MASKS))
def test_mx_scheme_equals_hand_formula(mask: str) -> None:
    qt, kt, vt, do = inputs(seed=1)
    fmts = dict.fromkeys(OPERANDS, "mxfp8")
    aq = schemes.get("FA_QKPV_mxfp8").attention_for(ATT_SITE)
    assert aq == aq_from(fmts)
    ours = run(quantized_sdpa, qt, kt, vt, do, aq=aq, enable_gqa=True, **MASKS[mask])
    ref = hand_attention(qt, kt, vt, do, fmts, mask_kw=MASKS[mask])
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    unq = run(quantized_sdpa, qt, kt, vt, do, aq=AttentionQuant(), enable_gqa=True, **MASKS[mask])
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(ours, unq))  # quantization made a difference


def test_mixed_formats_per_operand_and_dropout() -> None:
    """A different format on every operand (a swapped operand or axis would show), with dropout: the same
    mask in the forward and the backward, drawn once from torch's default generator."""
    fmts = dict(zip(OPERANDS, ["mxfp8", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp4", "mxint8", "mxfp6_e2m3",
                               "mxfp8_e5m2", "mxfp4", "mxfp8", "mxint8", "mxfp6_e3m2", "mxfp8_e5m2"]))
    qt, kt, vt, do = inputs(seed=2)
    torch.manual_seed(123)
    ours = run(quantized_sdpa, qt, kt, vt, do, aq=aq_from(fmts), dropout_p=0.25, scale=0.2, enable_gqa=True)
    ref = hand_attention(qt, kt, vt, do, fmts, mask_kw={}, scale=0.2, dropout_p=0.25, seed=123)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    torch.manual_seed(123)
    again = run(quantized_sdpa, qt, kt, vt, do, aq=aq_from(fmts), dropout_p=0.25, scale=0.2, enable_gqa=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, again))


@pytest.mark.parametrize("fmt", ["hifp8", "nvfp4"])  # NVFP4's values are not all bf16 values: rounded back to bf16
def test_bf16_inputs_compute_softmax_in_float32(fmt: str) -> None:
    qt, kt, vt, do = inputs(seed=3, dtype=torch.bfloat16)
    o, dq, dk, dv = run(quantized_sdpa, qt, kt, vt, do, aq=aq_from(
        dict.fromkeys(OPERANDS, None) | {k: fmt for k in OPERANDS if k.startswith(("qk", "dq", "dk"))}),
        enable_gqa=True, is_causal=True)
    assert o.dtype == dq.dtype == torch.bfloat16
    fmts = dict.fromkeys(OPERANDS, None) | {k: fmt for k in OPERANDS if k.startswith(("qk", "dq", "dk"))}
    ref = hand_attention(qt, kt, vt, do, fmts, mask_kw={"is_causal": True})
    for a, b in zip((o, dq, dk, dv), ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("aq_name", ["bf16", "FA_QK_mxfp8"])
def test_fp16_scores_beyond_the_fp16_range_stay_finite(aq_name: str) -> None:
    """fp16 q.k products above 65504 (d = 128, large activations) are finite scores once scaled: the scores' GEMM
    runs in float32 (an fp16 GEMM output was Inf before the scale, and the softmax NaN: 2048 of 4096 outputs),
    as torch's SDPA and the flash path stay finite; Megatron's baddbmm with alpha likewise."""
    from fxquant.qfunctions.matmul import quantized_baddbmm

    g = torch.Generator().manual_seed(0)
    qt, noise, vt = (torch.randn(1, 2, 16, 128, generator=g) * 30 for _ in range(3))
    qt, kt, vt = (t.to(torch.float16) for t in (qt, qt + noise / 6, vt))  # keys aligned with the queries
    assert (qt.double() @ kt.double().transpose(-2, -1)).abs().max() > 65504
    aq = AttentionQuant() if aq_name == "bf16" else schemes.get(aq_name).attention_for(ATT_SITE)
    o = quantized_sdpa(qt, kt, vt, aq=aq)
    want = torch.nn.functional.scaled_dot_product_attention(qt.double(), kt.double(), vt.double())
    assert torch.isfinite(o).all() and o.dtype == torch.float16
    if aq_name == "bf16":
        torch.testing.assert_close(o.double(), want, rtol=0, atol=0.05)  # fp16 output rounding (values up to ~100)
    b1, b2 = qt.reshape(2, 16, 128), kt.reshape(2, 16, 128).transpose(1, 2)
    scores = quantized_baddbmm(torch.empty(2, 16, 16, dtype=torch.float16), b1, b2, beta=0.0, alpha=128 ** -0.5,
                               mq=aq.qk)
    assert torch.isfinite(scores).all() and scores.dtype == torch.float16
    if aq_name == "bf16":  # one rounding of the float32 product times alpha, as torch.baddbmm
        assert torch.equal(scores, (b1.float() @ b2.float() * 128 ** -0.5).to(torch.float16))


def test_argument_errors() -> None:
    qt, kt, vt, _ = inputs()
    aq = AttentionQuant()
    with pytest.raises(ValueError, match="enable_gqa=True"):
        quantized_sdpa(qt, kt, vt, aq=aq)
    with pytest.raises(ValueError, match="dropout_p=1.5"):
        quantized_sdpa(qt, kt, vt, dropout_p=1.5, enable_gqa=True, aq=aq)
    with pytest.raises(TypeError, match="aq must be"):
        quantized_sdpa(qt, kt, vt, enable_gqa=True, aq=schemes.get("FA_mxfp8"))  # type: ignore[arg-type]


# q, k, v shapes F.scaled_dot_product_attention broadcasts (its math backend: enable_gqa's repeat, then the
# dims before [L, E] broadcast as in torch.matmul), with enable_gqa.
BROADCAST = {
    "kv one head for all query heads": ((2, 4, 8, 16), (2, 1, 8, 16), (2, 1, 8, 16), False),
    "only v broadcast over heads": ((2, 4, 8, 16), (2, 4, 8, 16), (2, 1, 8, 8), False),
    "kv batch broadcast 4-D": ((2, 4, 8, 16), (1, 4, 6, 16), (1, 4, 6, 8), False),
    "q batch broadcast 4-D": ((1, 4, 8, 16), (2, 4, 6, 16), (2, 4, 6, 8), False),
    "3-D batch broadcast": ((2, 8, 16), (1, 6, 16), (1, 6, 8), False),
    "4-D q, 3-D kv": ((2, 4, 8, 16), (4, 6, 16), (4, 6, 8), False),
    "gqa, k and v heads differ": ((2, 4, 8, 16), (2, 2, 6, 16), (2, 1, 6, 8), True),
    "gqa on 3-D (dim -3 as heads)": ((4, 8, 16), (2, 6, 16), (2, 6, 8), True),
}


@pytest.mark.parametrize("case", list(BROADCAST))
def test_broadcast_shapes_equal_torch_sdpa(case: str) -> None:
    *shapes, gqa = BROADCAST[case]
    g = torch.Generator().manual_seed(3)
    qt, kt, vt = (torch.randn(s, generator=g) for s in shapes)
    do = torch.randn(F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa).shape, generator=g)
    ours = run(quantized_sdpa, qt, kt, vt, do, aq=AttentionQuant(), enable_gqa=gqa)
    ref = run(F.scaled_dot_product_attention, qt, kt, vt, do, enable_gqa=gqa)
    for a, b in zip(ours, ref):  # gradients of broadcast inputs summed back to their shapes
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shapes, gqa, match", [
    (((2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)), False,
     r"heads \(dim -3\) sizes query 4, key 2, value 2 do not broadcast.*pass enable_gqa=True"),
    (((2, 4, 8, 16), (3, 4, 8, 16), (3, 4, 8, 16)), False, r"batch \(dim -4\) sizes query 2, key 3, value 3"),
    (((2, 8, 16), (3, 8, 16), (3, 8, 16)), False, r"the batch \(dim -3\) sizes query 2, key 3, value 3 do not"),
    (((2, 4, 8, 16), (2, 3, 8, 16), (2, 3, 8, 16)), True, r"query heads \(4\) to be a multiple of key heads \(3\)"),
    (((2, 4, 8, 16), (2, 2, 8, 16), (2, 3, 8, 16)), True, r"and of value heads \(3\)"),
    (((8, 16), (8, 16), (8, 16)), True, r"enable_gqa=True needs a heads dim"),
])
def test_shapes_torch_refuses_are_refused(shapes, gqa, match) -> None:
    qt, kt, vt = (torch.randn(s) for s in shapes)
    with pytest.raises((RuntimeError, IndexError)):  # torch refuses them too
        F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa)
    with pytest.raises(ValueError, match=match) as err:
        quantized_sdpa(qt, kt, vt, enable_gqa=gqa, aq=AttentionQuant())
    assert gqa or len(shapes[0]) != 3 or "heads" not in str(err.value)  # 3-D: dim -3 is the batch


@pytest.mark.parametrize("mask_shape", [(3, 1, 4, 4), (4, 5), (2, 1, 1, 4, 4)])
def test_a_mask_that_does_not_broadcast_to_the_scores_is_refused(mask_shape) -> None:
    """torch refuses a mask the scores [B, H, Lq, Lk] do not contain (broadcasting it would grow the output)."""
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    mask = torch.zeros(mask_shape)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with pytest.raises(ValueError, match=rf"attn_mask of shape {re.escape(str(mask_shape))} does not broadcast to "
                                         r"the attention scores \(1, 2, 4, 4\)"):
        quantized_sdpa(q, k, v, attn_mask=mask, aq=AttentionQuant())
    for fits in ((4, 4), (1, 2, 1, 4), (2, 4, 4)):  # what torch takes
        torch.testing.assert_close(quantized_sdpa(q, k, v, attn_mask=torch.zeros(fits), aq=AttentionQuant()),
                                   F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(fits)))


@pytest.mark.parametrize("case", ["kv one head for all query heads", "3-D batch broadcast"])
def test_compiled_broadcast_shapes_equal_eager(case: str) -> None:
    """``fxquant.compile`` with an attention preset on SDPA with broadcast inputs equals quantized_sdpa eagerly."""
    import fxquant

    *shapes, _ = BROADCAST[case]
    g = torch.Generator().manual_seed(4)
    qt, kt, vt = (torch.randn(s, generator=g) for s in shapes)
    do = torch.randn(F.scaled_dot_product_attention(qt, kt, vt).shape, generator=g)

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    torch._dynamo.reset()
    model = fxquant.compile(Attend(), scheme="FA_mxfp8", backend="aot_eager", strict=True)
    compiled = run(model, qt, kt, vt, do)
    aq = schemes.get("FA_mxfp8").attention_for(Site("", SiteKind.ATTENTION))
    eager = run(quantized_sdpa, qt, kt, vt, do, aq=aq)
    assert [s.status.value for s in fxquant.compile_state(model).sites()] == ["rewritten"]
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)

# -- torch.compile ----------------------------------------------------------------------------------------
def block(x, w1, w2, k, v, lq, aq, unfused=True):
    """A small attention block built from every qfunction (SDPA and, with ``unfused``, Megatron's path)."""
    b_, l_, _ = x.shape
    h = quantized_linear(x, w1, None, lq)  # [B, L, HQ*D]
    qh = h.view(b_, l_, HQ, D).transpose(1, 2)
    o = quantized_sdpa(qh, k, v, is_causal=True, enable_gqa=True, aq=aq)  # [B, HQ, L, DV]
    if not unfused:
        return quantized_linear(o.transpose(1, 2).reshape(b_, l_, HQ * DV), w2, None, lq)
    q3, k3 = qh.reshape(b_ * HQ, l_, D), k.repeat_interleave(HQ // HK, 1).reshape(b_ * HQ, LK, D)
    s = quantized_baddbmm(torch.empty(b_ * HQ, l_, LK), q3, k3.transpose(1, 2), beta=0.0, alpha=D**-0.5, mq=aq.qk)
    p = torch.softmax(s.float(), -1)
    o2 = quantized_bmm(p, v.repeat_interleave(HQ // HK, 1).reshape(b_ * HQ, LK, DV), mq=aq.pv)
    y = (o.transpose(1, 2).reshape(b_, l_, HQ * DV) + o2.view(b_, HQ, l_, DV).transpose(1, 2).reshape(b_, l_, -1))
    return quantized_linear(y, w2, None, lq)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_equals_eager_bitwise(backend: str) -> None:
    torch._dynamo.reset()
    lq = schemes.get("linear_mxfp8").linear_for(Site.from_path("layers.0.mlp.linear_fc1"))
    aq = schemes.get("FA_QKPV_hifp8").attention_for(ATT_SITE)
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=g) for s in ((B, LQ, 48), (HQ * D, 48), (24, HQ * DV), (B, HK, LK, D), (B, HK, LK, DV))]
    dy = torch.randn(B, LQ, 24, generator=g)

    def grads(fn):
        leaves = [a.clone().requires_grad_() for a in args]
        out = fn(*leaves, lq, aq, backend == "aot_eager")  # Inductor (cold: slow on 2 cores) on the SDPA path
        out.backward(dy)
        return [out] + [t.grad for t in leaves]

    eager = grads(block)
    compiled = grads(torch.compile(block, backend=backend, fullgraph=True))
    for i, (a, b) in enumerate(zip(eager, compiled)):
        assert torch.equal(a, b), (backend, i, (a - b).abs().max())


@pytest.mark.parametrize("mask, error", [
    (torch.ones(4, dtype=torch.bool), ValueError),  # 1-D: torch needs [.., Lq, Lk]
    (torch.zeros(4), ValueError),
    (torch.ones(4, 4, dtype=torch.int64), TypeError),  # neither bool, float32 nor the query's dtype
    (torch.ones(4, 4, dtype=torch.uint8), TypeError),
    (torch.zeros(4, 4, dtype=torch.float16), TypeError),
    (torch.zeros(4, 4, dtype=torch.float64), TypeError),
])
def test_a_mask_torch_refuses_by_rank_or_dtype_is_refused(mask: torch.Tensor, error: type) -> None:
    """As torch's SDPA: a mask needs [.., Lq, Lk] and is bool, float32 or the query's dtype (an int64 mask of
    ones was added as +1 to every score, a 1-D one broadcast over the queries)."""
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    with pytest.raises((RuntimeError, IndexError)):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with pytest.raises(error, match="attn_mask"):
        quantized_sdpa(q, k, v, attn_mask=mask, aq=AttentionQuant())


def test_a_float32_mask_of_bf16_inputs_is_taken_as_torch_does() -> None:
    q, k, v = (torch.randn(1, 2, 4, 8).to(torch.bfloat16) for _ in range(3))
    mask = torch.randn(4, 4)
    torch.testing.assert_close(quantized_sdpa(q, k, v, attn_mask=mask, aq=AttentionQuant()),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=0.02, atol=0.02)


def test_dropout_of_one_drops_every_weight_as_torch() -> None:
    """dropout_p = 1 (torch takes it): output and gradients zero, not NaN (keep / 0) nor refused."""
    qt, kt, vt, do = inputs()
    for fn, kw in ((quantized_sdpa, {"aq": AttentionQuant()}), (quantized_sdpa, {"aq": schemes.get(
            "FA_mxfp8").attention_for(ATT_SITE)}), (F.scaled_dot_product_attention, {})):
        o, dq, dk, dv = run(fn, qt, kt, vt, do, dropout_p=1.0, enable_gqa=True, **kw)
        for t in (o, dq, dk, dv):
            assert torch.equal(t, torch.zeros_like(t)), fn
