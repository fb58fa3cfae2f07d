"""Bad input to fxquant.compile / explain (issue 3, item 8) and strict-mode failures (item 5)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxquant
from fxquant.passes.strict import QuantizationError
from tests.models import make_llama, make_tokens


def test_unknown_scheme_has_did_you_mean():
    with pytest.raises(ValueError, match="did you mean.*linear_mxfp8"):
        fxquant.compile(make_llama(), "linear_mxpf8", backend="aot_eager")


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="backend='aot-eager'.*aot_eager"):
        fxquant.compile(make_llama(), "bf16", backend="aot-eager")


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nrules:\n  - match: {kinds: [fc1]}\n    linear: {fprop: {x: mxfp9}}\n")
    with pytest.raises(ValueError, match=r"bad\.yaml:\d+.*mxfp9"):
        fxquant.compile(make_llama(), str(path), backend="aot_eager")


def test_selector_matching_nothing_lists_nearest_module_paths(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("name: typo\nrules:\n  - match: {modules: 'layers\\.0\\.mlp\\.up_prj'}\n    linear: mxfp8\n")
    model = fxquant.compile(make_llama(), str(path), backend="aot_eager")
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj"):
        model(make_tokens(make_llama().cfg))


class _Counted(torch.nn.Module):
    """A linear that counts the forwards that reached it: a refused graph must not run at all."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.fc(x)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("match", ["{kinds: [router]}", "{modules: 'fc2'}", "{layers: [3]}"])
def test_a_rule_matching_nothing_is_one_error_everywhere(tmp_path, strict, match):
    """One rule: a rule with a selector (kinds, modules or layers) that matches no site is a ValueError from
    explain and from compile (strict or not), before anything of the graph runs."""
    path = tmp_path / "s.yaml"
    path.write_text(f"rules:\n  - linear: hifp8\n  - match: {match}\n    linear: mxfp8\n")
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"rule 1 .*matched no site"):
        fxquant.explain(_Counted(), x, scheme=str(path))
    model = _Counted()
    compiled = fxquant.compile(model, str(path), backend="aot_eager", strict=strict)
    with pytest.raises(ValueError, match=r"rule 1 .*matched no site"):
        compiled(x)
    assert model.calls.item() == 0  # the forward did not run


def test_a_rule_without_selector_may_match_nothing():
    """A preset's generic rule (every attention site) on a model without attention is no error: a note."""
    explanation = fxquant.explain(_Counted(), torch.randn(4, 32), scheme="FA_linear_mxfp8")
    assert "note: rule 1" in str(explanation) and "the model has no attention sites" in str(explanation)
    compiled = fxquant.compile(_Counted(), "FA_linear_mxfp8", backend="aot_eager", strict=True)
    compiled(torch.randn(4, 32))


class _Double(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32).double()

    def forward(self, x):
        return self.proj(x)


def test_float64_site_is_refused_with_its_name_before_running():
    compiled = fxquant.compile(_Double(), "linear_hifp8", backend="aot_eager")
    with pytest.raises(ValueError, match=r"site 'proj' \(linear, linear\) \[.*test_compile_errors.py.*\] has "
                                         r"operands of dtype torch.float64; fxquant quantizes torch.float32"):
        compiled(torch.randn(4, 32, dtype=torch.float64))
    assert fxquant.compile(_Double(), "bf16", backend="aot_eager")(torch.randn(2, 32, dtype=torch.float64)).dtype \
        == torch.float64  # nothing quantized: float64 runs as it is


class NoGemm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        return (x * self.scale).relu().sum(-1)


def test_model_without_linear_or_attention_is_a_clear_error():
    model = fxquant.compile(NoGemm(), "linear_mxfp8", backend="aot_eager")
    with pytest.raises(ValueError, match="no linear .* or attention"):
        model(torch.randn(2, 8))
    with pytest.raises(ValueError, match="nothing to quantize"):
        fxquant.explain(NoGemm(), torch.randn(2, 8), scheme="linear_mxfp8")


