"""The custom ops ``fxquant::flash_attention`` (+ backward) and their use by ``fxquant.compile``.

- opcheck (schema, fake implementations and their strides, autograd registration, AOT dispatch);
- the op under torch.compile (aot_eager, Inductor) equals the op run eagerly, bit for bit, and equals
  ``flash_quantized_attention(impl="reference")``; the specs string round-trips every operand;
- the Triton implementation routed through the op (Triton's interpreter on CPU; compiled on a GPU) equals
  the reference within float32 accumulation tolerance;
- ``fxquant.compile``: ``FXQUANT_ATTENTION`` picks the flash op or ``quantized_sdpa`` per site; compiled ==
  eager bit for bit with the flash op; QK-only schemes agree with the math path up to rounding; sites
  the kernel cannot run fall back with the reason logged and kept in the site's note.
"""
from __future__ import annotations

import importlib
import logging

import pytest
import torch
import torch.nn.functional as F

import fxquant
from fxquant import schemes
from fxquant.counters import count_quantize_calls
from fxquant.formats.tensor_quant import TensorQuant
from fxquant.kernels.flash_attention import flash_quantized_attention
from fxquant.qfunctions import flash_sdpa as fs
from fxquant.schemes import AttentionQuant, GemmQuant, MatmulQuant, Site, SiteKind
from tests.models import make_llama, make_tokens
from tests.kernel_hooks import launches_of
from tests.test_compile import assert_bitwise, compiled_step

rewrite_sdpa = importlib.import_module("fxquant.passes.rewrite_sdpa")  # the package exports a function of that name
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def aq_of(preset: str) -> AttentionQuant:
    return schemes.get(preset).attention_for(Site.from_path("layers.0.self_attn", SiteKind.ATTENTION))


def mixed_aq() -> AttentionQuant:
    """Every operand a different TensorQuant, so a swapped pair in the specs string changes the result."""
    t = [TensorQuant("mxfp8_e4m3"), TensorQuant("mxfp8_e5m2"), TensorQuant("hifp8"), TensorQuant("mxfp4_e2m1"),
         TensorQuant("fp8_e4m3"), TensorQuant("mxfp6_e3m2"), TensorQuant("mxfp8_e4m3", rounding="ta"),
         TensorQuant("mxint8"), TensorQuant("fp8_e5m2"), TensorQuant("mxfp8_e4m3", scale_mode="rceil"),
         TensorQuant("mxfp6_e2m3"), TensorQuant("hifp8", rounding="rne")]
    g = [GemmQuant(t[i], t[i + 1]) for i in range(0, 12, 2)]
    return AttentionQuant(MatmulQuant(*g[:3]), MatmulQuant(*g[3:]))


def qkv(b=1, hq=4, hk=2, lq=40, lk=40, d=32, dv=32, dtype=torch.float32, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)  # noqa: E731
    return make(b, hq, lq, d), make(b, hk, lk, d), make(b, hk, lk, dv), make(b, hq, lq, dv)


def fwd_bwd(fn, q, k, v, do):
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = fn(*xs)
    o.backward(do)
    return [o.detach()] + [x.grad for x in xs]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


# -- the op ------------------------------------------------------------------------------------------------
def test_specs_round_trip_every_operand():
    aq = mixed_aq()
    assert fs.decode_specs(fs.encode_specs(aq)) == aq
    assert fs.decode_specs(fs.encode_specs(AttentionQuant())) == AttentionQuant()
    with pytest.raises(ValueError, match="12 operand specs"):
        fs.decode_specs("hifp8;hifp8")


