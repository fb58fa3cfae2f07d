"""Opaque GEMM calls under fxquant.compile (passes.opaque, strict.opaque_calls): an nn.MultiheadAttention that
decompose_mha refuses, TransformerEncoderLayer's fast path, ATen ops called directly; and strict coverage of
an nn.MultiheadAttention that runs outside the compiled graphs."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import fxquant
from fxquant.passes.strict import QuantizationError
from fxquant.qfunctions import quantized_linear
from fxquant.schemes.model import Site
from tests.bitwise import assert_bitwise_equal
from tests.test_compile_mha import B, E, H, L, AttnModel, _encoder


def test_refused_mha_is_listed_and_rejected_by_strict(caplog):
    torch.manual_seed(0)
    model = AttnModel(add_bias_kv=True)
    x = torch.randn(B, L, E)
    exp = fxquant.explain(model, x, x, x, scheme="FA_linear_mxfp8")
    (u,) = exp.unmatched
    assert u.target == "multi_head_attention_forward" and u.module_path == "attn"
    assert "bias_k/bias_v not supported" in u.note and "bias_k/bias_v not supported" in str(exp)
    torch._dynamo.reset()
    with pytest.raises(QuantizationError, match="multi_head_attention_forward in 'attn'.*bias_k/bias_v"):
        fxquant.compile(model, "FA_linear_mxfp8", backend="aot_eager", strict=True)(x, x, x)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="fxquant"):
        out, _ = fxquant.compile(model, "FA_linear_mxfp8", backend="aot_eager")(x, x, x)
    assert "runs its GEMMs unquantized" in caplog.text
    unquantized_attention = model.attn(x, x, x)[0]  # it runs as torch's call; fc after it is quantized
    fc = fxquant.schemes.get("FA_linear_mxfp8").linear_for(Site.from_path("fc"))
    assert_bitwise_equal(out, quantized_linear(unquantized_attention, model.fc.weight, model.fc.bias, fc), "output")
    torch._dynamo.reset()
    fxquant.compile(model, "bf16", backend="aot_eager", strict=True)(x, x, x)  # nothing to quantize: no error


def test_add_zero_attn_is_refused():
    torch.manual_seed(0)
    x = torch.randn(B, L, E)
    exp = fxquant.explain(AttnModel(add_zero_attn=True), x, x, x, scheme="FA_linear_mxfp8")
    assert [u.note.split("not decomposed: ")[-1] for u in exp.unmatched] == ["add_zero_attn=True not supported"]


def test_encoder_fast_path_is_an_opaque_gemm_call():
    model = nn.Sequential(_encoder(), nn.Linear(E, E)).eval()
    x = torch.randn(B, L, E)
    with torch.no_grad():
        exp = fxquant.explain(model, x, scheme="FA_linear_mxfp8")
        assert [u.target for u in exp.unmatched] == ["_transformer_encoder_layer_fwd"]
        assert "opaque call" in exp.unmatched[0].note and "_transformer_encoder_layer_fwd" in str(exp)
        torch._dynamo.reset()
        with pytest.raises(QuantizationError, match="_transformer_encoder_layer_fwd in '0'"):
            fxquant.compile(model, "FA_linear_mxfp8", backend="aot_eager", strict=True)(x)
        torch._dynamo.reset()
        torch.backends.mha.set_fastpath_enabled(False)  # the documented way back to the decomposable path
        try:
            exp = fxquant.explain(model, x, scheme="FA_linear_mxfp8")
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    assert not exp.unmatched and len(exp.selected) == 6  # in_proj, attention, out_proj, linear1, linear2, 1


def test_encoder_fast_path_alone_in_a_first_call_is_said_not_raised(caplog):
    """A first call in eval under no_grad traces only the fast path's opaque call, no site: not strict, that is the
    opaque call's WARNING and the output, as when the same call follows a training step (it raised 'nothing to
    quantize' before)."""
    model = _encoder().eval()
    x = torch.randn(B, L, E)
    compiled = fxquant.compile(model, "linear_mxfp8", backend="aot_eager")
    with torch.no_grad(), caplog.at_level("WARNING"):
        out = compiled(x)
    assert out.shape == x.shape and "_transformer_encoder_layer_fwd in '<root>'" in caplog.text


class SkippedAttention(AttnModel):
    def forward(self, query, key, value, **kw):
        out, _ = torch._dynamo.disable(self.attn)(query, key, value, need_weights=False)
        return self.fc(out)


def test_mha_outside_the_compiled_graphs_fails_strict_coverage():
    torch.manual_seed(0)
    x = torch.randn(B, L, E)
    compiled = fxquant.compile(SkippedAttention(), "FA_mxfp8", backend="aot_eager", strict=True)
    with pytest.raises(QuantizationError, match="selected attention site 'attn' was not rewritten"):
        compiled(x, x, x)


class AtenCalls(nn.Module):
    """ATen ops called directly: a matmul and a fused SDPA kernel (one node, two GEMMs inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(E, E)

    def forward(self, x):
        y = torch.ops.aten.mm.default(x.flatten(0, 1), self.fc.weight).view_as(x)
        q = y.unflatten(-1, (H, E // H)).transpose(1, 2)
        o = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q)[0]
        return self.fc(o.transpose(1, 2).flatten(2))


def test_aten_calls_are_listed_and_aten_attention_fails_strict():
    x = torch.randn(B, L, E)
    exp = fxquant.explain(AtenCalls(), x, scheme="FA_linear_mxfp8")
    listed = {u.target: u.opaque for u in exp.unmatched}
    assert listed == {"aten.mm": False, "aten._scaled_dot_product_flash_attention_for_cpu": True}
    torch._dynamo.reset()
    with pytest.raises(QuantizationError, match="aten._scaled_dot_product_flash_attention_for_cpu in '<root>'"):
        fxquant.compile(AtenCalls(), "FA_linear_mxfp8", backend="aot_eager", strict=True)(x)


@torch.library.custom_op("fxquant_test::expert_mm", mutates_args=())
def expert_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An MoE's expert GEMM behind a custom op (as transformers' ``grouped_mm_fallback`` on CPU)."""
    return x @ weight


