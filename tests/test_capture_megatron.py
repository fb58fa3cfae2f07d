"""Capture taps at Megatron linear sites (autograd_function_apply): on Megatron GPTModel on CPU (TP=1), with
SDPA core attention and with Megatron's unfused local attention, under aot_eager, every linear role
(input, weight, output, grad_output, grad_input, grad_weight) equals eager forward/backward hooks on the
Column/RowParallelLinear modules bit for bit, and quantized copies equal the operands as the GEMMs in
the linear's bodies consumed them (their format, blocked along each GEMM's reduction dim)."""
from __future__ import annotations

import pytest
import torch

from fxquant import capture
from fxquant.backend import FxquantBackend
from fxquant.formats.tensor_quant import TensorQuant
from fxquant import schemes

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core", reason="needs megatron-core")
from tests.megatron_helpers import single_process  # noqa: E402,F401  (fixture)

ROLES = ("input", "weight", "output", "grad_output", "grad_input", "grad_weight")
SPEC = capture.load_spec("megatron.yaml", text="""
sections:
  - layers: {kinds: [qkv, proj, fc1, fc2]}
    points: [{component: linear, roles: [input, weight, output, grad_output, grad_input, grad_weight]}]
""")


def _model_and_batch(attention: str):
    from fxquant.megatron_glue.config import tiny_llama_config
    from fxquant.megatron_glue.model import build_gpt_model, causal_attention_mask, position_ids

    model = build_gpt_model(tiny_llama_config(), attention=attention, seed=7)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, (ids, position_ids(2, 16), causal_attention_mask(16))


def _step(model, batch) -> None:
    from fxquant.megatron_glue.graph_breaks import traceable_megatron

    ids, pos, mask = batch
    with traceable_megatron():
        model(ids, pos, mask, labels=ids).mean().backward()


def megatron_linear_hooks(model) -> dict:
    """(module path, role) -> tensor from hooks on every selected Column/RowParallelLinear of an eager model."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    got: dict = {}
    handles = []

    def keep(key):
        return lambda g: got.__setitem__(key, g.clone())

    for name, mod in model.named_modules():
        if not isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) or name == "output_layer":
            continue

        def fwd(m, args, out, name=name):
            x, y = args[0], out[0]
            got[(name, "input")], got[(name, "weight")] = x.detach().clone(), m.weight.detach().clone()
            got[(name, "output")] = y.detach().clone()
            x.register_hook(keep((name, "grad_input")))
            y.register_hook(keep((name, "grad_output")))

        handles += [mod.register_forward_hook(fwd), mod.weight.register_hook(keep((name, "grad_weight")))]
    return got, handles


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_megatron_linear_taps_equal_eager_hooks_bit_for_bit(single_process, tmp_path, attention):
    eager, batch = _model_and_batch(attention)
    want, handles = megatron_linear_hooks(eager)
    _step(eager, batch)
    for h in handles:
        h.remove()
    model, _ = _model_and_batch(attention)
    be = FxquantBackend(schemes.get("bf16"), capture=SPEC, inner="aot_eager", root=model)
    with capture.start(SPEC, tmp_path, scheme="bf16"):
        _step(torch.compile(model, backend=be), batch)
    assert not [u for r in be.tap_reports for u in r.unavailable]
    cs = capture.open(tmp_path)
    assert len(cs) == 2 * 4 * len(ROLES)  # 2 layers x (linear_qkv, linear_proj, linear_fc1, linear_fc2) x roles
    assert len(want) == len(cs)
    for rec in cs:
        t, ref = cs.load(rec, check=True), want[(rec.module, rec.role)]
        assert rec.layer == int(rec.module.split(".")[2]) and rec.component == "linear"
        assert t.dtype == ref.dtype and torch.equal(t, ref), (rec.module, rec.role)


def test_megatron_linear_quantized_copies_are_the_gemm_operands(single_process, tmp_path):
    spec = capture.load_spec("q.yaml", text="""
sections:
  - layers: {kinds: [fc1], indices: [1]}
    points: [{component: linear, roles: [input, weight, grad_output], copies: [hp, quantized]}]