def test_opcheck_forward_and_backward_ops():
    q, k, v, do = (t.requires_grad_() for t in qkv(lq=24, lk=40, d=16, dv=8))
    specs = fs.encode_specs(aq_of("FA_QKPV_mxfp8"))
    torch.library.opcheck(torch.ops.fxquant.flash_attention.default, (q, k, v, specs, True, 0.3, 64))
    o, lse = torch.ops.fxquant.flash_attention(q, k, v, specs, False, 0.3, 64)
    args = (q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), do.detach(), specs, False, 0.3, 64)
    torch.library.opcheck(torch.ops.fxquant.flash_attention_backward.default, args)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_op_under_torch_compile_equals_eager_bitwise(backend):
    aq = mixed_aq()
    q, k, v, do = qkv(lq=36, lk=40, dv=16)
    fn = lambda q, k, v: fs.flash_sdpa(q, k, v, True, 0.25, True, aq=aq) * 2.0  # noqa: E731
    eager = fwd_bwd(fn, q, k, v, do)
    compiled = fwd_bwd(torch.compile(fn, backend=backend, fullgraph=True), q, k, v, do)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref = fwd_bwd(lambda q, k, v: flash_quantized_attention(q, k, v, is_causal=True, scale=0.25, aq=aq,
                                                            impl="reference") * 2.0, q, k, v, do)
    for a, b in zip(eager, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_flash_sdpa_refuses_what_the_kernel_cannot_do():
    q, k, v, _ = qkv()
    with pytest.raises(ValueError, match="stochastic rounding"):
        fs.flash_sdpa(q, k, v, enable_gqa=True, aq=AttentionQuant(MatmulQuant(GemmQuant(TensorQuant("hifp8", rounding="sr")))))
    with pytest.raises(ValueError, match="enable_gqa=False"):
        fs.flash_sdpa(q, k, v, aq=AttentionQuant())
    q2, k2, v2, _ = qkv(d=160, dv=160)
    with pytest.raises(ValueError, match="<= 128"):
        fs.flash_sdpa(q2, k2, v2, enable_gqa=True, aq=AttentionQuant())
    assert "attn_mask" in fs.unsupported_reason(q, k, v, attn_mask=torch.ones(40, 40, dtype=torch.bool))
    assert "dropout" in fs.unsupported_reason(q, k, v, dropout_p=0.1)
    qb, kb, vb, _ = qkv(b=2)
    assert "broadcasts no dim" in fs.unsupported_reason(qb, kb[:1], vb[:1], enable_gqa=True)  # SDPA broadcasts B
    assert fs.unsupported_reason(qb, kb, vb, enable_gqa=True) is None
    with pytest.raises(ValueError, match="device='gpu'"):
        fs.register_triton("gpu")


# -- the Triton implementation through the op ----------------------------------------------------------------
@pytest.fixture
def triton_op():
    """The ops' Triton implementation on this device: CUDA (registered at import), or CPU in the interpreter.
    Yields the names of the flash kernels launched meanwhile (pre-run hooks of the kernels themselves)."""
    from fxquant.kernels import flash_attention_launch as fl
    from fxquant.kernels.flash_attention_kernels import _flash_bwd_dkdv_kernel, _flash_bwd_dq_kernel, _flash_fwd_kernel

    if DEVICE == "cpu":
        if not fl.interpreted():
            pytest.skip("the Triton kernels were imported for a GPU, not for the interpreter")
        fs.register_triton("cpu")
    try:
        with launches_of(_flash_fwd_kernel, _flash_bwd_dkdv_kernel, _flash_bwd_dq_kernel) as launches:
            yield launches
    finally:
        if DEVICE == "cpu":
            fs.restore_reference("cpu")


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
@pytest.mark.parametrize("preset", ["FA_QKPV_mxfp8", "FA_QKPV_hifp8"])
def test_triton_through_the_op_equals_reference(triton_op, preset):
    aq = aq_of(preset)
    q, k, v, do = qkv(b=1, hq=2, hk=1, lq=40, lk=72, d=32, dv=16, seed=3)
    got = fwd_bwd(lambda q, k, v: fs.flash_sdpa(q, k, v, True, None, True, aq=aq), q, k, v, do)
    # the op ran the Triton kernels, forward and both backward ones (the reference would equal itself)
    assert sorted(set(triton_op)) == ["_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel", "_flash_fwd_kernel"], triton_op
    ref = fwd_bwd(lambda q, k, v: flash_quantized_attention(q, k, v, is_causal=True, aq=aq, impl="reference"), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel(a, b) <= 1e-5, f"{name}: {rel(a, b)}"


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("d", [64, 128])
def test_op_on_gpu_real_sizes_equals_reference(d):
    aq = aq_of("FA_QKPV_mxfp8")
    q, k, v, do = qkv(b=2, hq=8, hk=2, lq=1024, lk=1024, d=d, dv=d, dtype=torch.bfloat16, device="cuda")
    got = fwd_bwd(lambda q, k, v: fs.flash_sdpa(q, k, v, True, None, True, aq=aq), q, k, v, do)
    ref = fwd_bwd(lambda q, k, v: flash_quantized_attention(q, k, v, is_causal=True, aq=aq, impl="reference"), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel(a, b) <= 4e-3, f"{name}: {rel(a, b)}"  # bf16 outputs: one rounding


# -- fxquant.compile -------------------------------------------------------------------------------------------
def sdpa_notes(model) -> list[str]:
    return [s.note for s in fxquant.compile_state(model).sites() if s.op.value == "sdpa" and s.selected]


def test_compile_flash_equals_eager_bitwise(monkeypatch):
    monkeypatch.setenv(rewrite_sdpa.ENV, "flash")
    tokens = [make_tokens(make_llama().cfg)]
    (ref,), _ = compiled_step("FA_QKPV_mxfp8", "eager", tokens)
    torch._dynamo.reset()
    (got,), model = compiled_step("FA_QKPV_mxfp8", "aot_eager", tokens)
    assert_bitwise(ref, got)
    assert sdpa_notes(model) == ["flash", "flash"]
    code = fxquant.compile_state(model).backend.reports[0].graph_module.code
    assert "fxquant_flash_sdpa" in code and "fxquant_sdpa(" not in code


def test_compile_qk_only_scheme_flash_agrees_with_math(monkeypatch):
    """QK^T quantized, PV not: the two paths compute the same quantized values; only float32 rounding (and
    so a rare quantization boundary) differs. The runtime counters see the linears' quantize calls only:
    the kernel quantizes attention's operands inside."""
    tokens = [make_tokens(make_llama().cfg)]
    monkeypatch.setenv(rewrite_sdpa.ENV, "math")
    (math_,), model = compiled_step("FA_linear_mxfp8", "aot_eager", tokens)
    assert all(n == "math: attention=math" for n in sdpa_notes(model))
    torch._dynamo.reset()
    monkeypatch.setenv(rewrite_sdpa.ENV, "flash")
    (flash,), model = compiled_step("FA_linear_mxfp8", "aot_eager", tokens)
    assert sdpa_notes(model) == ["flash", "flash"]
    with count_quantize_calls(model) as count:  # 7 linears x 2 layers; AOT's CSE shares X among q/k/v, gate/up
        model(tokens[0]).sum().backward()
    assert count.ok and (count.expected_forward, count.expected_backward) == (2 * (7 * 2 - 3), 2 * (7 * 4 - 3))
    torch.testing.assert_close(flash[1], math_[1], rtol=1e-4, atol=1e-4)
    for name in math_[2]:
        assert rel(flash[2][name], math_[2][name]) < 2e-3, name


def test_auto_on_cpu_keeps_quantized_sdpa(monkeypatch):
    monkeypatch.delenv(rewrite_sdpa.ENV, raising=False)
    tokens = [make_tokens(make_llama().cfg)]
    _, model = compiled_step("FA_QKPV_mxfp8", "aot_eager", tokens, n_layers=1)
    expected = "flash" if torch.cuda.is_available() else "math: attention=auto runs the flash kernel on CUDA only"
    assert [n.split(" (")[0] for n in sdpa_notes(model)] == [expected]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the auto fallback exists off CUDA only")
def test_auto_fallback_off_cuda_is_not_a_warning(monkeypatch, caplog):
    """attention=auto choosing quantized_sdpa on CPU is the documented behaviour: DEBUG, not WARNING."""
    monkeypatch.delenv(rewrite_sdpa.ENV, raising=False)
    q, k, v, _ = qkv(hq=2, hk=2, lq=8, lk=8, d=16, dv=16)
    with caplog.at_level(logging.DEBUG, logger="fxquant"):
        fxquant.compile(PlainAttention(), "FA_QKPV_mxfp8", backend="aot_eager")(q, k, v)
    fallback = [r for r in caplog.records if "not the flash kernel" in r.getMessage()]
    assert fallback and all(r.levelno == logging.DEBUG for r in fallback)


class MaskedAttention(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_unsupported_sites_fall_back_with_a_logged_reason(monkeypatch, caplog):
    monkeypatch.setenv(rewrite_sdpa.ENV, "flash")
    q, k, v, _ = qkv(hq=2, hk=2, lq=8, lk=8, d=16, dv=16)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    with caplog.at_level(logging.WARNING, logger="fxquant"):
        model = fxquant.compile(MaskedAttention(), "FA_QKPV_mxfp8", backend="aot_eager", strict=True)
        out = model(q, k, v, mask)
    assert sdpa_notes(model) == ["math: an attn_mask is given (the kernel offers the causal mask only)"]
    assert "runs quantized_sdpa, not the flash kernel: an attn_mask" in caplog.text
    torch.testing.assert_close(out, fxquant.qfunctions.quantized_sdpa(q, k, v, mask, aq=aq_of("FA_QKPV_mxfp8")), rtol=0, atol=0)


class PlainAttention(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_compile_argument_overrides_the_environment(monkeypatch):
    monkeypatch.setenv(rewrite_sdpa.ENV, "math")
    q, k, v, _ = qkv(hq=2, hk=2, lq=8, lk=8, d=16, dv=16)
    for choice, note in (("flash", "flash"), ("math", "math: attention=math")):
        torch._dynamo.reset()
        model = fxquant.compile(PlainAttention(), "FA_QKPV_mxfp8", backend="aot_eager", attention=choice)
        model(q, k, v)
        assert sdpa_notes(model) == [note]
    with pytest.raises(ValueError, match=r"attention='flsh'.*did you mean 'flash'"):
        fxquant.compile(PlainAttention(), "FA_QKPV_mxfp8", attention="flsh")


def test_bad_environment_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(rewrite_sdpa.ENV, "flsh")
    with pytest.raises(ValueError, match=r"FXQUANT_ATTENTION='flsh'.*did you mean 'flash'"):
        rewrite_sdpa.attention_impl()


@pytest.mark.gpu
def test_compile_on_gpu_runs_the_kernel_and_inductor_equals_eager(monkeypatch):
    monkeypatch.delenv(rewrite_sdpa.ENV, raising=False)

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    q, k, v, do = qkv(b=2, hq=8, hk=2, lq=512, lk=512, d=64, dv=64, dtype=torch.bfloat16, device="cuda")
    outs = {}
    for backend in ("eager", "inductor"):
        torch._dynamo.reset()
        model = fxquant.compile(Attn(), "FA_QKPV_mxfp8", backend=backend, strict=True)
        outs[backend] = fwd_bwd(model, q, k, v, do)
        assert sdpa_notes(model) == ["flash"]
    for a, b in zip(outs["inductor"], outs["eager"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_no_keys_is_no_flash_site_and_gives_sdpa_zeros():
    """Lk = 0: SDPA gives zeros; the kernel's normaliser would be 0 (NaN), so the site is left to the math path."""
    import torch.nn.functional as F

    import fxquant

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 0, 8), torch.randn(1, 2, 0, 8)
    assert "key length 0" in fs.unsupported_reason(q, k, v)
    model = fxquant.compile(Attention(), "FA_mxfp8_e4m3", backend="aot_eager", attention="flash")
    out = model(q, k, v)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v)) and not out.any()


def test_empty_batch_with_grouped_heads_runs_backward_and_empty_heads_are_refused():
    """B = 0 with GQA: the reference backward gives empty gradients of the inputs' shapes, as SDPA does. A head
    dim or head count of 0 is a refusal (a ValueError naming the shapes, and no flash site), not a crash."""
    q, k, v = (torch.randn(s, requires_grad=True) for s in ((0, 4, 8, 16), (0, 2, 8, 16), (0, 2, 8, 16)))
    for out in (fs.flash_sdpa(q, k, v, enable_gqa=True, aq=AttentionQuant()),
                flash_quantized_attention(q, k, v, aq=AttentionQuant(), impl="reference")):
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.zeros_like(out))
        assert (out.shape, dq.shape, dk.shape, dv.shape) == (q.shape, q.shape, k.shape, v.shape)
    for shapes in (((1, 2, 4, 0), (1, 2, 4, 0), (1, 2, 4, 8)), ((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 0)),
                   ((1, 0, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8))):
        q, k, v = (torch.randn(s) for s in shapes)
        assert "head dims >= 1" in fs.unsupported_reason(q, k, v, enable_gqa=True)
        with pytest.raises(ValueError, match="head dims >= 1"):
            fs.flash_sdpa(q, k, v, enable_gqa=True, aq=AttentionQuant())
