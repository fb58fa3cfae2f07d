"""fxquant.compile on the small Llama module: compiled == eager run of the same quantized functions (bitwise,
outputs and gradients), bf16 == plain torch.compile, dynamic shapes, graph breaks, runtime counters (a no_grad
region in a training forward included), deep copy and pickling of the returned module."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import fxquant
from fxquant.counters import count_quantize_calls
from fxquant.lowering import Kernels
from tests.models import make_llama, make_tokens, next_token_loss


def run_step(model, tokens):
    """(logits, loss, grads by name) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = next_token_loss(logits, tokens)
    loss.backward()
    inner = getattr(model, "_orig_mod", model)
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in inner.named_parameters()}


def compiled_step(scheme, backend, tokens_list, **cfg):
    model = fxquant.compile(make_llama(**cfg), scheme, backend=backend, strict=True)
    return [run_step(model, t) for t in tokens_list], model


def assert_bitwise(a, b, summed: tuple[str, ...] = ()):
    """Bitwise equal logits, loss and gradients; ``summed`` gradients (autograd adds contributions coming
    from several graphs in an order of its own) are compared to fp32 rounding instead."""
    (la, lossa, ga), (lb, lossb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
    torch.testing.assert_close(lossa, lossb, rtol=0, atol=0)
    assert ga.keys() == gb.keys()
    for name in ga:
        tol = 1e-5 if name in summed else 0
        torch.testing.assert_close(ga[name], gb[name], rtol=tol, atol=tol, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("scheme", ["FA_linear_mxfp8", "FA_QKPV_hifp8"])
def test_aot_eager_equals_eager_reference_bitwise(scheme):
    tokens = [make_tokens(make_llama().cfg)]
    (ref,), _ = compiled_step(scheme, "eager", tokens)
    (got,), _ = compiled_step(scheme, "aot_eager", tokens)
    assert_bitwise(ref, got)
    plain = run_step(make_llama(), tokens[0])
    assert not torch.equal(plain[1], got[1]), "the scheme must change the loss"


@pytest.mark.slow
def test_aot_eager_equals_eager_reference_bitwise_under_autocast():
    """torch.autocast(bf16): AOT traces the backward under the forward's autocast state, the eager reference's
    autograd functions run it outside autocast and cast the backward GEMMs' operands themselves: the same bits."""
    tokens = make_tokens(make_llama().cfg)
    runs = []
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        model = fxquant.compile(make_llama(), "linear_mxfp8", backend=backend, strict=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs.append(run_step(model, tokens))
    assert runs[0][0].dtype == torch.bfloat16
    assert_bitwise(*runs)


def test_bf16_is_bit_identical_to_plain_torch_compile():
    tokens = make_tokens(make_llama().cfg)
    plain = run_step(torch.compile(make_llama()), tokens)
    torch._dynamo.reset()
    model = fxquant.compile(make_llama(), "bf16", strict=True)
    got = run_step(model, tokens)
    assert_bitwise(plain, got)
    state = fxquant.compile_state(model)
    assert state.sites() and not any(s.selected for s in state.sites())


def test_second_sequence_length_dynamic_shapes():
    cfg = make_llama().cfg
    tokens = [make_tokens(cfg, seq_len=16), make_tokens(cfg, seq_len=24, seed=2), make_tokens(cfg, seq_len=40, seed=3)]
    refs, _ = compiled_step("FA_linear_mxfp8", "eager", tokens)
    torch._dynamo.reset()
    gots, model = compiled_step("FA_linear_mxfp8", "aot_eager", tokens)
    for ref, got in zip(refs, gots):
        assert_bitwise(ref, got)
    state = fxquant.compile_state(model)
    assert len(state.backend.reports) == 2  # static, then one dynamic graph for every later length
    assert all(s.status.value == "rewritten" for s in state.sites() if s.selected)


def test_forced_graph_break_inside_attention_keeps_sites_quantized():
    """A break between the projections and SDPA: the resumed frame's root is the attention module, and the
    sites after the break still get their full paths, layer and kind (module identity, not spelling)."""
    tokens = [make_tokens(make_llama().cfg)]
    (ref,), _ = compiled_step("FA_linear_mxfp8", "eager", tokens, graph_break=True, n_layers=1)
    torch._dynamo.reset()
    (got,), model = compiled_step("FA_linear_mxfp8", "aot_eager", tokens, graph_break=True, n_layers=1)
    # The embedding output feeds two graphs (q/k/v before the break, the residual after it).
    assert_bitwise(ref, got, summed=("embed_tokens.weight",))
    torch._dynamo.reset()
    (whole,), _ = compiled_step("FA_linear_mxfp8", "aot_eager", tokens, n_layers=1)
    assert_bitwise(whole, got, summed=("embed_tokens.weight",))  # the same numbers as the unbroken model
    state = fxquant.compile_state(model)
    assert len(state.backend.reports) > 2
    paths = {(s.site.module_path, s.site.layer, s.site.kind.value) for s in state.sites() if s.selected}
    assert ("layers.0.self_attn", 0, "attention") in paths and ("layers.0.self_attn.o_proj", 0, "proj") in paths
    assert len(paths) == 8


def test_graph_break_in_every_layer_compiles_each_layers_own_graphs_under_strict():
    """A graph break inside each attention block makes Dynamo compile each layer's attention (and the rest of the
    layer) as frames of their own. Each layer gets its own graphs (``passes.instances``): strict mode sees every site
    rewritten (one graph shared by both layers left layer 1's sites unreported: strict raised 'not rewritten'), the
    counters match, and the numbers are those of the unbroken model."""
    tokens = make_tokens(make_llama().cfg)
    broken = fxquant.compile(make_llama(graph_break=True), "FA_linear_mxfp8", backend="aot_eager", strict=True)
    whole = fxquant.compile(make_llama(), "FA_linear_mxfp8", backend="aot_eager", strict=True)
    for _ in range(2):
        assert_bitwise(run_step(whole, tokens), run_step(broken, tokens), summed=("embed_tokens.weight",))
    with count_quantize_calls(broken) as count:
        run_step(broken, tokens)
    assert count.ok and not count.compiled
    state = fxquant.compile_state(broken)
    rewritten = {s.site.module_path for s in state.sites() if s.status.value == "rewritten"}
    assert {p for p in rewritten if p.startswith("layers.1.")} == {p.replace("layers.0.", "layers.1.") for p in rewritten
                                                                    if p.startswith("layers.0.")}
    assert "layers.1.self_attn.q_proj" in rewritten and "layers.1.mlp.down_proj" in rewritten
    assert {tuple(r.instance.values()) for r in state.backend.reports if r.sites} >= {("layers.0.self_attn",),
                                                                                      ("layers.1.self_attn",)}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_runtime_counters_expected_equals_executed(backend):
    cfg = make_llama().cfg
    model = fxquant.compile(make_llama(), "FA_linear_mxfp8", backend=backend, strict=True)
    tokens = make_tokens(cfg)
    with count_quantize_calls(model) as first:
        run_step(model, tokens)
    assert first.compiled
    with count_quantize_calls(model) as count:
        run_step(model, tokens)
    # per layer: 7 linears x (2 fprop + 4 backward) + attention QK (2 forward + 4 backward), 2 layers
    if backend == "eager":
        assert (count.expected_forward, count.expected_backward) == (2 * (7 * 2 + 2), 2 * (7 * 4 + 4))
    else:  # AOT's CSE shares X's quantization among q/k/v_proj and gate/up_proj (fprop and wgrad)
        assert (count.expected_forward, count.expected_backward) == (2 * (7 * 2 + 2 - 3), 2 * (7 * 4 + 4 - 3))
    assert count.ok and count.executed == count.expected
    for _ in range(2):  # no_grad is a new guard: the first forward-only call compiles again
        with count_quantize_calls(model, backward=False) as fwd_only, torch.no_grad():
            model(tokens)
    assert not fwd_only.compiled and fwd_only.executed == fwd_only.expected_forward


def test_forward_only_step_in_grad_mode_allows_backward_quantizes_moved_into_the_forward():
    """A forward-only call in grad mode runs the training graph's forward, into which AOT autograd's partitioner may
    move a backward quantize of a forward value (the first linear's X along M for wgrad): no false alarm under
    strict. A shortfall is still one (nothing at all runs when the uncompiled module is called)."""
    from fxquant.passes.strict import QuantizationError

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    model = fxquant.compile(net, "linear_mxfp8", backend="aot_eager", kernels="reference", strict=True)
    x = torch.randn(8, 64)
    for _ in range(2):
        model(x).sum().backward()
    with count_quantize_calls(model) as step:
        model(x).sum().backward()
    assert step.ok and (step.expected_forward, step.expected_backward) == (4, 6) and step.executed == 10
    with count_quantize_calls(model, backward=False) as fwd_only:
        model(x)
    assert not fwd_only.compiled and fwd_only.ok
    assert 4 <= fwd_only.executed <= 10 and (fwd_only.expected_forward, fwd_only.expected_backward) == (4, 6)
    assert "expected 4 to 10 (a forward-only step" in str(fwd_only)
    with pytest.raises(QuantizationError, match="expected 4 to 10"):
        with count_quantize_calls(model, backward=False):
            net(x)  # the uncompiled module: no quantize runs
    with torch.no_grad():
        model(x)  # compiles the no_grad graph
    with torch.no_grad(), count_quantize_calls(model, backward=False) as evaluation:
        model(x)
    assert evaluation.ok and evaluation.executed == evaluation.expected_forward == 4
    assert evaluation.expected_backward == 0 and "expected 4 (4 forward)" in str(evaluation)


def test_aot_eager_honours_kernels_and_the_counters_follow():
    """Under aot_eager, kernels="inductor" runs the quantizes as ATen ops (no op call: counted as fused) and
    "reference" calls fxquant::quantize_reference (counted as executed); the values are the same bit for bit."""
    base = make_llama()
    tokens = make_tokens(base.cfg)
    outs = {}
    for kernels in ("reference", "inductor", "auto"):
        torch._dynamo.reset()
        model = fxquant.compile(copy.deepcopy(base), "linear_mxfp8", backend="aot_eager", kernels=kernels,
                                strict=True)
        run_step(model, tokens)
        with count_quantize_calls(model) as count:
            outs[kernels] = run_step(model, tokens)
        assert count.ok and count.executed == count.expected
        used = fxquant.compile_state(model).kernels()
        if kernels == "inductor":
            assert used == [Kernels.INDUCTOR] * len(used) and count.expected == 0 and count.fused > 0
        else:
            assert Kernels.INDUCTOR not in used and count.expected > 0 and count.fused == 0
    for kernels in ("inductor", "auto"):
        (logits, loss, grads), (want_logits, want_loss, want_grads) = outs[kernels], outs["reference"]
        assert torch.equal(logits, want_logits) and torch.equal(loss, want_loss)
        assert all(torch.equal(grads[n], want_grads[n]) for n in want_grads)


def test_compiling_a_compiled_module_says_what_to_pass():
    model = fxquant.compile(make_llama(), "linear_mxfp8", backend="aot_eager")
    with pytest.raises(TypeError, match=r"already compiled \(fxquant.compile\); pass the module it wraps"):
        fxquant.compile(model, "linear_hifp8")
    with pytest.raises(TypeError, match=r"already compiled \(torch.compile\)"):
        fxquant.compile(torch.compile(make_llama()), "linear_hifp8")
    raw = make_llama()  # explain too: it listed the wrapper's _orig_mod.-prefixed paths (modules rules failed)
    for wrapped, how in ((torch.compile(raw), "torch.compile"), (model, "fxquant.compile")):
        with pytest.raises(TypeError, match=rf"already compiled \({how}\); pass the module it wraps, model._orig_mod, "
                                            r"to explain it"):
            fxquant.explain(wrapped, make_tokens(raw.cfg), scheme="linear_mxfp8")


def test_deep_copy_of_a_compiled_module_is_compiled_the_same_way():
    """copy.deepcopy keeps the scheme, options, state and counters (torch's OptimizedModule alone copies to a bare
    torch.compile: no fxquant state, no hooks); the copy's parameters are its own."""
    base = make_llama()
    tokens = make_tokens(base.cfg)
    model = fxquant.compile(base, "linear_mxfp8", backend="aot_eager", kernels="reference", strict=True)
    first = run_step(model, tokens)
    clone = copy.deepcopy(model)
    state = fxquant.compile_state(clone)
    assert state is not fxquant.compile_state(model) and state.model is clone._orig_mod
    assert state.model is not base and state.scheme.name == "linear_mxfp8" and state.strict
    run_step(clone, tokens)
    with count_quantize_calls(clone) as count:
        got = run_step(clone, tokens)
    assert count.ok and count.executed == count.expected > 0
    assert fxquant.compile_state(clone).kernels() and Kernels.INDUCTOR not in fxquant.compile_state(clone).kernels()
    assert_bitwise(first, got)
    with torch.no_grad():
        next(clone._orig_mod.parameters()).mul_(2)
    assert torch.equal(run_step(model, tokens)[1], first[1])


def _mlp_and_input():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    return model, torch.randn(4, 32)


def _reloaded(module):
    """What unpickling ``module`` builds, without unpickling anything (the tests never load pickles): its
    ``__reduce_ex__`` reconstructor called on a deep copy of its arguments, after checking that ``pickle`` and
    ``torch.save`` accept it."""
    pickle.dumps(module)
    torch.save(module, io.BytesIO())
    rebuild, args = module.__reduce_ex__(pickle.HIGHEST_PROTOCOL)[:2]
    return rebuild(*copy.deepcopy(args))


@pytest.mark.parametrize("called", [False, True], ids=["before-first-call", "after-first-call"])
def test_a_pickled_compiled_module_loads_compiled_again(called):
    """pickle / torch.save of the returned module, as copy.deepcopy: loading compiles the loaded model with the same
    scheme and options, with a fresh state (torch's OptimizedModule pickled alone loads without fxquant's state
    before the first call, and does not load after it: the pickled backend's rewritten graphs re-trace)."""
    base, x = _mlp_and_input()
    model = fxquant.compile(base, "linear_mxfp8", backend="aot_eager", kernels="reference", strict=True)
    if called:
        model(x).sum().backward()
    loaded = _reloaded(model)
    state, mine = fxquant.compile_state(loaded), fxquant.compile_state(model)
    assert state is not mine and state.model is loaded._orig_mod and state.model is not base
    assert state.scheme.name == "linear_mxfp8" and state.strict and state.options == mine.options
    assert not state.backend.reports  # graphs compile again on the first call
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    loaded(x).sum().backward()
    with count_quantize_calls(loaded, strict=True) as count:
        loaded(x).sum().backward()
    assert count.executed == count.expected > 0


def test_a_model_holding_a_compiled_module_pickles():
    """A plain model holding a compiled submodule pickles after its first call; the submodule loads compiled
    again."""
    net, x = _mlp_and_input()
    net[2] = fxquant.compile(net[2], "linear_mxfp8", backend="aot_eager", strict=True)
    want = net(x)  # after the first call: the submodule's backend holds its rewritten graphs
    pickle.dumps(net)
    sub = _reloaded(net[2])  # what unpickling the model builds for the submodule
    assert fxquant.compile_state(sub).model is sub._orig_mod and sub._orig_mod is not net[2]._orig_mod
    torch.testing.assert_close(sub(net[1](net[0](x))), want, rtol=0, atol=0)


class _Distill(torch.nn.Module):
    """A student trained against a frozen teacher that runs under no_grad inside the same forward."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher, self.student = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher(x)
        return (self.student(x) - target).square().mean()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_linear_under_no_grad_in_a_training_forward_has_no_backward_quantizes(backend):
    """The teacher's weight requires grad, but its output does not: its GEMM has no dgrad and no wgrad."""
    torch.manual_seed(0)
    model = fxquant.compile(_Distill(), "linear_mxfp8", backend=backend, strict=True)
    x = torch.randn(4, 32)
    model(x).backward()
    with count_quantize_calls(model, strict=True) as count:
        model(x).backward()
    # forward: x and W of each linear (aot_eager's CSE shares x's quantize); backward: the student's wgrad only
    forward = 4 if backend == "eager" else 3
    assert (count.expected_forward, count.expected_backward) == (forward, 2)
    assert count.executed == count.expected


def test_counters_flag_a_step_that_skips_the_compiled_graph(caplog):
    model = fxquant.compile(make_llama(), "linear_hifp8", backend="aot_eager")
    tokens = make_tokens(make_llama().cfg)
    run_step(model, tokens)
    with caplog.at_level("WARNING"), count_quantize_calls(model) as count:
        run_step(model._orig_mod, tokens)  # the uncompiled module: nothing is quantized
    assert count.executed == 0 and not count.ok
    assert "expected" in caplog.text and "executed 0" in caplog.text
    with pytest.raises(fxquant.passes.strict.QuantizationError, match="executed 0"):
        with count_quantize_calls(model, strict=True):
            run_step(model._orig_mod, tokens)


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = (torch.nn.Linear(32, 32) for _ in range(3))

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class _Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("input_grad,frozen_fc1", [(False, False), (True, False), (False, True)])
def test_expected_quantize_calls_follow_autograd(input_grad, frozen_fc1):
    """A first linear whose input needs no grad has no dgrad; a frozen weight no wgrad: expected follows."""
    torch.manual_seed(0)
    mlp = _Mlp()
    mlp.fc1.weight.requires_grad_(not frozen_fc1)
    model = fxquant.compile(mlp, "linear_hifp8", backend="eager", strict=True)
    x = torch.randn(4, 32, requires_grad=input_grad)
    model(x).sum().backward()
    with count_quantize_calls(model, strict=True) as count:
        model(x).sum().backward()
    dgrad_fc1 = 2 * input_grad
    wgrad_fc1 = 2 * (not frozen_fc1)
    assert (count.expected_forward, count.expected_backward) == (3 * 2, 2 * 4 + dgrad_fc1 + wgrad_fc1)
    assert count.ok and count.executed == count.expected


def test_expected_quantize_calls_follow_autograd_in_attention(monkeypatch):
    """Attention on inputs of which only V requires grad: no dQ/dK GEMMs, and P needs no grad (no dP)."""
    monkeypatch.setenv("FXQUANT_ATTENTION", "math")
    q, k = torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32)
    v = torch.randn(1, 2, 8, 32, requires_grad=True)
    model = fxquant.compile(_Attention(), "FA_QKPV_mxfp8", backend="eager", strict=True)
    model(q, k, v).sum().backward()
    with count_quantize_calls(model, strict=True) as count:
        model(q, k, v).sum().backward()
    assert (count.expected_forward, count.expected_backward) == (4, 2)  # QK and PV forward; dV = P^T dO
    assert count.ok


class _SummedLinears(torch.nn.Module):
    """A LoRA branch added to its base linear, and two linears of one input summed (a parallel block): the summed
    sites receive one gradient tensor, whose identical dY quantizes AOT autograd's CSE merges."""

    def __init__(self) -> None:
        super().__init__()
        self.base, self.lora_a = torch.nn.Linear(32, 32), torch.nn.Linear(32, 16, bias=False)
        self.lora_b = torch.nn.Linear(16, 32, bias=False)
        self.attn_like, self.mlp_like = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x):
        h = self.base(x) + self.lora_b(self.lora_a(x))
        return (self.attn_like(h) + self.mlp_like(torch.relu(h))).square().mean()


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_expected_quantize_calls_of_linears_whose_outputs_are_added(backend):
    torch.manual_seed(0)
    model = fxquant.compile(_SummedLinears(), "linear_mxfp8", backend=backend, kernels="reference", strict=True)
    x = torch.randn(2, 8, 32)
    model(x).backward()
    with count_quantize_calls(model, strict=True) as count:
        model(x).backward()
    assert count.ok and count.executed == count.expected
    # forward: x shared by base and lora_a, h by attn_like; five weights, lora_a's output, relu(h)
    merged = backend == "aot_eager"
    # backward per site (dgrad dY, W; wgrad dY, X), x needing no grad: base 2, lora_a 2 (its X is base's: 1 when
    # merged), lora_b 4 (its dY is base's: 3), attn_like 4, mlp_like 4 (its dY is attn_like's: 2 less)
    assert count.expected_backward == (2 + 1 + 3 + 4 + 2 if merged else 2 + 2 + 4 + 4 + 4)


class _OperandTwice(torch.nn.Module):
    """Two linears whose inputs are one expression written twice: AOT autograd's CSE merges the two expressions
    (and their quantizes) unless they draw random numbers or a tensor is changed in place between them."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.a, self.b = how, torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def _operand(self, x):
        how = self.how
        if how == "relu":
            return torch.relu(x)
        if how == "view":
            return x.view(-1, 32)
        if how == "getitem":
            return x[0]
        return torch.nn.functional.dropout(x, 0.5, training=how == "dropout")

    def forward(self, x):
        if self.how == "in place":
            h = x.clone()
            first = self.a(torch.relu(h))
            h.mul_(2)
            return first + self.b(torch.relu(h))
        return self.a(self._operand(x)) + self.b(self._operand(x))


@pytest.mark.parametrize("how,merged", [("relu", True), ("view", True), ("getitem", True), ("dropout eval", True),
                                        ("dropout", False), ("in place", False)])
def test_expected_quantize_calls_merge_an_operand_written_twice_as_cse_does(how, merged):
    torch.manual_seed(0)
    model = fxquant.compile(_OperandTwice(how), "linear_mxfp8", backend="aot_eager", kernels="reference", strict=True)
    x = torch.randn(2, 8, 32)
    model(x).sum().backward()
    with count_quantize_calls(model, strict=True) as count:
        model(x).sum().backward()
    assert count.ok
    # forward: the input (once when merged) and two weights; backward (no dgrad: x needs none): the shared dY of the
    # summed outputs once, the input per wgrad (once when merged)
    assert (count.expected_forward, count.expected_backward) == ((3, 2) if merged else (4, 3))


def test_counters_after_an_evaluation_under_no_grad_and_with_a_module_called_twice():
    """An evaluation under no_grad compiles a graph of its own beside the training graph: the next training step
    expects the training graph's quantizes (not the evaluation's) and an evaluation step the evaluation graph's
    forward, with no backward (strict mode raised on correct training before); a block that calls the model
    twice expects twice the quantizes."""
    model = fxquant.compile(make_llama(), "FA_linear_mxfp8", backend="aot_eager", kernels="reference", strict=True)
    tokens = make_tokens(make_llama().cfg)
    for _ in range(2):
        run_step(model, tokens)
    with count_quantize_calls(model) as train:
        run_step(model, tokens)
    for _ in range(2):
        with torch.no_grad():
            model(tokens)
    with count_quantize_calls(model) as after_eval:
        run_step(model, tokens)
    assert after_eval.ok and (after_eval.expected_forward, after_eval.expected_backward) == (
        train.expected_forward, train.expected_backward)
    with torch.no_grad(), count_quantize_calls(model, backward=False) as evaluation:
        model(tokens)
    assert evaluation.ok and evaluation.executed == evaluation.expected_forward > 0
    with count_quantize_calls(model) as twice:
        run_step(model, tokens)
        run_step(model, tokens)
    assert twice.ok and twice.expected == 2 * train.expected


@pytest.mark.skipif(not fxquant.api._ISOLATED, reason="torch.compile has no isolate_recompiles before torch 2.13")
def test_a_sweep_of_schemes_over_one_model_quantizes_every_one():
    """fxquant.compile and explain of one model object with ten schemes in one process, no Dynamo reset: each
    compile is a new backend, so a new cache entry of the model's forward, and the ninth ran unquantized once
    Dynamo's recompile limit (8) counted the earlier ones."""
    from fxquant.qfunctions import quantized_linear
    from fxquant.schemes import Site

    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(32, 32)), torch.randn(4, 32)
    names = ["linear_mxfp8", "linear_hifp8", "linear_mxfp4", "linear_nvfp4", "linear_fp8_e4m3", "linear_mxfp6_e3m2",
             "linear_mxfp6_e2m3", "linear_mxint8", "linear_fp8_e5m2", "linear_mxfp8_e5m2"]
    for name in names:
        fxquant.explain(model, x, scheme=name)
    for name in names:
        got = fxquant.compile(model, name, backend="aot_eager", strict=True)(x)
        spec = fxquant.schemes.get(name).linear_for(Site.from_path("0"))
        assert torch.equal(got, quantized_linear(x, model[0].weight, model[0].bias, spec)), name