class EmptyK(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(0, 8)

    def forward(self, x):
        return self.fc1(x)


def test_block_format_along_a_zero_length_dimension_is_rejected():
    model = fxquant.compile(EmptyK(), "linear_mxfp8", backend="aot_eager")
    with pytest.raises(ValueError, match="blocked along K, which has length 0"):
        model(torch.randn(3, 0))


class SplitLinear(torch.nn.Linear):
    """A linear whose GEMM ends up after a graph break, as a bare matmul nobody recognises."""

    def forward(self, x):
        torch._dynamo.graph_break()
        return torch.matmul(x, self.weight.t()) + self.bias


class WithSplit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = SplitLinear(32, 32)
        self.down_proj = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)))


def test_strict_raises_when_a_selected_site_is_not_rewritten(caplog):
    strict = fxquant.compile(WithSplit(), "linear_hifp8", backend="aot_eager", strict=True)
    with pytest.raises(QuantizationError, match="'up_proj' was not rewritten.*graph_break"):
        strict(torch.randn(4, 32))
    torch._dynamo.reset()
    lenient = fxquant.compile(WithSplit(), "linear_hifp8", backend="aot_eager")
    with caplog.at_level("WARNING", logger="fxquant"):
        lenient(torch.randn(4, 32))
    assert "'up_proj' was not rewritten" in caplog.text
    assert "down_proj" not in caplog.text


class WithAuxHead(torch.nn.Module):
    """An auxiliary head called in training only, and a linear the forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.aux, self.unused = (torch.nn.Linear(32, 32) for _ in range(3))

    def forward(self, x):
        h = self.body(x)
        return h + self.aux(h) if self.training else h


def test_strict_does_not_raise_for_selected_modules_that_were_not_called(caplog):
    """Without a graph break every module a call ran was traced: a selected one in no graph was not called (it
    said 'ran outside torch.compile' and strict raised). The aux head is checked once training calls it."""
    model = WithAuxHead().eval()
    strict = fxquant.compile(model, "linear_hifp8", backend="aot_eager", strict=True)
    with caplog.at_level("WARNING", logger="fxquant"), torch.no_grad():
        strict(torch.randn(4, 32))
    model.train()
    strict(torch.randn(4, 32)).sum().backward()
    paths = {s.site.module_path for s in fxquant.compile_state(strict).sites() if s.status.value == "rewritten"}
    assert paths == {"body", "aux"} and "was not rewritten" not in caplog.text


def test_strict_raises_when_a_frame_hits_the_recompile_limit(caplog):
    model = fxquant.compile(make_llama(), "linear_hifp8", backend="aot_eager", strict=True, dynamic=False)
    cfg = make_llama().cfg
    with torch._dynamo.config.patch(recompile_limit=1):
        model(make_tokens(cfg, seq_len=8))
        with pytest.raises(Exception, match="recompile_limit|Hard failure"):
            model(make_tokens(cfg, seq_len=12))
    torch._dynamo.reset()
    lenient = fxquant.compile(make_llama(), "linear_hifp8", backend="aot_eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level("WARNING", logger="fxquant"):
        lenient(make_tokens(cfg, seq_len=8))
        lenient(make_tokens(cfg, seq_len=12))
    assert "hit Dynamo's recompile_limit" in caplog.text and "raise torch._dynamo.config.recompile_limit" in caplog.text


def test_a_rule_for_a_module_a_graph_break_left_outside_the_graphs_is_a_coverage_issue(caplog):
    """With a graph break in every layer, Dynamo gives up the root's layer loop and runs the LM head after it eagerly:
    a rule selecting only the LM head matched a site of the model, not one of the graphs. It was refused as 'rules
    match no site: the model has no lm_head'; it is the coverage issue (strict raises, else a WARNING), and explain
    warns instead of noting that the rule matched nothing."""
    from fxquant import schemes

    scheme = schemes.Scheme.from_yaml_text("name: head\nrules:\n  - match: {kinds: [lm_head]}\n    linear: mxfp8\n")
    tokens = make_tokens(make_llama().cfg)
    strict = fxquant.compile(make_llama(graph_break=True), scheme, backend="aot_eager", strict=True)
    with pytest.raises(QuantizationError, match="lm_head site 'lm_head' was not rewritten.*graph_break"):
        strict(tokens)
    torch._dynamo.reset()
    lenient = fxquant.compile(make_llama(graph_break=True), scheme, backend="aot_eager")
    with caplog.at_level("WARNING", logger="fxquant"):
        lenient(tokens)
    assert "'lm_head' was not rewritten" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fxquant"):
        table = str(fxquant.explain(make_llama(graph_break=True), tokens, scheme=scheme))
    assert "'lm_head' was not rewritten" in caplog.text and "matched no site" not in table
    with pytest.raises(ValueError, match="match no site"):  # without a graph break the rule error stays
        fxquant.explain(make_llama(), tokens, scheme=schemes.Scheme.from_yaml_text(
            "name: typo\nrules:\n  - match: {modules: 'lm_haed'}\n    linear: mxfp8\n"))


def test_the_recompile_limit_warning_names_the_limit_hit(caplog):
    """A stack whose layers are frames of their own compiles once per layer (passes.instances): past
    accumulated_recompile_limit the frame runs eagerly, and the warning names that limit (it said recompile_limit)."""
    from tests.test_compile_instances import Stack

    model = fxquant.compile(Stack(graph_break=True, n_layers=4), "linear_mxfp8", backend="aot_eager")
    with torch._dynamo.config.patch(accumulated_recompile_limit=2), caplog.at_level("WARNING", logger="fxquant"):
        model(torch.randn(4, 64))
    assert "hit Dynamo's accumulated_recompile_limit" in caplog.text
    assert "raise torch._dynamo.config.accumulated_recompile_limit" in caplog.text


class _LSTMHead(torch.nn.Module):
    """An LSTM (which Dynamo refuses, skipping the whole frame) before a Linear the scheme selects."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.fc = torch.nn.LSTM(32, 32, batch_first=True), torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.fc(self.rnn(x)[0])


