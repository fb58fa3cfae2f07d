"""nn.MultiheadAttention under fxquant.compile (passes.decompose_mha): its in-projections and out-projection
are linear sites and its attention an attention site, forward and backward.

Checked: high precision (bf16) compiled == torch's own module; quantized compiled == an eager reference
assembled here from ``fxquant.qfunctions`` (quantized_linear / quantized_sdpa / quantized_attention), bit for
bit, for packed and separate weights, batch_first, bool / float / key-padding masks, need_weights with and
without head averaging, is_causal, unbatched inputs, dropout, a second sequence length and dynamic=True
(Dynamo's symbolic dropout_p; the graph Dynamo abandons when it specialises it leaves nothing behind); a
TransformerEncoderLayer training step with every projection and the attention quantized (counts match);
``explain`` rows; capture taps at the MHA's sites. Refused MHA features and other opaque GEMM calls:
tests/test_compile_opaque.py.
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxquant
from fxquant.counters import count_quantize_calls
from fxquant.qfunctions import quantized_attention, quantized_linear, quantized_sdpa
from fxquant.schemes.model import AttentionQuant, LinearQuant, Site, SiteKind
from tests.bitwise import assert_bitwise_equal

E, H, L, S, B = 64, 4, 8, 6, 2
MHA_PASS = importlib.import_module("fxquant.passes.decompose_mha")  # fxquant.passes.decompose_mha is its function


class AttnModel(nn.Module):
    """One MultiheadAttention followed by one Linear (the shape of the issue's report)."""

    def __init__(self, *, batch_first: bool = True, kdim: int | None = None, bias: bool = True, dropout: float = 0.0,
                 add_bias_kv: bool = False, add_zero_attn: bool = False) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H, dropout=dropout, bias=bias, batch_first=batch_first, kdim=kdim,
                                          vdim=kdim, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
        self.fc = nn.Linear(E, E)

    def forward(self, query, key, value, **kw):
        out, weights = self.attn(query, key, value, **kw)
        return self.fc(out), weights


# -- the eager reference, from fxquant.qfunctions ---------------------------------------------------------
def _canonical(mask, dtype):
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill(mask, float("-inf"))


def reference(model: AttnModel, scheme: str, query, key, value, *, key_padding_mask=None, attn_mask=None,
              need_weights=True, average_attn_weights=True, is_causal=False):
    """What the decomposed, quantized module computes, written out with torch and fxquant.qfunctions."""
    s = fxquant.schemes.get(scheme)
    lq = lambda path: s.linear_for(Site.from_path(path)) or LinearQuant()  # noqa: E731
    aq = s.attention_for(Site.from_path("attn", SiteKind.ATTENTION)) or AttentionQuant()
    mha = model.attn
    self_attn, key_is_value = query is key is value, key is value
    batched = query.dim() == 3
    if mha.batch_first and batched:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    if not batched:  # unsqueezed separately, as torch does: then no longer the same tensor
        query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        self_attn = key_is_value = False
    tl, bsz, _ = query.shape
    sl, d = key.shape[0], E // H
    w, b = mha.in_proj_weight, mha.in_proj_bias
    bq, bk, bv = (None,) * 3 if b is None else b.chunk(3)
    if not mha._qkv_same_embed_dim:
        q = quantized_linear(query, mha.q_proj_weight, bq, lq("attn.q_proj"))
        k = quantized_linear(key, mha.k_proj_weight, bk, lq("attn.k_proj"))
        v = quantized_linear(value, mha.v_proj_weight, bv, lq("attn.v_proj"))
    elif self_attn:
        q, k, v = quantized_linear(query, w, b, lq("attn.in_proj")).chunk(3, -1)
    elif key_is_value:
        q = quantized_linear(query, w[:E], bq, lq("attn.in_proj_q"))
        k, v = quantized_linear(key, w[E:], None if b is None else b[E:], lq("attn.in_proj_kv")).chunk(2, -1)
    else:
        wq, wk, wv = w.chunk(3)
        q = quantized_linear(query, wq, bq, lq("attn.in_proj_q"))
        k = quantized_linear(key, wk, bk, lq("attn.in_proj_k"))
        v = quantized_linear(value, wv, bv, lq("attn.in_proj_v"))
    kpm = _canonical(key_padding_mask, query.dtype)
    if is_causal and kpm is None and not need_weights:
        mask = None
    else:
        is_causal = False
        mask = _canonical(attn_mask, query.dtype)
        if mask is not None and mask.dim() == 2:
            mask = mask.unsqueeze(0)
    if kpm is not None:
        kpm = kpm.view(bsz, 1, 1, sl).expand(-1, H, -1, -1).reshape(bsz * H, 1, sl)
        mask = kpm if mask is None else mask + kpm
    p_drop = mha.dropout if mha.training else 0.0
    if need_weights:
        qh, kh, vh = (t.reshape(t.shape[0], bsz * H, d).transpose(0, 1) for t in (q, k, v))
        o, p = quantized_attention(qh, kh, vh, mask, p_drop, aq=aq)
        o = o.transpose(0, 1).reshape(tl, bsz, E)
        weights = p.view(bsz, H, tl, sl)
        weights = weights.mean(dim=1) if average_attn_weights else weights
    else:
        qh, kh, vh = (t.reshape(t.shape[0], bsz, H, d).permute(1, 2, 0, 3) for t in (q, k, v))
        if mask is not None:
            mask = mask.unsqueeze(0) if mask.shape[0] == 1 else mask.view(bsz, H, -1, sl)
        o = quantized_sdpa(qh, kh, vh, mask, p_drop, is_causal, aq=aq).permute(2, 0, 1, 3).reshape(tl, bsz, E)
        weights = None
    out = quantized_linear(o, mha.out_proj.weight, mha.out_proj.bias, lq("attn.out_proj"))
    if not batched:
        out, weights = out.squeeze(1), None if weights is None else weights.squeeze(0)
    elif mha.batch_first:
        out = out.transpose(0, 1)
    return quantized_linear(out, model.fc.weight, model.fc.bias, lq("fc")), weights


# -- cases ------------------------------------------------------------------------------------------------
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _bool_mask(*shape, seed):
    m = torch.rand(*shape, generator=_gen(seed)) < 0.3
    m[..., 0] = False  # never a fully masked row
    return m


CASES = {  # masks of one kind per call: mixing bool and float is deprecated in torch and breaks the graph
    # id: (model kwargs, inputs ("self" | "kv" | "cross"), call kwargs builder)
    "self_batch_first": (dict(), "self", lambda: dict(need_weights=False)),
    "self_time_first_weights": (dict(batch_first=False), "self", lambda: dict(need_weights=True)),
    "weights_per_head_bool_mask": (dict(), "self", lambda: dict(
        need_weights=True, average_attn_weights=False, attn_mask=_bool_mask(L, L, seed=3),
        key_padding_mask=_bool_mask(B, L, seed=12))),
    "float_mask_3d_padding": (dict(), "self", lambda: dict(
        need_weights=False, attn_mask=torch.randn(B * H, L, L, generator=_gen(4)),
        key_padding_mask=_canonical(_bool_mask(B, L, seed=5), torch.float32))),
    "key_is_value_float_padding": (dict(bias=False), "kv", lambda: dict(
        need_weights=False, key_padding_mask=torch.randn(B, S, generator=_gen(6)))),
    "cross_bool_mask_3d_weights": (dict(batch_first=False), "cross", lambda: dict(
        need_weights=True, attn_mask=_bool_mask(B * H, L, S, seed=7))),
    "separate_weights_mask": (dict(kdim=32), "kv", lambda: dict(
        need_weights=False, attn_mask=_bool_mask(L, S, seed=8))),
    "separate_weights_padding_weights": (dict(kdim=32), "cross", lambda: dict(
        need_weights=True, key_padding_mask=_bool_mask(B, S, seed=9))),
    "causal": (dict(), "self", lambda: dict(
        need_weights=False, is_causal=True, attn_mask=nn.Transformer.generate_square_subsequent_mask(L))),
    "causal_with_padding": (dict(), "self", lambda: dict(
        need_weights=False, is_causal=True, attn_mask=nn.Transformer.generate_square_subsequent_mask(L),
        key_padding_mask=_canonical(_bool_mask(B, L, seed=10), torch.float32))),
    "unbatched": (dict(), "unbatched", lambda: dict(need_weights=True)),
}


def make_case(name, seed=0):
    model_kw, inputs, call_kw = CASES[name]
    torch.manual_seed(seed)
    model = AttnModel(**model_kw)
    kdim = model_kw.get("kdim") or E
    bf = model.attn.batch_first
    shape = lambda n, e: (B, n, e) if bf else (n, B, e)  # noqa: E731
    x = torch.randn(*shape(L, E), generator=_gen(seed + 1))
    mem = torch.randn(*shape(S, kdim), generator=_gen(seed + 2))
    val = torch.randn(*shape(S, kdim), generator=_gen(seed + 3))
    if inputs == "self":
        args = (x,)
    elif inputs == "kv":
        args = (x, mem)
    elif inputs == "cross":
        args = (x, mem, val)
    else:
        args = (torch.randn(L, E, generator=_gen(seed + 1)),)
    return model, args, call_kw()


def _leaves(args):
    """Fresh leaf copies of the distinct input tensors, keeping which arguments are the same tensor."""
    leaves = [a.detach().clone().requires_grad_() for a in args]
    return leaves, (leaves * 3)[:3] if len(leaves) == 1 else (leaves + leaves[-1:])[:3]


def run(fn, model, args, kw, seed=11):
    """(output, weights, input grads, parameter grads) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    leaves, qkv = _leaves(args)
    torch.manual_seed(seed)  # dropout
    out, weights = fn(*qkv, **kw)
    loss = out.square().sum() + (0 if weights is None else (weights * weights.detach().cos()).sum())
    loss.backward()
    return out.detach(), weights, [t.grad for t in leaves], {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(got, want, sums_to_tolerance: bool = False):
    """Bitwise equal; with ``sums_to_tolerance`` the bias gradients (sums over the batch that AOT autograd's
    traced backward and eager autograd reduce in orders of their own) to fp32 rounding."""
    assert_bitwise_equal(got[0], want[0], "output")
    assert (got[1] is None) == (want[1] is None)
    if want[1] is not None:
        assert_bitwise_equal(got[1].detach(), want[1].detach(), "weights")
    for i, (g, w) in enumerate(zip(got[2], want[2])):
        assert_bitwise_equal(g, w, f"grad of input {i}")
    assert got[3].keys() == want[3].keys()
    for name in want[3]:
        if sums_to_tolerance and name.endswith("bias"):
            torch.testing.assert_close(got[3][name], want[3][name], rtol=1e-5, atol=1e-6)
        else:
            assert_bitwise_equal(got[3][name], want[3][name], f"grad {name}")


# -- tests ------------------------------------------------------------------------------------------------
# Without the slow marker every case runs once, against torch or against the quantized reference.
_SLOW_HIGH = {"self_batch_first", "float_mask_3d_padding", "cross_bool_mask_3d_weights", "separate_weights_mask",
              "causal"}
_SLOW_QUANTIZED = {"self_batch_first", "self_time_first_weights", "separate_weights_padding_weights",
                   "causal_with_padding"}


def _cases(slow: set[str]) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in CASES]


@pytest.mark.parametrize("name", _cases(_SLOW_HIGH))
def test_high_precision_equals_torch_module(name):
    model, args, kw = make_case(name)
    want = run(model, model, args, kw)
    compiled = fxquant.compile(model, "bf16", backend="aot_eager", strict=True)
    got = run(compiled, model, args, kw)
    assert_same(got, want, sums_to_tolerance=True)
    sites = {s.site.module_path: s for s in fxquant.compile_state(compiled).sites()}
    assert "attn" in sites and "attn.out_proj" in sites and not any(s.selected for s in sites.values())


@pytest.mark.parametrize("name", _cases(_SLOW_QUANTIZED))
def test_quantized_equals_qfunctions_reference_bitwise(name):
    model, args, kw = make_case(name)
    scheme = "FA_linear_mxfp8" if "weights" in name or name == "unbatched" else "FA_QKPV_hifp8"
    want = run(lambda *a, **k: reference(model, scheme, *a, **k), model, args, kw)
    compiled = fxquant.compile(model, scheme, backend="aot_eager", strict=True)
    got = run(compiled, model, args, kw)
    assert_same(got, want)
    plain = run(model, model, args, kw)
    assert not torch.equal(plain[0], got[0]), "the scheme must change the output"
    state = fxquant.compile_state(compiled)
    assert all(s.status.value == "rewritten" for s in state.sites() if s.selected)
    assert {s.site.module_path for s in state.sites() if s.selected} >= {"attn"}
    kinds = {s.site.module_path: (s.site.kind.value, s.op.value) for s in state.sites()}
    attention_op = "attention_weights" if kw["need_weights"] else "sdpa"
    assert kinds["attn"] == ("attention", attention_op)
    assert kinds["attn.out_proj"] == ("proj", "linear")
    assert sum(kind == ("qkv", "linear") for kind in kinds.values()) == _in_projections(name)


def _in_projections(name):
    """in_proj (one GEMM of self-attention), in_proj_q + in_proj_kv (key is value), else three."""
    model_kw, inputs, _ = CASES[name]
    if "kdim" in model_kw:
        return 3
    return {"self": 1, "kv": 2}.get(inputs, 3)  # unbatched: q, k, v unsqueezed separately


@pytest.mark.parametrize("need_weights", [False, True])
def test_dropout_in_training_equals_reference(need_weights):
    torch.manual_seed(0)
    model = AttnModel(dropout=0.25)
    x = torch.randn(B, L, E, generator=_gen(1))
    kw = dict(need_weights=need_weights)
    want = run(lambda *a, **k: reference(model, "FA_QKPV_hifp8", *a, **k), model, (x,), kw)
    got = run(fxquant.compile(model, "FA_QKPV_hifp8", backend="aot_eager", strict=True), model, (x,), kw)
    assert_same(got, want)
    no_drop = run(lambda *a, **k: reference(model.eval(), "FA_QKPV_hifp8", *a, **k), model, (x,), kw)
    assert not torch.equal(no_drop[0], got[0]), "dropout must act in training"


def test_second_sequence_length_dynamic_shapes():
    torch.manual_seed(0)
    model = AttnModel()
    compiled = fxquant.compile(model, "FA_linear_mxfp8", backend="aot_eager", strict=True)
    for i, n in enumerate((8, 12, 20)):
        x = torch.randn(B, n, E, generator=_gen(i))
        kw = dict(need_weights=True, key_padding_mask=_bool_mask(B, n, seed=i))
        want = run(lambda *a, **k: reference(model, "FA_linear_mxfp8", *a, **k), model, (x,), kw)
        assert_same(run(compiled, model, (x,), kw), want)
    assert len(fxquant.compile_state(compiled).backend.reports) == 2  # static, then one dynamic graph


@pytest.mark.parametrize("backend,need_weights", [("aot_eager", False), ("eager", False), ("eager", True)])
def test_dynamic_true_quantizes_every_site_and_strict_accepts_it(backend, need_weights):
    """dynamic=True: Dynamo traces the module's dropout probability as a symbolic float. Under aot_eager, AOT
    autograd then makes Dynamo restart the frame with it specialised: the abandoned graph (its MHA opaque) must
    leave no report, unmatched op or strict error. Under eager that graph runs: the symbolic dropout_p is passed
    through, so the MHA is decomposed and quantized as under aot_eager."""
    torch.manual_seed(0)
    model = AttnModel()  # training mode, dropout 0.0
    x = torch.randn(B, L, E, generator=_gen(1))
    kw = dict(need_weights=need_weights)
    want = run(lambda *a, **k: reference(model, "FA_linear_mxfp8", *a, **k), model, (x,), kw)
    compiled = fxquant.compile(model, "FA_linear_mxfp8", backend=backend, strict=True, dynamic=True)
    assert_same(run(compiled, model, (x,), kw), want)
    state = fxquant.compile_state(compiled)
    assert len(state.backend.reports) == 1 and not state.unmatched()
    selected = {s.site.module_path for s in state.sites() if s.selected and s.status.value == "rewritten"}
    assert {"attn", "attn.in_proj", "attn.out_proj", "fc"} <= selected
    with count_quantize_calls(compiled, strict=True) as count:
        run(compiled, model, (x,), kw)
    assert count.executed == count.expected > 0


def test_a_graph_dynamo_abandons_leaves_no_report_and_no_strict_error(monkeypatch):
    """Under aot_eager and dynamic=True, AOT autograd makes Dynamo restart the frame with the symbolic dropout_p
    specialised: the first graph is never compiled nor run. Here ``decompose_mha`` is made to refuse a symbolic
    dropout_p, so that graph's MHA is an opaque call strict rejects; only the graph that runs counts."""
    monkeypatch.setattr(MHA_PASS, "_FLAGS", (*MHA_PASS._FLAGS, "dropout_p"))
    torch.manual_seed(0)
    model = AttnModel()
    x = torch.randn(B, L, E, generator=_gen(1))
    compiled = fxquant.compile(model, "FA_linear_mxfp8", backend="aot_eager", strict=True, dynamic=True)
    run(compiled, model, (x,), dict(need_weights=False))
    state = fxquant.compile_state(compiled)
    assert len(state.backend.reports) == 1 and not state.unmatched() and not state.backend.pending
    assert {s.site.module_path for s in state.sites() if s.status.value == "rewritten"} >= {"attn", "attn.in_proj"}


def _encoder(**kw):
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(E, H, 96, dropout=0.0, batch_first=True, **kw)


def test_transformer_encoder_layer_training_step_quantizes_all_projections_and_attention():
    model = _encoder()
    compiled = fxquant.compile(model, "FA_linear_mxfp8", backend="aot_eager", strict=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(B, L, E, generator=_gen(1), requires_grad=True)  # else in_proj's dgrad does not run
    pad = _bool_mask(B, L, seed=2)
    for step in range(2):
        with count_quantize_calls(compiled) as count:
            loss = compiled(x, src_key_padding_mask=pad).square().mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
    assert count.ok and not count.compiled and count.executed == count.expected > 0
    sites = {s.site.module_path: s for s in fxquant.compile_state(compiled).sites()}
    assert set(sites) == {"self_attn.in_proj", "self_attn", "self_attn.out_proj", "linear1", "linear2"}
    assert all(s.status.value == "rewritten" and s.selected for s in sites.values())
    assert sites["self_attn"].op.value == "sdpa" and sites["self_attn.in_proj"].site.kind.value == "qkv"
    # 4 linear sites x (2 fprop + 2 wgrad operands) and qk's q, k, with x shared by nothing here; backward:
    # dgrad (dy, w) + wgrad (dy, x) per linear, and qk's dq (ds, k) + dk (q, ds)
    assert fxquant.compile_state(compiled).expected_quantize_calls() == (4 * 2 + 2, 4 * 4 + 4)


class WithInProj(AttnModel):
    """A plain nn.Linear named in_proj (as a Mamba mixer's) next to the MultiheadAttention."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(E, E)

    def forward(self, query, key, value, **kw):
        x = self.in_proj(query)
        return super().forward(x, x, x, **kw)


def test_explain_lists_mha_sites_and_layer_rules_reach_them():
    x = torch.randn(B, L, E)
    exp = fxquant.explain(WithInProj(), x, x, x, scheme="FA_linear_mxfp8")
    text = str(exp)
    assert "5 sites matched, 5 quantized; 0 matmul-like ops unmatched" in text
    for row in ("attn.in_proj", "attn.out_proj", "attention_weights"):
        assert row in text
    kinds = {s.site.module_path: s.site.kind.value for s in exp.sites}
    assert kinds == {"in_proj": "linear", "attn.in_proj": "qkv", "attn": "attention", "attn.out_proj": "proj",
                     "fc": "linear"}  # the MHA's kinds come from the pass, not from the name in_proj
    torch._dynamo.reset()
    torch.manual_seed(0)
    stack = nn.TransformerEncoder(_encoder(), 2, enable_nested_tensor=False)
    scheme = fxquant.schemes.Scheme.from_yaml_text("""
name: layer1_attention
rules:
  - match: {layers: [1], kinds: [qkv, attention]}
    linear: mxfp8
    attention: {qk: mxfp8}
""", "layer1.yaml")
    exp = fxquant.explain(stack, x, scheme=scheme)
    chosen = sorted(s.site.module_path for s in exp.selected)
    assert chosen == ["layers.1.self_attn", "layers.1.self_attn.in_proj"]
    assert {s.site.layer for s in exp.sites if s.site.module_path.startswith("layers.0.")} == {0}


@pytest.mark.slow
def test_inductor_encoder_layer_equals_eager_reference():
    model = _encoder()
    x = torch.randn(B, L, E, generator=_gen(1))

    def step(backend):
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_()
        out = fxquant.compile(model, "FA_linear_mxfp8", backend=backend, strict=True)(xs, is_causal=False)
        out.backward(torch.randn(out.shape, generator=_gen(3)))
        return out.detach(), xs.grad, {n: p.grad.clone() for n, p in model.named_parameters()}

    ref, got = step("eager"), step("inductor")
    # LayerNorm, softmax and bias sums are Inductor's own kernels (test_compile_inductor): a tolerance
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-4)
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], rtol=1e-3, atol=1e-3, msg=lambda m: f"{name}: {m}")


def test_capture_taps_at_mha_sites(tmp_path):
    from fxquant import capture

    spec = capture.load_spec("t.yaml", text="""
sections:
  - points: [{component: attention, roles: [query, key, value, output, grad_output, grad_query]},
             {component: linear, roles: [input, output]}]
""")
    torch.manual_seed(0)
    model = AttnModel()
    x = torch.randn(B, L, E, generator=_gen(1))
    compiled = fxquant.compile(model, "bf16", backend="aot_eager", capture=spec)
    with capture.start(spec, tmp_path, scheme="bf16"):
        out, weights = compiled(x, x, x, need_weights=True)
        out.sum().backward()
    cs = capture.open(tmp_path)
    got = {(r.module, r.role): cs.load(r) for r in cs}
    q, k, v = F.linear(x.transpose(0, 1), model.attn.in_proj_weight, model.attn.in_proj_bias).chunk(3, -1)
    heads = [t.reshape(L, B * H, E // H).transpose(0, 1) for t in (q, k, v)]  # [B*H, L, d]
    for role, want in zip(("query", "key", "value"), heads):
        assert_bitwise_equal(got[("attn", role)], want, role)
    qh, kh, vh = heads
    p = torch.softmax(torch.bmm(qh * (1.0 / (E // H)) ** 0.5, kh.transpose(1, 2)), -1)  # torch's need_weights math
    assert_bitwise_equal(got[("attn", "output")], torch.bmm(p, vh), "output")
    assert_bitwise_equal(weights.detach(), p.view(B, H, L, L).mean(1), "weights")
    assert got[("attn", "grad_output")].shape == got[("attn", "grad_query")].shape == (B * H, L, E // H)
    assert_bitwise_equal(got[("attn.in_proj", "input")], x.transpose(0, 1), "in_proj input")
    assert set(got) >= {("attn.out_proj", "input"), ("attn.out_proj", "output"), ("fc", "output")}


def test_quantized_attention_returns_the_p_its_pv_gemm_consumed():
    aq = fxquant.schemes.get("FA_QKPV_hifp8").attention_for(Site.from_path("attn", SiteKind.ATTENTION))
    q, k, v = (torch.randn(B * H, L, E // H, generator=_gen(i)) for i in range(3))
    mask = torch.randn(1, L, L, generator=_gen(3))
    o, p = quantized_attention(q, k, v, mask, aq=aq)
    assert_bitwise_equal(o, quantized_sdpa(q, k, v, mask, aq=aq), "O")
    qk, pv = aq.qk.forward, aq.pv.forward  # by hand: S = q(Q) q(K)^T, P = softmax(S / sqrt(d) + mask), O = q(P) q(V)
    s = qk.a.quantize(q, -1) @ qk.b.quantize(k, -1).transpose(1, 2)
    want_p = torch.softmax(s * (E // H) ** -0.5 + mask, -1)
    assert_bitwise_equal(p, want_p, "P")
    assert_bitwise_equal(o, pv.a.quantize(want_p, -1) @ pv.b.quantize(v, -2), "O by hand")


class BreakBeforeMHA(nn.Module):
    """A linear, a graph break, then the MultiheadAttention: the first graph shows no MHA site."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(E, E)
        self.attn = nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x):
        h = self.pre(x)
        torch._dynamo.graph_break()
        return self.attn(h, h, h, need_weights=False)[0]


def test_rule_for_mha_in_projection_is_accepted_when_a_graph_break_precedes_the_mha():
    scheme = fxquant.schemes.Scheme.from_yaml_text("rules:\n  - match: {kinds: [qkv]}\n    linear: mxfp8\n",
                                                   "qkv.yaml")
    model = fxquant.compile(BreakBeforeMHA(), scheme=scheme, backend="aot_eager")
    model(torch.randn(B, L, E, generator=_gen(0)))
    status = {(s.site.module_path, s.site.kind.value): s.status.value for s in fxquant.compile_state(model).sites()}
    assert status[("attn.in_proj", "qkv")] == "rewritten"
    assert status[("pre", "linear")] == "high"


@pytest.mark.parametrize("name", ["self_batch_first", "key_is_value_float_padding", "cross_bool_mask_3d_weights",
                                  "separate_weights_mask"])
def test_possible_sites_include_every_linear_site_decompose_mha_creates(name):
    from fxquant.passes import LayerNumbering
    from fxquant.passes.strict import possible_sites

    model, args, kw = make_case(name)
    _, qkv = _leaves(args)
    exp = fxquant.explain(model, *qkv, scheme="linear_mxfp8", backend="aot_eager", **kw)
    made = {(s.site.module_path, s.site.kind) for s in exp.sites if s.site.module_path.startswith("attn.")}
    assert len(made) in (2, 3, 4)  # in-projection(s) and out_proj
    possible = {(s.module_path, s.kind) for s in possible_sites(model, LayerNumbering.of_model(model))}
    assert made <= possible
