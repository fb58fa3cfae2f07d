"""HF GPT-2's ``Conv1D`` under fxquant.compile: ``torch.addmm(bias, x.view(-1, K), weight)`` with weight [in, out]
is a linear site of the module's path (``sites.is_conv1d_addmm``), quantized as the linear with weight
``weight.t()`` (FORMATS.md "Which dimension is blocked"), written out here with ``fxquant.formats`` directly:

    y  = addmm(b, q(X, K), q(W^T, K)^T)         X flattened to [M, K], W [K, N]
    dX = q(dY, N) @ q(W^T, N)
    dW = (q(dY, M)^T @ q(X, M))^T

The module is reproduced with the code transformers runs (transformers is no test dependency).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxquant
from fxquant.counters import count_quantize_calls
from fxquant.passes.sites import OpKind
from fxquant.passes.strict import QuantizationError
from tests.bitwise import assert_bitwise_equal
from tests.test_compile_formulas import M0, M1, K, N, q, seeded_step, spread


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a linear with its weight stored transposed, [nx, nf] = [in, out]."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class Attn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_attn = Conv1D(3 * d, d)
        self.c_proj = Conv1D(d, d)

    def forward(self, x):
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        return self.c_proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(4 * d, d)
        self.c_proj = Conv1D(d, 4 * d)

    def forward(self, x):
        return self.c_proj(torch.nn.functional.gelu(self.c_fc(x)))


class Block(nn.Module):
    """GPT2Block's GEMMs: attn.c_attn (qkv), attn.c_proj (proj), mlp.c_fc (fc1), mlp.c_proj (fc2)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.attn = Attn(d)
        self.mlp = Mlp(d)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class OneConv1D(nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(n, k)

    def forward(self, x):
        return self.c_fc(x)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_conv1d_mxfp8_equals_hand_formulas_with_block_axes(backend):
    fmt = "mxfp8"
    model = OneConv1D(K, N)
    x, dy = seeded_step(model.c_fc)
    compiled = fxquant.compile(model, "linear_mxfp8", backend=backend, strict=True)
    compiled(x).backward(dy)  # compiles
    x.grad = model.c_fc.weight.grad = model.c_fc.bias.grad = None
    with count_quantize_calls(compiled) as n:
        y = compiled(x)
        y.backward(dy)
    assert n.ok and n.executed == n.expected == 6  # X, W in fprop; dY, W in dgrad; dY, X in wgrad
    (site,) = fxquant.compile_state(compiled).sites()
    assert (site.site.module_path, site.site.kind.value, site.op, site.status.value) == (
        "c_fc", "fc1", OpKind.MODULE_MATMUL, "rewritten")
    assert not fxquant.compile_state(compiled).unmatched()

    w, b = model.c_fc.weight.detach(), model.c_fc.bias.detach()
    x2, dy2 = x.detach().reshape(-1, K), dy.reshape(-1, N)
    wt = w.t()  # the [N, K] weight of the same linear
    assert_bitwise_equal(y.detach(), torch.addmm(b, q(x2, fmt, 1), q(wt, fmt, 1).t()).view(M0, M1, N), "y")
    assert_bitwise_equal(x.grad, (q(dy2, fmt, 1) @ q(wt, fmt, 0)).view(x.shape), "dX")  # dY, W along N
    assert_bitwise_equal(model.c_fc.weight.grad, (q(dy2, fmt, 0).t() @ q(x2, fmt, 0)).t(), "dW")  # along M
    torch.testing.assert_close(model.c_fc.bias.grad, dy2.sum(0), rtol=1e-5, atol=0)
    # the weight blocked along its other axis (its stored rows) gives another answer, in fprop and in dgrad
    assert not torch.equal(y.detach(), torch.addmm(b, q(x2, fmt, 1), q(w, fmt, 1)).view(M0, M1, N))
    assert not torch.equal(x.grad, (q(dy2, fmt, 1) @ q(w, fmt, 0).t()).view(x.shape))


def test_gpt2_block_sites_kinds_and_high_precision_bits():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 16, 64)
    exp = fxquant.explain(model, x, scheme="linear_mxfp8")
    linear = {s.site.module_path: (s.site.kind.value, s.selected) for s in exp.sites if s.op is OpKind.MODULE_MATMUL}
    assert linear == {"attn.c_attn": ("qkv", True), "attn.c_proj": ("proj", True), "mlp.c_fc": ("fc1", True),
                      "mlp.c_proj": ("fc2", True)}
    assert not exp.unmatched
    torch._dynamo.reset()
    compiled = fxquant.compile(model, "bf16", backend="aot_eager", strict=True)  # nothing quantized: torch's bits
    assert_bitwise_equal(compiled(x), model(x), "bf16 output")


class SkippedConv1D(OneConv1D):
    def __init__(self, k: int, n: int) -> None:
        super().__init__(k, n)
        self.fc = nn.Linear(n, n)

    def forward(self, x):
        return self.fc(torch._dynamo.disable(self.c_fc)(x))


def test_conv1d_outside_the_compiled_graphs_fails_strict_coverage():
    x = torch.randn(2, 8, K)
    compiled = fxquant.compile(SkippedConv1D(K, N), "linear_mxfp8", backend="aot_eager", strict=True)
    with pytest.raises(QuantizationError, match="selected fc1 site 'c_fc' was not rewritten"):
        compiled(x)