def test_counters_with_two_input_shapes_alternating():
    """dynamic=False and two batch sizes: two graphs of one frame, both in use; a block that ran one expects that
    one (it also expected the other, which had not run: strict raised on correct training)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    compiled = fxquant.compile(model, "linear_mxfp8", backend="aot_eager", kernels="reference", strict=True,
                               dynamic=False)
    a, b = torch.randn(4, 16), torch.randn(6, 16)
    compiled(a).sum().backward()
    compiled(b).sum().backward()
    for x in (a, b, a):
        with count_quantize_calls(compiled) as count:
            compiled(x).sum().backward()
        assert count.ok and count.executed == count.expected == 10


def test_a_collective_in_a_megatron_body_is_never_taken_for_a_merged_value():
    """Two Megatron linears on one input share its quantizations (AOT's CSE, ``expected._megatron_keys``) unless the
    body derives the operand through communication (sequence parallelism's all-gather): such a call is keyed per
    site. ``torch.broadcast_to`` is no collective."""
    import torch.distributed as dist
    from torch import fx

    from fxquant.passes.expected import _collective

    g = fx.Graph()
    x = g.placeholder("x")
    calls = [g.call_function(torch.broadcast_to, (x, (2,))), g.call_function(dist.all_reduce, (x,)),
             g.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 2, "0")),
             g.call_method("relu", (x,))]
    assert [_collective(n) for n in calls] == [False, True, True, False]


class _MatmulFunction(torch.autograd.Function):
    """A linear as Megatron writes it: an autograd.Function whose forward is one torch.matmul (a megatron_linear
    site: its quantizes go inside the traced bodies)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.matmul(x, w.t())

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g.matmul(w), g.reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class _FunctionLinear(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, n) * 0.1)

    def forward(self, x):
        return _MatmulFunction.apply(x, self.weight)


class _AddedFunctionLinears(torch.nn.Module):
    def __init__(self, combine: str) -> None:
        super().__init__()
        self.inp, self.q, self.kv, self.combine = torch.nn.Linear(32, 32), _FunctionLinear(32), _FunctionLinear(32), combine

    def forward(self, x):
        h = self.inp(x)
        return self.q(h) + self.kv(h) if self.combine == "add" else self.q(h) * self.kv(h)


@pytest.mark.parametrize("combine, calls", [("add", (5, 7)), ("mul", (5, 9))])
def test_expected_quantize_calls_of_function_linears_on_one_input_and_added_outputs(combine, calls):
    """Two autograd.Function linears on one input share X's fprop and wgrad quantizes; with their outputs added they
    also share dY's dgrad and wgrad quantizes (one gradient tensor), as AOT's CSE merges them."""
    torch.manual_seed(0)
    model = fxquant.compile(_AddedFunctionLinears(combine), "linear_mxfp8", backend="aot_eager", strict=True)
    x = torch.randn(4, 32)
    model(x).sum().backward()
    with count_quantize_calls(model, strict=True) as count:
        model(x).sum().backward()
    assert count.ok and (count.expected_forward, count.expected_backward) == calls
    assert {s.op.value for s in fxquant.compile_state(model).sites()} == {"linear", "megatron_linear"}
