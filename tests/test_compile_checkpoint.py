"""Activation checkpointing (torch.utils.checkpoint, reentrant or not) inside a compiled model: Dynamo traces each
region as higher_order.tag_activation_checkpoint over a subgraph, whose linears and SDPA the passes rewrite in
place. The checkpointed model computes the same bits as the same model without checkpointing (outputs and every
gradient) under eager, aot_eager and Inductor; the region's forward quantizes run again in the backward; capture
points inside a region are said, not silently missing."""
from __future__ import annotations

import copy

import pytest
import torch

import fxquant
from fxquant import capture
from fxquant.counters import count_quantize_calls
from tests.models import make_llama, make_tokens, next_token_loss


def _step(model, tokens):
    inner = getattr(model, "_orig_mod", model)
    inner.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # stochastic rounding draws from the global generator
    logits = model(tokens)
    next_token_loss(logits, tokens).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in inner.named_parameters()}


def _same(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=0, atol=0, msg=lambda m: f"grad {name}: {m}")


def _compiled(checkpoint, scheme, **kw):
    base = make_llama()
    model = copy.deepcopy(base)
    model.cfg = type(base.cfg)(**{**base.cfg.__dict__, "checkpoint": checkpoint})
    return fxquant.compile(model, scheme, strict=True, **kw)


@pytest.mark.parametrize("backend, kernels", [("eager", "auto"), ("aot_eager", "reference"),
                                              ("inductor", "reference"), ("inductor", "inductor")])
@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_checkpointed_layers_are_quantized_to_the_same_bits(backend, kernels, mode):
    tokens = make_tokens(make_llama().cfg)
    plain = _step(_compiled(None, "FA_linear_mxfp8", backend=backend, kernels=kernels), tokens)
    torch._dynamo.reset()
    model = _compiled(mode, "FA_linear_mxfp8", backend=backend, kernels=kernels)
    _same(_step(model, tokens), plain)
    sites = fxquant.compile_state(model).sites()
    assert sum(s.status.value == "rewritten" for s in sites) == 2 * (7 + 1) and not fxquant.compile_state(model).unmatched()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_counters_count_the_recompute_of_checkpointed_regions(backend):
    """The region's forward quantizes run again in the backward (how many depends on the backend: eager's
    checkpoint recomputes the region, AOT autograd's partitioner what the backward needs): expected is then a
    floor, still failing a step that skips the compiled graph."""
    tokens = make_tokens(make_llama().cfg)
    plain = _compiled(None, "linear_mxfp8", backend=backend, kernels="reference")
    _step(plain, tokens)
    with count_quantize_calls(plain) as without:
        _step(plain, tokens)
    torch._dynamo.reset()
    model = _compiled("non_reentrant", "linear_mxfp8", backend=backend, kernels="reference")
    _step(model, tokens)
    with count_quantize_calls(model) as count:
        _step(model, tokens)
    assert count.recomputed and count.ok and count.expected == without.expected and "at least" in str(count)
    if backend == "aot_eager":  # the partitioner recomputes; the interpreted region (eager) does on torch 2.13
        assert count.executed > count.expected
    with pytest.raises(fxquant.passes.strict.QuantizationError, match="executed 0"):
        with count_quantize_calls(model):
            _step(model._orig_mod, tokens)


def test_capture_points_inside_checkpointed_regions_are_said(tmp_path, caplog):
    """No taps go into a region (its forward runs again in the backward): each selected point is listed as
    uncapturable with the reason, and the points outside are captured."""
    spec = capture.load_spec("s.yaml", text="sections: [{name: s, points: [{component: linear, roles: [input]}]}]\n")
    tokens = make_tokens(make_llama().cfg)
    with caplog.at_level("WARNING", logger="fxquant"):
        model = _compiled("non_reentrant", "linear_mxfp8", backend="aot_eager", capture=spec, capture_dir=tmp_path)
        _step(model, tokens)
    state = fxquant.compile_state(model)
    state.capture_session.close()
    missing = state.uncapturable()
    assert len(missing) == 2 * 7 and all("activation-checkpointed region" in m for m in missing)
    assert "layers.0.mlp.down_proj (linear): linear.input[hp]" in missing[6] or any(
        m.startswith("layers.0.mlp.down_proj (linear): linear.input[hp]") for m in missing)
    assert [r.module for r in capture.open(tmp_path)] == ["lm_head"]
