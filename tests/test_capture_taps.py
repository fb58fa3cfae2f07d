"""Capture taps in compiled graphs: values equal eager forward/backward hooks bit for bit (aot_eager and
Inductor), quantized copies equal the operands the GEMMs consumed, and a spec outside its window neither
captures nor recompiles."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

import fxquant
from fxquant import capture, schemes
from fxquant.backend import FxquantBackend
from fxquant.formats.tensor_quant import TensorQuant
from tests.models import make_llama, make_tokens, next_token_loss


class TapBackend(FxquantBackend):
    """fxquant's backend with a capture spec: the tap pass runs after its rewrite passes (as in fxquant.compile)."""

    def __init__(self, scheme, spec, **kw):
        super().__init__(schemes.get(scheme), capture=spec, **kw)


def eager_hooks(model: nn.Module, run) -> dict:
    """(module path, role) -> tensor, from nn.Module hooks, tensor hooks and an SDPA-intercepting function mode."""
    got: dict = {}
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            def fwd(m, args, out, name=name):
                got[(name, "input")], got[(name, "weight")], got[(name, "output")] = args[0].detach().clone(), \
                    m.weight.detach().clone(), out.detach().clone()

            def bwd(m, gin, gout, name=name):
                got[(name, "grad_input")], got[(name, "grad_output")] = gin[0].clone(), gout[0].clone()

            handles += [mod.register_forward_hook(fwd), mod.register_full_backward_hook(bwd),
                        mod.weight.register_hook(lambda g, name=name: got.__setitem__((name, "grad_weight"), g.clone()))]

    class SDPAHooks(torch.overrides.TorchFunctionMode):
        count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is F.scaled_dot_product_attention:
                name = f"layers.{SDPAHooks.count}.self_attn"
                SDPAHooks.count += 1
                for role, t in zip(("query", "key", "value", "output"), (*args[:3], out)):
                    got[(name, role)] = t.detach().clone()
                    t.register_hook(lambda g, k=(name, "grad_" + role if role != "output" else "grad_output"):
                                    got.__setitem__(k, g.clone()))
            return out

    with SDPAHooks():
        run(model)
    for h in handles:
        h.remove()
    return got


def _train_step(model, tokens):
    next_token_loss(model(tokens), tokens).backward()


def test_bf16_capture_equals_eager_hooks_bit_for_bit(tmp_path):
    spec = capture.load_spec("predecessor")
    eager = make_llama()
    tokens = make_tokens(eager.cfg)
    want = eager_hooks(eager, lambda m: _train_step(m, tokens))
    model = make_llama()
    be = TapBackend("bf16", spec, inner="aot_eager", root=model)
    with capture.start(spec, tmp_path, scheme="bf16"):
        _train_step(torch.compile(model, backend=be), tokens)
    cs = capture.open(tmp_path)
    hp = cs.query(copy="hp")
    assert len(cs.query(copy="quantized")) == 0  # bf16 quantizes nothing: no quantized copies
    roles = {(r.component, r.role) for r in hp}
    assert roles == {("linear", x) for x in ("input", "weight", "output", "grad_output", "grad_input", "grad_weight")} | {
        ("attention", x) for x in ("query", "key", "value", "output", "grad_output", "grad_query", "grad_key",
                                   "grad_value")}
    assert len(hp) == 14 * 6 + 2 * 8  # 7 linears x 2 layers (LM head excluded), 2 attention sites
    for rec in hp:
        t = cs.load(rec, check=True)
        ref = want[(rec.module, rec.role)]
        assert t.dtype == ref.dtype and torch.equal(t, ref), (rec.module, rec.role)
    unavailable = [u for r in be.tap_reports for u in r.unavailable]
    assert any("attention.probs[hp]: not materialised at a sdpa site" in u for u in unavailable)


def test_quantized_copies_equal_gemm_operands(tmp_path):
    spec = capture.load_spec("t.yaml", text="""
sections:
  - layers: {kinds: [fc2], indices: [1]}
    points: [{component: linear, roles: [input, weight, grad_output], copies: [hp, quantized]}]
""")
    model = make_llama()
    tokens = make_tokens(model.cfg)
    be = TapBackend("linear_mxfp8", spec, inner="aot_eager", root=model)
    with capture.start(spec, tmp_path, scheme="linear_mxfp8"):
        _train_step(torch.compile(model, backend=be), tokens)
    cs = capture.open(tmp_path)
    assert {r.module for r in cs} == {"layers.1.mlp.down_proj"}
    tq = TensorQuant("mxfp8")
    for rec in cs.query(copy="quantized"):
        src = cs.load(cs.query(copy="hp", role=rec.role)[0]).reshape(-1, rec.shape[-1])
        dim = {("input", "fprop"): 1, ("input", "wgrad"): 0, ("weight", "fprop"): 1, ("weight", "dgrad"): 0,
               ("grad_output", "dgrad"): 1, ("grad_output", "wgrad"): 0}[(rec.role, rec.gemm)]
        assert rec.blocked_dim == dim and rec.format == "mxfp8_e4m3"  # blocked along the GEMM's reduction dim
        assert torch.equal(cs.load(rec), tq.quantize(src, dim)), (rec.role, rec.gemm)
        assert rec.stats["sqnr_db"] > 20 and 0.99 < rec.stats["cosine"] <= 1.0
    assert {(r.role, r.gemm) for r in cs.query(copy="quantized")} == {
        ("input", "fprop"), ("input", "wgrad"), ("weight", "fprop"), ("weight", "dgrad"),
        ("grad_output", "dgrad"), ("grad_output", "wgrad")}


