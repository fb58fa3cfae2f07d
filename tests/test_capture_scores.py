"""Capture of the forward attention scores S = scale * Q K^T (pre-mask, pre-softmax): inside the reference
attention at SDPA sites (quantized_sdpa), and as the QK^T site's result in Megatron's unfused attention."""
from __future__ import annotations

import math

import pytest
import torch

from fxquant import capture, schemes
from fxquant.backend import FxquantBackend
from fxquant.formats.tensor_quant import TensorQuant
from tests.megatron_helpers import single_process  # noqa: F401  (fixture)
from tests.models import make_llama, make_tokens, next_token_loss

SPEC_TEXT = """
sections:
  - layers: {kinds: [attention]}
    points: [{component: attention, roles: [query, key, scores]}]
"""


def _run_llama(tmp_path, scheme: str, inner: str = "aot_eager"):
    spec = capture.load_spec("scores.yaml", text=SPEC_TEXT)
    model = make_llama()
    tokens = make_tokens(model.cfg)
    be = FxquantBackend(schemes.get(scheme), capture=spec, inner=inner, root=model)
    with capture.start(spec, tmp_path, scheme=scheme):
        next_token_loss(torch.compile(model, backend=be)(tokens), tokens).backward()
    return capture.open(tmp_path), be, model.cfg


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_sdpa_reference_path_captures_scores_as_its_qk_gemm_computed_them(tmp_path, inner):
    cs, be, cfg = _run_llama(tmp_path, "FA_mxfp8", inner)
    tq = TensorQuant("mxfp8")
    scores = cs.query(role="scores")
    assert len(scores) == cfg.n_layers and {r.phase for r in scores} == {"post"}
    for rec in scores:
        q = cs.load(cs.query(role="query", module=rec.module)[0])
        k = cs.load(cs.query(role="key", module=rec.module)[0])
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # enable_gqa
        want = torch.matmul(tq.quantize(q, -1), tq.quantize(k, -1).transpose(-2, -1)).float() / math.sqrt(cfg.head_dim)
        got = cs.load(rec)
        assert got.dtype == torch.float32 and got.shape == (2, cfg.n_heads, 16, 16)
        assert torch.equal(got, want), rec.module
        assert torch.isfinite(got).all()  # captured before the causal mask
    assert not [u for r in be.tap_reports for u in r.unavailable if "scores" in u]


def test_torch_sdpa_reports_scores_as_not_materialised(tmp_path):
    cs, be, _ = _run_llama(tmp_path, "bf16")  # bf16 keeps torch's SDPA: no scores exist
    assert len(cs.query(role="scores")) == 0 and len(cs.query(role="query")) == 2
    unavailable = [u for r in be.tap_reports for u in r.unavailable]
    assert any("attention.scores[hp]: not materialised by scaled_dot_product_attention" in u for u in unavailable)


def test_scores_are_a_forward_post_attention_role_without_quantized_copies():
    spec = capture.load_spec("s.yaml", text=SPEC_TEXT)
    assert [p.role.value for p in spec.sections[0].points] == ["query", "key", "scores"]
    with pytest.raises(capture.SpecError, match="none of roles \\['scores'\\] is a GEMM operand"):
        capture.load_spec("q.yaml", text=SPEC_TEXT.replace("roles: [query, key, scores]",
                                                           "roles: [scores], copies: [quantized]"))


@pytest.mark.megatron
def test_megatron_unfused_attention_captures_scores_before_its_inplace_mask(tmp_path, request):
    pytest.importorskip("megatron.core", reason="needs megatron-core")
    request.getfixturevalue("single_process")
    from tests.test_capture_megatron import _model_and_batch, _step

    spec = capture.load_spec("scores.yaml", text=SPEC_TEXT.replace("[query, key, scores]",
                                                                   "[query, key, scores, probs]"))
    model, batch = _model_and_batch("local")
    be = FxquantBackend(schemes.get("bf16"), capture=spec, inner="aot_eager", root=model)
    with capture.start(spec, tmp_path, scheme="bf16"):
        _step(torch.compile(model, backend=be), batch)
    head_dim = model.config.kv_channels
    cs = capture.open(tmp_path)
    recs = cs.query(role="scores")
    assert len(recs) == 2
    for rec in recs:
        q = cs.load(cs.query(role="query", module=rec.module)[0])  # baddbmm operands: Q, K^T
        kt = cs.load(cs.query(role="key", module=rec.module)[0])
        got = cs.load(rec)
        want = torch.baddbmm(torch.empty_like(got), q, kt, beta=0.0, alpha=1.0 / math.sqrt(head_dim))
        assert torch.equal(got, want), rec.module
        assert got.abs().max() < 1000  # Megatron masks in place with -10000 after this point
        probs = cs.load(cs.query(role="probs", module=rec.module)[0]).float().reshape(got.shape)
        causal = torch.ones(got.shape[-2:], dtype=torch.bool).tril()
        ref = torch.softmax(got.float().masked_fill(~causal, float("-inf")), -1)
        torch.testing.assert_close(probs, ref, rtol=0, atol=1e-2)