class _SelfAttn(torch.nn.Module):
    """Attention written out as matmul, softmax, matmul (Hugging Face's attn_implementation="eager")."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return torch.softmax(q @ k.transpose(-2, -1) / 32**0.5, -1) @ v


class _EagerAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = _SelfAttn()

    def forward(self, x):
        return self.self_attn(x)


class _TokenMixer(torch.nn.Module):
    """MLP-Mixer's token mixing: a matmul over the sequence, no attention anywhere."""

    def __init__(self):
        super().__init__()
        self.token_mix = torch.nn.Parameter(torch.randn(8, 8))
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.proj(torch.matmul(self.token_mix, x))


def test_an_attention_scheme_on_explicit_matmul_attention_is_said(caplog):
    """FA_* on attention the passes cannot see: nothing of attention is quantized, so strict raises and otherwise a
    warning says so, once (the linear is still quantized); a scheme without attention says nothing."""
    x = torch.randn(2, 8, 32)
    torch._dynamo.reset()
    with pytest.raises(QuantizationError, match=r"scheme FA_linear_mxfp8 quantizes attention, but the compiled "
                                                 r"graphs hold no attention op .* matmul-like op\(s\) left unmatched "
                                                 r"\(e.g. @ in 'self_attn'\)"):
        fxquant.compile(_EagerAttention(), "FA_linear_mxfp8", backend="aot_eager", strict=True)(x)
    torch._dynamo.reset()
    lenient = fxquant.compile(_EagerAttention(), "FA_linear_mxfp8", backend="aot_eager")
    with caplog.at_level("WARNING", logger="fxquant"):
        lenient(x).sum().backward()
        with torch.no_grad():  # a new graph: not said again
            lenient(x)
    assert caplog.text.count("quantizes attention, but the compiled graphs hold no attention op") == 1
    caplog.clear()
    torch._dynamo.reset()
    with caplog.at_level("WARNING", logger="fxquant"):
        fxquant.compile(_EagerAttention(), "linear_mxfp8", backend="aot_eager", strict=True)(x)
        torch._dynamo.reset()  # a model without attention: its unmatched matmul is no attention's
        fxquant.compile(_TokenMixer(), "FA_linear_mxfp8", backend="aot_eager", strict=True)(x)
    assert "attention" not in caplog.text