def test_quantized_copies_only_for_gemms_that_run(tmp_path):
    """A quantized copy is the operand as its GEMM consumed it: a graph compiled under no_grad (an evaluation) runs
    no backward GEMM, a frozen weight no wgrad, an input that needs no gradient (layer 0's q/k/v_proj, after the
    embedding and that layer's norm are frozen) no dgrad; none of those gets copies (an eval step wrote dgrad/wgrad/dq/dk copies)."""
    spec = capture.load_spec("t.yaml", text="""
sections:
  - layers: {kinds: [qkv, fc2]}
    points: [{component: linear, roles: [input, weight, grad_output], copies: [quantized]}]
  - layers: {kinds: [attention]}
    points: [{component: attention, roles: [query, key], copies: [quantized]}]
""")
    model = make_llama()
    tokens = make_tokens(model.cfg)
    model.layers[0].mlp.down_proj.weight.requires_grad_(False)  # a frozen weight: its input has no wgrad
    model.embed_tokens.weight.requires_grad_(False)  # with layer 0's norm: q/k/v_proj inputs need no gradient
    model.layers[0].input_layernorm.weight.requires_grad_(False)
    be = TapBackend("FA_linear_mxfp8", spec, inner="aot_eager", root=model)
    compiled = torch.compile(model, backend=be)
    with capture.start(spec, tmp_path, scheme="FA_linear_mxfp8") as session:
        session.set_iteration(0)
        _train_step(compiled, tokens)
        session.set_iteration(1)
        with torch.no_grad():
            compiled(tokens)
    cs = capture.open(tmp_path)
    train = {(r.module, r.role, r.gemm) for r in cs.query(iteration=0)}
    evaluation = {(r.module, r.role, r.gemm) for r in cs.query(iteration=1)}
    assert {g for _, _, g in evaluation} == {"fprop", "qk"}  # forward GEMMs only
    assert {(m, r, g) for m, r, g in train if g in ("fprop", "qk")} == evaluation
    assert ("layers.0.mlp.down_proj", "input", "wgrad") not in train  # frozen weight
    assert ("layers.0.mlp.down_proj", "weight", "dgrad") in train  # its input still needs a gradient
    assert ("layers.1.mlp.down_proj", "input", "wgrad") in train
    assert ("layers.0.self_attn.q_proj", "weight", "dgrad") not in train  # the embedding is frozen
    assert ("layers.0.self_attn.q_proj", "input", "wgrad") in train
    assert ("layers.1.self_attn.q_proj", "weight", "dgrad") in train
    assert {("layers.0.self_attn", "query", "dk"), ("layers.0.self_attn", "key", "dq")} <= train


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.fc1(x)
        h = torch.relu(h) * 2.0 + 1.0  # pointwise ops Inductor fuses and may run in place of h's buffer
        return self.fc2(h).square().sum()


def test_inductor_taps_copy_before_buffer_reuse_and_window_never_recompiles(tmp_path):
    spec = capture.load_spec("t.yaml", text="""
sections:
  - points: [{component: linear, roles: [input, output, grad_output, grad_input]}]
    when: {iterations: [1]}
""")
    torch.manual_seed(0)
    eager = TinyMLP()
    model = TinyMLP()
    model.load_state_dict(eager.state_dict())
    x = torch.randn(4, 16)
    mods = {"fc1": eager.fc1, "fc2": eager.fc2}
    got = {}
    for name, mod in mods.items():
        mod.register_forward_hook(lambda m, a, o, n=name: got.update({(n, "input"): a[0].clone(), (n, "output"): o.clone()}))
        mod.register_full_backward_hook(lambda m, gi, go, n=name: got.update({(n, "grad_input"): gi[0].clone(),
                                                                                (n, "grad_output"): go[0].clone()}))
    eager(x.clone().requires_grad_()).backward()
    be = TapBackend("bf16", spec, inner="inductor", root=model)
    compiled = torch.compile(model, backend=be)
    with capture.start(spec, tmp_path) as s:
        for it in range(3):
            s.set_iteration(it)
            compiled(x.clone().requires_grad_()).backward()
    assert len(be.reports) == 1  # one compile; the window is checked inside the op at run time
    cs = capture.open(tmp_path)
    assert cs.values("iteration") == [1] and len(cs) == 8
    for rec in cs:
        assert torch.equal(cs.load(rec), got[(rec.module, rec.role)]), (rec.module, rec.role)