class TwoConv1D(nn.Module):
    """c_fc quantized by ``linear_mxfp8``, c_proj kept in high precision by the rule below."""

    def __init__(self) -> None:
        super().__init__()
        self.c_fc = Conv1D(N, K)
        self.c_proj = Conv1D(K, N)

    def forward(self, x):
        return self.c_proj(torch.relu(self.c_fc(x)))


CONV1D_CAPTURE = """
sections:
  - points:
      - {component: linear, roles: [input, weight, output, grad_output, grad_input, grad_weight]}
      - {component: linear, roles: [input, weight, grad_output], copies: [quantized]}
"""


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_capture_at_conv1d_sites_sees_the_linear_operands(tmp_path, backend):
    """Captured as the linear each Conv1D is: input, output and their gradients as the addmm's [M, K] / [M, N],
    the weight and its gradient as [out, in] (the parameter transposed), quantized copies as the GEMMs consume
    them; at the quantized site and at the one a rule keeps in high precision alike, equal to the eager
    computation bit for bit."""
    from fxquant import capture
    from fxquant.schemes.yaml_io import load_text

    fmt = "mxfp8"
    model = TwoConv1D()
    with torch.no_grad():
        for i, m in enumerate((model.c_fc, model.c_proj)):
            m.weight.copy_(spread(*m.weight.shape, seed=10 + i))
    scheme = load_text("rules:\n  - linear: mxfp8\n  - match: {modules: c_proj}\n    priority: 1\n    linear: none\n")
    spec = capture.load_spec("c.yaml", text=CONV1D_CAPTURE)
    x = spread(M0, M1, K, seed=0).requires_grad_()
    compiled = fxquant.compile(model, scheme, capture=spec, capture_dir=tmp_path, backend=backend, strict=True)
    compiled(x).sum().backward()
    state = fxquant.compile_state(compiled)
    assert {(s.site.module_path, s.status.value) for s in state.sites()} == {("c_fc", "rewritten"),
                                                                             ("c_proj", "high")}
    state.capture_session.close()

    # the eager computation, written out
    w1, b1 = model.c_fc.weight.detach(), model.c_fc.bias.detach()
    w2, b2 = model.c_proj.weight.detach(), model.c_proj.bias.detach()
    x2 = x.detach().reshape(-1, K)
    h = torch.addmm(b1, q(x2, fmt, 1), q(w1.t(), fmt, 1).t())
    a = torch.relu(h)
    dy2 = torch.ones(M0 * M1, K)  # d(sum) / d(c_proj's output)
    da = dy2 @ w2.t()  # c_proj's dgrad, high precision: [M, N]
    dh = torch.where(h > 0, da, 0.0)  # relu's backward
    want = {
        ("c_fc", "input"): x2, ("c_fc", "weight"): w1.t(), ("c_fc", "output"): h,
        ("c_fc", "grad_output"): dh, ("c_fc", "grad_input"): q(dh, fmt, 1) @ q(w1.t(), fmt, 0),
        ("c_fc", "grad_weight"): q(dh, fmt, 0).t() @ q(x2, fmt, 0),
        ("c_proj", "input"): a, ("c_proj", "weight"): w2.t(), ("c_proj", "output"): torch.addmm(b2, a, w2),
        ("c_proj", "grad_output"): dy2, ("c_proj", "grad_input"): da, ("c_proj", "grad_weight"): dy2.t() @ a,
    }
    cs = capture.open(tmp_path)
    hp = {(r.module, r.role): cs.load(r, check=True) for r in cs.query(copy="hp")}
    assert set(hp) == set(want)
    for key, t in hp.items():
        if backend == "aot_eager" or key[1] in ("input", "weight") and key[0] == "c_fc":
            assert_bitwise_equal(t, want[key], f"{key}")
        else:  # Inductor's GEMM and pointwise code: the same values up to its own rounding
            torch.testing.assert_close(t, want[key], rtol=1e-4, atol=1e-4 * float(want[key].abs().max()))
    quantized = cs.query(copy="quantized")
    assert {r.module for r in quantized} == {"c_fc"}
    assert {(r.role, r.gemm) for r in quantized} == {("input", "fprop"), ("input", "wgrad"), ("weight", "fprop"),
                                                     ("weight", "dgrad"), ("grad_output", "dgrad"),
                                                     ("grad_output", "wgrad")}
    for rec in quantized:  # the operand each GEMM consumed: the captured tensor quantized along its reduction dim
        assert rec.blocked_dim == {"fprop": 1, "dgrad": 1 if rec.role == "grad_output" else 0, "wgrad": 0}[rec.gemm]
        src = hp[("c_fc", rec.role)]
        assert_bitwise_equal(cs.load(rec), q(src, fmt, rec.blocked_dim), f"{rec.role} {rec.gemm}")
    # c_proj keeps every operand in high precision: its quantized copies are listed, not captured
    assert sorted(state.uncapturable()) == sorted(
        f"c_proj (module_matmul): linear.{role}[quantized]: kept in high precision by the scheme (no quantized copy)"
        for role in ("input", "weight", "grad_output"))


class NotHFConv1D(nn.Module):
    """A model's own 1-D convolution block that happens to be called Conv1D: not a linear site."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


NotHFConv1D.__name__ = "Conv1D"


def test_a_convolution_class_named_conv1d_is_no_linear_site():
    model = nn.Sequential(NotHFConv1D(), nn.Flatten(), nn.Linear(32, 8))
    compiled = fxquant.compile(model, "linear_mxfp8", backend="aot_eager", strict=True)
    compiled(torch.randn(2, 4, 8))  # strict: no selected site left unrewritten
    assert [s.site.module_path for s in fxquant.compile_state(compiled).sites()] == ["2"]