def test_a_call_that_compiles_no_graph_is_an_error_under_strict_and_a_warning_otherwise(caplog):
    """Dynamo skips the frame (LSTM) and runs it eagerly: nothing is quantized, said on the first call."""
    x = torch.randn(3, 5, 32)
    torch._dynamo.reset()
    with pytest.raises(QuantizationError, match="the call of _LSTMHead compiled no graph.*LSTM"):
        fxquant.compile(_LSTMHead(), "linear_mxfp8", backend="aot_eager", strict=True)(x)
    torch._dynamo.reset()
    lenient = fxquant.compile(_LSTMHead(), "linear_mxfp8", backend="aot_eager")
    with caplog.at_level("WARNING", logger="fxquant"):
        lenient(x)
    assert "compiled no graph: Dynamo ran it eagerly, so nothing in it is quantized" in caplog.text
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="the call of _LSTMHead compiled no graph"):
        fxquant.explain(_LSTMHead(), x, scheme="linear_mxfp8")


def test_explain_lists_sites_and_unmatched_ops():
    text = str(fxquant.explain(WithSplit(), torch.randn(4, 32), scheme="linear_mxfp8"))
    assert "down_proj" in text and "fc2" in text and "x=mxfp8_e4m3" in text
    assert "unmatched matmul-like ops" in text and "matmul" in text


class _ThreeMatmuls(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 8, 8))
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        for i in range(3):
            x = x @ self.w[i]  # one source line, three unmatched matmuls
        return self.fc(x)


def test_explain_lists_each_call_of_a_repeated_unmatched_op_once_across_recompiles():
    model = _ThreeMatmuls()
    exp = fxquant.explain(model, torch.randn(2, 8), scheme="linear_mxfp8")
    assert len(exp.unmatched) == 3 and len({u.node_name for u in exp.unmatched}) == 3
    assert "3 matmul-like ops unmatched" in str(exp)
    torch._dynamo.reset()
    compiled = fxquant.compile(model, "linear_mxfp8", backend="aot_eager")
    compiled(torch.randn(2, 8))
    compiled(torch.randn(5, 8))  # a new batch size: a second graph holding the same three matmuls
    assert len(fxquant.compile_state(compiled).unmatched()) == 3


class _MatmulEitherSideOfABreak(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 8, 8))
        self.fc = torch.nn.Linear(8, 8)

    def mm(self, x, i):
        return x @ self.w[i]

    def forward(self, x):
        x = self.mm(x, 0)
        torch._dynamo.graph_break()
        x = self.mm(x, 1)  # the same source line of mm (and node name), in the resume function's graph
        return self.fc(x)


def test_unmatched_ops_of_two_frames_are_both_listed():
    compiled = fxquant.compile(_MatmulEitherSideOfABreak(), "linear_mxfp8", backend="aot_eager")
    compiled(torch.randn(2, 8))
    compiled(torch.randn(3, 8))  # recompiles both frames
    assert len(fxquant.compile_state(compiled).unmatched()) == 2


def test_explain_cli_bad_model_factory_is_a_clear_error(capsys):
    from fxquant.cli import main

    assert main(["explain", "--scheme", "bf16", "--model", "no_such_pkg.mod:make"]) == 2
    assert "cannot import 'no_such_pkg.mod'" in capsys.readouterr().err
    assert main(["explain", "--scheme", "bf16", "--model", "tests.models"]) == 2
    assert "expected 'package.module:factory'" in capsys.readouterr().err


def make_small_vocab_llama():
    """A model whose vocabulary (64) is smaller than the 128 the explain CLI used to assume."""
    return make_llama(vocab_size=64)