def test_a_section_that_selects_no_site_is_named_with_the_nearest_module_paths(tmp_path, caplog):
    """A section that can never match (a misspelt module regex, layer indices the model does not have, a kind it has
    no site of) captured nothing without a word: one WARNING per section, naming it, the selector that left no site
    and the nearest module paths. A section that selects sites through backward points only is not named."""
    spec = capture.load_spec("t.yaml", text="""
sections:
  - name: typo
    layers: {module: 'layerz\\.\\d+\\.mlp'}
    points: [{component: linear}]
  - name: grads_only
    layers: {kinds: [fc2]}
    points: [{component: linear, roles: [grad_output]}]
  - name: far
    layers: {kinds: [fc1], indices: [99]}
    points: [{component: linear, roles: [input]}]
  - name: router
    layers: {kinds: [router]}
    points: [{component: linear, roles: [input]}]
""")
    model = make_llama()
    tokens = make_tokens(model.cfg)
    with caplog.at_level(logging.WARNING, logger="fxquant"):
        compiled = fxquant.compile(model, "bf16", backend="aot_eager", capture=spec, capture_dir=tmp_path)
        _train_step(compiled, tokens)
        _train_step(compiled, tokens)  # said once per compile, not per call
    fxquant.compile_state(compiled).capture_session.close()
    said = [r.getMessage() for r in caplog.records if "selects no site" in r.getMessage()]
    assert [m.split("'")[1] for m in said] == ["typo", "far", "router"]  # one each; grads_only matched
    typo, far, router = said
    assert "no linear module path matches module 'layerz\\\\.\\\\d+\\\\.mlp'" in typo
    assert "nearest module paths: layers." in typo and ".mlp." in typo
    assert "no site in layers.indices [99]" in far and "are 0..1" in far and "layers.0.mlp.gate_proj" in far
    assert "no site of kind router" in router and "fc1" in router
    assert {r.role for r in capture.open(tmp_path)} == {"grad_output"}
    from fxquant.passes.capture_taps import unmatched_sections

    reports = fxquant.compile_state(compiled).backend.tap_reports
    assert [line for _, line in unmatched_sections(spec, reports)] == [m.removeprefix("capture: ") for m in said]


class _TwoGraphs(nn.Module):
    """Two linears with a graph break between them: Dynamo compiles one graph per linear."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


def test_a_section_whose_sites_are_in_another_graph_is_not_named(tmp_path, caplog):
    """A graph break puts the section's only site in the second graph: judged over the compile's graphs, the
    section selects a site, so no WARNING (the first graph alone has none of its sites)."""
    spec = capture.load_spec("t.yaml", text="""
sections:
  - name: second_only
    layers: {module: '^second$'}
    points: [{component: linear, roles: [input]}]
""")
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="fxquant"):
        compiled = fxquant.compile(_TwoGraphs(), "bf16", backend="aot_eager", capture=spec, capture_dir=tmp_path)
        compiled(torch.randn(2, 8)).sum().backward()
    fxquant.compile_state(compiled).capture_session.close()
    assert len(fxquant.compile_state(compiled).backend.tap_reports) == 2
    assert not [r for r in caplog.records if "selects no site" in r.getMessage()]
    assert [r.module for r in capture.open(tmp_path)] == ["second"]


def test_shipped_linear_specs_capture_linears_of_any_name(tmp_path):
    """`linear_io` and `stats_only` select every linear but the LM head, embeddings and routers: a linear with a
    name fxquant gives no kind (kind `linear`, here an nn.Sequential's `0` and `2`) is captured too."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    for name in ("linear_io", "stats_only"):
        torch._dynamo.reset()
        out = tmp_path / name
        compiled = fxquant.compile(model, "bf16", backend="aot_eager", capture=name, capture_dir=out)
        compiled(torch.randn(4, 8)).sum().backward()
        fxquant.compile_state(compiled).capture_session.close()
        assert {(r.module, r.role) for r in capture.open(out) if r.copy == "hp"} >= {
            ("0", "input"), ("2", "input"), ("0", "grad_output"), ("2", "grad_output")}, name