""")
    model, batch = _model_and_batch("sdpa")
    be = FxquantBackend(schemes.get("linear_mxfp8"), capture=spec, inner="aot_eager", root=model)
    with capture.start(spec, tmp_path, scheme="linear_mxfp8"):
        _step(torch.compile(model, backend=be), batch)
    cs = capture.open(tmp_path)
    assert {r.module for r in cs} == {"decoder.layers.1.mlp.linear_fc1"}
    assert {s.status.value for s in be.current_sites() if s.op.value == "megatron_linear" and s.selected} == {"rewritten"}
    tq = TensorQuant("mxfp8")
    quantized = cs.query(copy="quantized")
    assert {(r.role, r.gemm) for r in quantized} == {
        ("input", "fprop"), ("input", "wgrad"), ("weight", "fprop"), ("weight", "dgrad"),
        ("grad_output", "dgrad"), ("grad_output", "wgrad")}
    for rec in quantized:
        src = cs.load(cs.query(copy="hp", role=rec.role)[0]).reshape(-1, rec.shape[-1])  # the [M, K] GEMM view
        want_dim = {"fprop": 1, "dgrad": 0 if rec.role == "weight" else 1, "wgrad": 0}[rec.gemm]
        assert rec.blocked_dim == want_dim and rec.format == "mxfp8_e4m3"
        got = cs.load(rec)
        assert torch.equal(got, tq.quantize(src, want_dim)), (rec.role, rec.gemm)
        # The block axis matters for these operands: along the other axis the copy would differ.
        assert not torch.equal(got, tq.quantize(src, 1 - want_dim)), (rec.role, rec.gemm)


def test_unfused_attention_points_are_reported_only_when_no_site_of_the_module_has_them(single_process, tmp_path):
    """Megatron's unfused attention is two sites of one module (QK^T and PV): value, probs and output exist at
    PV only. The predecessor spec asks for them: they are captured, and "not materialised" is not reported for
    them at the QK^T site (bf16 has no quantized copies: those are reported once, as kept in high precision)."""
    spec = capture.load_spec(capture.shipped_specs()["predecessor"])
    model, batch = _model_and_batch("local")
    be = FxquantBackend(schemes.get("bf16"), capture=spec, inner="aot_eager", root=model)
    with capture.start(spec, tmp_path, scheme="bf16"):
        _step(torch.compile(model, backend=be), batch)
    unavailable = [u for r in be.tap_reports for u in r.unavailable]
    assert not [u for u in unavailable if "not materialised" in u], unavailable
    cs = capture.open(tmp_path)
    assert {"probs", "value", "output"} <= set(cs.query(component="attention").values("role"))


@pytest.mark.parametrize("scheme", ["bf16", "linear_mxfp8"])
def test_megatron_linears_traced_without_grad_are_tapped(single_process, tmp_path, scheme):
    """Under no_grad (evaluation) a Column/RowParallelLinear is traced as ``matmul(x, weight.t())``
    (``module_matmul``): its input, weight ([out, in], before the transpose) and output are tapped as at any
    linear site and equal the eager module's, and a quantized copy is the GEMM's operand, for fprop only (nothing
    listed as uncapturable; the points were 'not materialised at a module_matmul site')."""
    from fxquant.megatron_glue.graph_breaks import traceable_megatron

    spec = capture.load_spec("nograd.yaml", text="""
sections:
  - layers: {kinds: [qkv, proj, fc1, fc2]}
    points: [{component: linear, roles: [input, weight, output], copies: [hp, quantized]}]
""")
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    eager, batch = _model_and_batch("sdpa")
    want: dict = {}

    def keep(m, args, out, name):
        want[(name, "input")], want[(name, "weight")], want[(name, "output")] = args[0], m.weight.detach(), out[0]

    for name, mod in eager.named_modules():
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) and name != "output_layer":
            mod.register_forward_hook(lambda m, a, o, name=name: keep(m, a, o, name))
    with torch.no_grad(), traceable_megatron():
        eager(*batch)
    model, _ = _model_and_batch("sdpa")
    be = FxquantBackend(schemes.get(scheme), capture=spec, inner="aot_eager", root=model)
    with capture.start(spec, tmp_path, scheme=scheme), torch.no_grad(), traceable_megatron():
        torch.compile(model, backend=be)(*batch)
    assert {s.op.value for s in be.current_sites() if s.site.kind.value == "fc1"} == {"module_matmul"}
    assert not [u for r in be.tap_reports for u in r.unavailable if "(no quantized copy)" not in u]
    cs = capture.open(tmp_path)
    hp = cs.query(copy="hp")
    assert len(hp) == 2 * 4 * 3
    for rec in hp:  # quantized, the model computes other activations than the eager one: its weights still match
        first = rec.module == "decoder.layers.0.self_attention.linear_qkv" and rec.role == "input"
        if scheme == "bf16" or rec.role == "weight" or first:
            assert torch.equal(cs.load(rec, check=True), want[(rec.module, rec.role)]), (rec.module, rec.role)
    quantized = cs.query(copy="quantized")  # input and weight for fprop: no_grad runs no dgrad or wgrad
    assert len(quantized) == (0 if scheme == "bf16" else 2 * 4 * 2)
    assert set(quantized.values("gemm")) <= {"fprop"}
    for rec in quantized:
        src = cs.load(cs.query(copy="hp", module=rec.module, role=rec.role)[0]).reshape(-1, rec.shape[-1])
        dim = {"fprop": 1, "dgrad": 0, "wgrad": 0}[rec.gemm]
        assert rec.blocked_dim == dim and torch.equal(cs.load(rec), TensorQuant("mxfp8").quantize(src, dim))