@expert_mm.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[-1])


def _expert_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _expert_mm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    return grad @ weight.t(), x.t() @ grad


expert_mm.register_autograd(_expert_mm_backward, setup_context=_expert_mm_setup)


class Experts(nn.Module):
    """Expert weights as 3-D parameters, run by a custom op (``custom=True``) or by ``torch._grouped_mm``."""

    def __init__(self, custom: bool) -> None:
        super().__init__()
        self.custom = custom
        self.gate_up_proj = nn.Parameter(torch.randn(2, E, E) / E)
        self.scale = nn.Parameter(torch.ones(E))  # 1-D: a custom op given only this hides no GEMM

    def forward(self, x):
        x = torch.ops.fxquant_test.expert_mm(x, self.scale.diag())  # a tensor made from a parameter: no weight
        if self.custom:
            return torch.ops.fxquant_test.expert_mm(x, self.gate_up_proj[0].t())
        offs = torch.tensor([x.shape[0] // 2, x.shape[0]], dtype=torch.int32)
        w = self.gate_up_proj.transpose(-2, -1).to(torch.bfloat16)  # as transformers' _grouped_linear calls it
        return torch._grouped_mm(x.to(torch.bfloat16), w, offs=offs).float()


class MoE(nn.Module):
    def __init__(self, custom: bool) -> None:
        super().__init__()
        self.router = nn.Linear(E, 2)
        self.experts = Experts(custom)
        self.fc = nn.Linear(E, E)

    def forward(self, x):
        return self.fc(self.experts(x) * self.router(x).softmax(-1)[:, :1])


def test_custom_op_with_a_weight_parameter_is_opaque_and_fails_strict(caplog):
    x = torch.randn(B * L, E)
    exp = fxquant.explain(MoE(custom=True), x, scheme="linear_mxfp8")
    (u,) = exp.unmatched
    assert (u.target, u.module_path, u.opaque) == ("fxquant_test::expert_mm", "experts", True)
    assert u.note == "custom op with a weight parameter: may hide GEMMs" and u.note in str(exp)
    assert "1 matmul-like ops unmatched" in str(exp)
    torch._dynamo.reset()
    with pytest.raises(QuantizationError, match="fxquant_test::expert_mm in 'experts'.*may hide GEMMs"):
        fxquant.compile(MoE(custom=True), "linear_mxfp8", backend="aot_eager", strict=True)(x)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="fxquant"):
        fxquant.compile(MoE(custom=True), "linear_mxfp8", backend="aot_eager")(x)
    assert "fxquant_test::expert_mm in 'experts'" in caplog.text and "runs its GEMMs unquantized" in caplog.text
    torch._dynamo.reset()
    fxquant.compile(MoE(custom=True), "bf16", backend="aot_eager", strict=True)(x)  # nothing to quantize: no error


def test_grouped_mm_is_listed_unmatched():
    x = torch.randn(B * L, E)
    exp = fxquant.explain(MoE(custom=False), x, scheme="linear_mxfp8")
    assert [(u.target, u.module_path, u.opaque) for u in exp.unmatched] == [("_grouped_mm", "experts", False)]
    assert "1 matmul-like ops unmatched" in str(exp)



class _Branches(nn.Module):
    """A linear in each branch of torch.cond (a higher-order op whose subgraphs the passes do not rewrite)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cond(x.sum() > 0, lambda t: self.a(t), lambda t: self.b(t), (x,)))


def test_linears_in_a_cond_branch_are_listed_and_rejected_by_strict(caplog):
    """Ops in the subgraphs of a higher-order op other than a checkpointed region are listed as unmatched with a
    note naming the op (they were listed nowhere), strict refuses them, the linear outside is still quantized."""
    torch.manual_seed(0)
    model, x = _Branches(), torch.randn(4, 32)
    with caplog.at_level(logging.WARNING, logger="fxquant"):
        compiled = fxquant.compile(model, "linear_mxfp8", backend="aot_eager")
        compiled(x)
    state = fxquant.compile_state(compiled)
    assert [(s.site.module_path, s.status.value) for s in state.sites()] == [("head", "rewritten")]
    assert sorted(u.module_path for u in state.unmatched()) == ["a", "b"]
    assert all("higher-order op cond" in u.note for u in state.unmatched())
    torch._dynamo.reset()
    with pytest.raises(QuantizationError, match="linear in '[ab]'.*higher-order op cond"):
        fxquant.compile(model, "linear_mxfp8", backend="aot_eager", strict=True)(x)


def test_flex_attention_is_an_opaque_attention_call():
    """torch's flex_attention (a higher-order op that runs QK^T and PV itself) is listed as an opaque call."""
    from torch.nn.attention.flex_attention import flex_attention

    class Flex(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(32, 96)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(1, 16, 3, 2, 16).permute(2, 0, 3, 1, 4)
            return flex_attention(q, k, v)

    with torch.no_grad():  # flex_attention's backward does not run on the CPU
        compiled = fxquant.compile(Flex(), "FA_linear_mxfp8", backend="aot_eager")
        compiled(torch.randn(1, 16, 32))
    (u,) = fxquant.compile_state(compiled).unmatched()
    assert u.target == "flex_attention" and "attention kernel" in u.note