def test_explain_cli_takes_the_vocabulary_from_the_model(capsys):
    from fxquant.cli import main

    model = f"{__name__}:make_small_vocab_llama"
    assert main(["explain", "--scheme", "linear_hifp8", "--model", model, "--seq-len", "8"]) == 0
    assert "layers.0.mlp.down_proj" in capsys.readouterr().out
    assert main(["explain", "--scheme", "linear_hifp8", "--model", model, "--vocab", "128"]) == 2
    assert "--vocab 128 exceeds the model's embedding (64 rows)" in capsys.readouterr().err
    assert main(["explain", "--scheme", "linear_hifp8", "--model", model, "--batch", "0"]) == 2
    assert "--batch 0: must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_kernels_triton_without_the_kernels_is_refused_under_every_backend(backend):
    """On a CPU without the Triton kernels registered, kernels='triton' is refused whatever the backend: under
    eager (the graph interpreted) it ran without a word, while explain and the other backends refused it."""
    from fxquant import kernels

    if kernels.registered("cpu"):
        pytest.skip("the Triton kernels are registered for the CPU in this process")
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(ValueError, match="kernels='triton' needs the Triton kernels registered for 'cpu'"):
        fxquant.compile(model, "linear_mxfp8", backend=backend, kernels="triton")(torch.randn(4, 32))


def test_nvfp4_block_2d_on_activations_is_refused_naming_the_site():
    """block_2d tiles 2-D tensors (weights): a rule giving it to every operand of a linear with a 3-D input, or to
    attention, is refused at compile time naming the site and operands (it failed at the first call with the
    format's own message, no site named); a 2-D input takes it."""
    from fxquant.schemes import Scheme

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    tiled = Scheme.from_yaml_text("rules:\n  - linear: {format: nvfp4, block_2d: true}\n")
    model = fxquant.compile(torch.nn.Sequential(torch.nn.Linear(32, 32)), tiled, backend="aot_eager")
    with pytest.raises(Exception, match=r"site '0': fprop operand x is 3-D \(input shape \(2, 4, 32\)\).*block_2d"):
        model(torch.randn(2, 4, 32))
    torch._dynamo.reset()
    flat = fxquant.compile(torch.nn.Sequential(torch.nn.Linear(32, 32)), tiled, backend="aot_eager")
    flat(torch.randn(16, 32)).sum().backward()
    backward = Scheme.from_yaml_text("rules:\n  - linear: {format: nvfp4, dgrad: {block_2d: true}, wgrad: {block_2d: "
                                     "true}}\n")  # dgrad and wgrad take 2-D views of a 3-D input's operands
    torch._dynamo.reset()
    fxquant.compile(torch.nn.Sequential(torch.nn.Linear(32, 32)), backward, backend="aot_eager")(
        torch.randn(2, 4, 32)).sum().backward()
    attention = Scheme.from_yaml_text("rules:\n  - attention: {format: nvfp4, block_2d: true}\n")
    q = torch.randn(1, 2, 16, 16)
    with pytest.raises(Exception, match=r"site '<root>' \(attention\): operands qk.q, qk.k, .* have block_2d"):
        fxquant.compile(Attention(), attention, backend="aot_eager")(q, q, q)


class _LinearFn(torch.autograd.Function):
    """A user's own linear as an autograd.Function whose forward calls F.linear (Megatron's call torch.matmul)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        return (dy2 @ w).reshape(x.shape), dy2.t() @ x.reshape(-1, x.shape[-1])


class _FnLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(48, 32))

    def forward(self, x):
        return _LinearFn.apply(x, self.weight)


def test_an_autograd_function_linear_it_cannot_read_says_what_it_found():
    """The note said 'fwd_body has 1 matmul-like ops (expected one torch.matmul)' for a Function whose one GEMM is
    F.linear: it names the GEMM and what is recognised."""
    model = torch.nn.Sequential(_FnLinear(), torch.nn.Linear(48, 16))
    compiled = fxquant.compile(model, "linear_mxfp8", backend="aot_eager", strict=True)
    with pytest.raises(QuantizationError, match=r"selected linear site '0' .* was not rewritten: fwd_body's GEMM is "
                                                r"linear: an autograd.Function's linear is recognised when its forward "
                                                r"computes it with torch.matmul or mm"):
        compiled(torch.randn(2, 5, 32, requires_grad=True)).sum().backward()
