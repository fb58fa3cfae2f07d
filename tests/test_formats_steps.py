"""The traced element rounding (``ElementSpec.quantize_steps``: ``_bits.round_nearest_bits`` for round to nearest
even on a uniform grid, ``_bits.ufp`` + ``_bits.round_to_step`` otherwise, what ``fxquant.lowering`` compiles)
equals the float32 bit arithmetic of the eager reference (``quantize_arith``).

- ``ufp`` on every float32 of the binade [1, 2) and the ends and a sample of every binade of its range: float32
  multiplication and addition are scale-invariant away from underflow and overflow, so one binade in full plus
  every binade's ends covers the range. Eager and compiled by Inductor (C++).
- ``round_nearest_bits`` (Veltkamp's splitting) against ``round_to_step`` with ``ufp``'s step, eager and compiled.
- ``grid_step`` against ``mantissa_bits`` for every binade of every element format.
- ``quantize_steps`` against ``quantize_arith`` for every element format, rounding mode and saturation, on every
  bf16 and fp16 pattern, every float32 within 40 ulps of every rounding midpoint, every float32 of two whole
  binades, random float32 bit patterns and the specials; eager and compiled (on the GPU too, where there is one).
"""
from __future__ import annotations

import math

import pytest
import torch

from fxquant.formats._bits import round_integer, round_nearest_bits, round_to_step, ufp, uniforms
from fxquant.formats.element import BF16, E2M1, E2M3, E3M2, E4M3, E5M2, FP16, HIF8, INT8
from tests.bitwise import assert_bitwise_equal, assert_lowered, op_calls
from tests.test_formats_exhaustive import every_pattern, near_ties

STEP_SPECS = [E4M3, E5M2, E3M2, E2M3, E2M1, HIF8, INT8, FP16]  # binades within ufp's range
ALL_SPECS = [*STEP_SPECS, BF16]  # bf16: rounded scaled by 2**64 / 2**-64 outside [2**-60, 2**60)
ROUNDINGS = ("rne", "ta", "rz", "sr")


def binade(e: int, mantissas: torch.Tensor) -> torch.Tensor:
    """float32 values 2**e * (1 + m * 2**-23) for int32 mantissa fields ``m``."""
    return (((e + 127) << 23) | mantissas).view(torch.float32)


def every_mantissa() -> torch.Tensor:
    return torch.arange(1 << 23, dtype=torch.int32)


def test_ufp_on_every_float32_of_one_binade_and_the_ends_of_all():
    ends = torch.cat([torch.tensor([0, 1, 2, (1 << 23) - 2, (1 << 23) - 1], dtype=torch.int32),
                      torch.randint(0, 1 << 23, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)])
    compiled = torch.compile(ufp, backend="inductor", dynamic=False)
    a = binade(0, every_mantissa())
    assert_bitwise_equal(ufp(a), torch.ones_like(a), "ufp on [1, 2):")
    assert_bitwise_equal(compiled(a), torch.ones_like(a), "compiled ufp on [1, 2):")
    xs = torch.cat([binade(e, ends) for e in range(-126, 104)])
    want = torch.cat([torch.full((ends.numel(),), 2.0**e) for e in range(-126, 104)])
    assert_bitwise_equal(ufp(xs), want, "ufp over [2**-126, 2**104):")
    assert_bitwise_equal(compiled(xs), want, "compiled ufp over [2**-126, 2**104):")
    assert torch.isnan(ufp(torch.tensor([math.nan]))).all()


@pytest.mark.parametrize("spec", STEP_SPECS, ids=lambda s: s.name)
def test_grid_step_agrees_with_mantissa_bits(spec):
    es = torch.arange(spec.emin, spec.emax + 2, dtype=torch.int32)
    m = torch.as_tensor(spec.mantissa_bits(es), dtype=torch.int32).expand_as(es)
    want = torch.tensor([2.0 ** (e - k) for e, k in zip(es.tolist(), m.tolist())])
    binades = torch.tensor([2.0**e for e in es.tolist()])
    for a in (binades, binades * 1.5, binades * (2 - 2**-23)):  # every value of each binade gives its step
        assert_bitwise_equal(spec.grid_step(binades, a), want, f"{spec.name} grid steps:")


def test_steps_cover_every_format_but_bf16_unscaled():
    from fxquant.formats.element import ELEMENTS

    assert all(s.steps_in_range() for s in STEP_SPECS)
    assert not BF16.steps_in_range()  # its binades reach 2**128 and its steps 2**-133: quantize_steps rescales
    assert set(ELEMENTS.values()) == set(ALL_SPECS)  # every element format is tested below


def test_round_to_step_equals_round_integer():
    """Every float32 of [1, 2) rounded to steps 2**-1 .. 2**-22 (every position of the cut within the mantissa),
    per mode, against round_integer(a / step) * step."""
    a = binade(0, every_mantissa()[::7])
    u = uniforms(a.numel(), 11, a.device)
    for k in range(1, 23):
        step = torch.full_like(a, 2.0**-k)
        for rounding in ROUNDINGS:
            want = round_integer(a * 2.0**k, rounding, u) * 2.0**-k
            assert_bitwise_equal(round_to_step(a, step, rounding, u), want, f"step 2**-{k} {rounding}:")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bounded", [False, True])
def test_round_nearest_bits_equals_rounding_to_the_binades_step(bounded, device):
    """Veltkamp's splitting, ties to even and away, against ``round_to_step`` with the step from ``ufp``, eager and
    compiled by Inductor (C++ on ``cpu``; Triton on ``cuda``, where ptxas may contract a product and a sum into
    one FMA: the splitting's product by 2**(23 - m) is exact, so that changes nothing; ties away at the element
    formats' widths):
    every float32 of [1, 2) (a sixth of them: every mantissa residue mod 6) for every mantissa width 0..22, the ends
    and a sample of every binade of [2**-126, 2**100) for the widths of the element formats, with emin and emax
    placed so that both the fixed step below 2**emin and the clamp above 2**(emax + 1) are reached; specials."""
    gen = torch.Generator().manual_seed(2)
    ends = torch.cat([torch.tensor([0, 1, 2, (1 << 22) - 1, 1 << 22, (1 << 22) + 1, (1 << 23) - 2, (1 << 23) - 1],
                                   dtype=torch.int32),
                      torch.randint(0, 1 << 23, (512,), generator=gen, dtype=torch.int32)])
    spread = torch.cat([binade(e, ends) for e in range(-126, 100)]
                       + [torch.tensor([0.0, 1e-45, 2.0**-127, 2.0**100, math.nan])])

    def want(a, mbits, emin, emax, ties_away):
        binades = ufp(torch.clamp(a, 2.0**emin, 2.0 ** (emax + 1)))
        return round_to_step(a, binades * 2.0**-mbits, "ta" if ties_away else "rne", None)

    def check(a, mbits, emin, emax, label, *, compile_ta):
        for ties_away in (False, True):
            mine = f"{label} {'ta' if ties_away else 'rne'}"
            got = round_nearest_bits(a, mbits, emin, emax, bounded=bounded, ties_away=ties_away)
            expected = want(a, mbits, emin, emax, ties_away)
            top = 2.0 ** (emax + 1)
            above = expected > top  # there only "at least 2**(emax + 1)" is promised
            assert (got[above] >= top).all(), f"{mine}: a value rounding above 2**(emax + 1) rounded to {got[above].min()}"
            assert_bitwise_equal(got[~above], expected[~above], mine)
            if compile_ta or not ties_away:
                compiled = torch.compile(lambda t: round_nearest_bits(t, mbits, emin, emax, bounded=bounded,
                                                                      ties_away=ties_away),
                                         backend="inductor", dynamic=False)
                assert_bitwise_equal(compiled(a.to(device)).cpu(), got, f"compiled on {device} {mine}")

    one = binade(0, every_mantissa()[::6])
    for mbits in range(23):  # ties away compiled at the element formats' widths
        check(one, mbits, -10, 40, f"[1, 2) on {mbits} bits:", compile_ta=mbits in (1, 2, 3, 6, 10))
    for mbits, emin, emax in ((1, 0, 2), (2, -14, 15), (3, -6, 8), (6, 0, 0), (10, -14, 15), (3, -30, 60)):
        check(spread, mbits, emin, emax, f"{mbits} bits, binades {emin}..{emax}:", compile_ta=True)


def inputs(spec) -> torch.Tensor:
    """Every bf16 and fp16 pattern, 40 ulps around every midpoint of the format's grid, every float32 of the binade
    holding max_normal and of the lowest normal binade, random float32 bit patterns, specials."""
    gen = torch.Generator().manual_seed(5)
    rnd = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int32).view(torch.float32)
    whole = [binade(spec.emax, every_mantissa()[::3]), binade(spec.emin, every_mantissa()[1::3])]
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, 3.4e38, -3.4e38, spec.max_normal,
                             -spec.max_normal, spec.min_subnormal, spec.min_subnormal / 2])
    return torch.cat([every_pattern(torch.bfloat16), every_pattern(torch.float16), near_ties(spec), *whole, rnd,
                      specials])


def cases(spec) -> list[tuple[str, bool]]:
    return [(r, sat) for r in ROUNDINGS for sat in ((True, False) if spec.has_inf else (True,))]


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_quantize_steps_equals_bit_arithmetic(spec):
    x = inputs(spec)
    u = uniforms(x.numel(), 3, x.device)
    for rounding, sat in cases(spec):
        uu = u if rounding == "sr" else None
        for finite in (False, True):
            kept = x.abs() <= 2.0**100  # what finite=True promises (no NaN/Inf, no huge value)
            xs = x[kept] if finite else x
            us = uu[kept] if finite and uu is not None else uu
            want = spec.quantize_arith(xs, rounding, sat, us, finite=finite)
            got = spec.quantize_steps(xs, rounding, sat, us, finite=finite)
            assert_bitwise_equal(got, want, f"{spec.name} {rounding} saturate={sat} finite={finite}:")


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_compiled_element_quantize_equals_eager(spec, device):
    """Traced, ``ElementSpec.quantize`` takes ``quantize_steps``; Inductor's code (C++ on ``cpu``, Triton on
    ``cuda``) equals the eager bit path on the CPU."""
    x = inputs(spec)
    u = uniforms(x.numel(), 3, x.device)
    specs = cases(spec)

    def fn(x, u):
        return tuple(spec.quantize(x, r, sat, u if r == "sr" else None) for r, sat in specs)

    got = torch.compile(fn, backend="inductor", dynamic=False)(x.to(device), u.to(device))
    for (rounding, sat), y in zip(specs, got):
        want = spec.quantize_arith(x, rounding, sat, u if rounding == "sr" else None)
        assert_bitwise_equal(y.cpu(), want, f"compiled on {device} {spec.name} {rounding} saturate={sat}:")


@pytest.mark.parametrize("name", ["hifp8", "fp8_e4m3", "fp8_e5m2", "bf16", "mxfp8_e4m3", "mxfp4_e2m1", "nvfp4"])
def test_lowered_element_rounding_reads_no_bits(name):
    """What makes the lowered quantize fast on CPU: no per-element float/int reinterpretation and no float8
    conversion, which Inductor's vectorised C++ does element by element through a buffer (``tmpbuf``). A block
    format's per-block stage (``fxquant::block_scales``, one value per block) may read the exponent of its amax;
    its per-element stage (``fxquant::block_values``, compiled alone here) does not."""
    from torch._inductor.utils import run_and_get_code

    import fxquant.ops  # noqa: F401  (defines the op)
    from fxquant import formats, lowering
    from fxquant.formats.tensor_quant import TensorQuant

    spec = TensorQuant(name).spec()
    fn = torch.compile(lambda t: torch.ops.fxquant.quantize(t, spec, -1, None), backend=lowering.inductor_backend)
    x = torch.randn(8, 256).to(torch.bfloat16)
    out, (code,) = run_and_get_code(fn, x)
    assert_bitwise_equal(out, TensorQuant(name).quantize(x))
    assert_lowered(code, [spec], "cpu", name)  # else the code above is the op's call: nothing to read for bits
    assert "Float8" not in code
    fmt = formats.get(name)
    if fmt.block_size is None:
        assert "bit_cast" not in code, code
        return
    xb = x.reshape(8, -1, fmt.block_size)
    amax = xb.abs().amax(-1, keepdim=True).float()
    inv, scale = fmt.block_scales(amax, amax.amax().expand(amax.shape) if name == "nvfp4" else None, fmt.resolve())

    def values(xb, inv, scale):
        return torch.ops.fxquant.block_values(xb, inv.expand(xb.shape), scale.expand(xb.shape), None, name, "rne")

    out, (code,) = run_and_get_code(torch.compile(values, backend="inductor", dynamic=False), xb, inv, scale)
    assert_bitwise_equal(out.reshape(x.shape).to(x.dtype), TensorQuant(name).quantize(x))
    assert not op_calls(code, "block_values"), "block_values left as the op: nothing generated to read for bits"
    assert "bit_cast" not in code and "Float8" not in code, code


def test_traced_stage_ops_pass_opcheck():
    v = torch.randn(6, 40) * 100
    u = uniforms(v.numel(), 9, v.device).reshape(v.shape)
    op = torch.ops.fxquant.round_elements.default
    for args in ((v, None, "hif8", "ta", True, False), (v, u, "e4m3", "sr", True, True),
                 (v.t(), None, "e5m2", "rne", False, False)):
        torch.library.opcheck(op, args)
    xb = v.reshape(6, 5, 8).to(torch.bfloat16)
    amax = xb.abs().amax(-1, keepdim=True).float()
    t = amax.amax().expand(amax.shape)
    op = torch.ops.fxquant.block_scales.default
    for args in ((amax, None, "mxfp8_e4m3", "rne", "floor"), (amax, None, "mxfp4_e2m1", "sr", "rceil"),
                 (amax, t, "nvfp4", "rne", None)):
        torch.library.opcheck(op, args)
    inv = torch.exp2(-torch.floor(torch.log2(amax))).expand(xb.shape)
    scale = (1 / inv).expand(xb.shape)
    op = torch.ops.fxquant.block_values.default
    for args in ((xb, inv, scale, None, "mxfp8_e4m3", "rne"),
                 (xb.float(), inv, scale, u.reshape(6, 5, 8), "mxfp4_e2m1", "sr"),
                 (xb.float(), inv, scale, None, "nvfp4", "rne")):
        torch.library.opcheck(op, args)


def test_block_stage_ops_equal_quantize():
    """``fxquant::block_scales`` then ``fxquant::block_values`` (scales broadcast, as a traced quantize records
    them) give ``Format.quantize`` bit for bit: normal, subnormal, NaN- and Inf-carrying, all-zero blocks, and
    NVFP4 tensors too small for its scale arithmetic (all zeros) or carrying a NaN (all NaN)."""
    from fxquant import formats

    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 64, generator=g) * torch.pow(2.0, torch.empty(12, 64).uniform_(-30, 30, generator=g))
    x[1, 3], x[2, 40], x[3] = float("nan"), float("inf"), 0.0
    x[4] = x[4] * 2.0**-140
    for name in ("mxfp8_e4m3", "mxfp4_e2m1", "mxint8", "nvfp4"):
        fmt = formats.get(name)
        mode = None if name == "nvfp4" else "floor"
        for rows in (x, x[4:5], x[3:4], x[5:]):
            xb = rows.reshape(rows.shape[0], -1, fmt.block_size)
            amax = xb.abs().amax(-1, keepdim=True)
            t = amax.amax().expand(amax.shape) if name == "nvfp4" else None
            inv, scale = (s.expand(xb.shape) for s in torch.ops.fxquant.block_scales(amax, t, name, "rne", mode))
            got = torch.ops.fxquant.block_values(xb, inv, scale, None, name, "rne").reshape(rows.shape)
            assert_bitwise_equal(got, fmt.quantize(rows), name)


def test_every_stage_lowers_as_one_pointwise():
    """The traced graph of every element rounding and every block format's stage, for every option, uses only ops
    ``pointwise_lowering`` maps (none falls back to Inductor's op-by-op lowering)."""
    from fxquant import formats, pointwise_lowering
    from fxquant.formats.element import ELEMENTS

    for name, spec in ELEMENTS.items():
        for rounding, sat in cases(spec):
            for finite in (False, True):
                gm = pointwise_lowering.elements_graph(name, rounding, sat, finite, rounding == "sr")
                assert pointwise_lowering.supported(gm), (name, rounding, sat, finite)
    f32, bf16 = torch.float32, torch.bfloat16
    for name in formats.names():
        fmt = formats.get(name)
        if fmt.block_size is None:
            continue
        modes = [None] if name == "nvfp4" else ["floor", "ceil", "rceil", "even"]
        for rounding in ROUNDINGS:
            for mode in modes:
                gm = pointwise_lowering.scale_graph(name, rounding, mode, f32, name == "nvfp4")
                assert pointwise_lowering.supported(gm), (name, rounding, mode)
            for x_dtype in (f32, bf16):
                gm = pointwise_lowering.block_graph(name, rounding, x_dtype, rounding == "sr")
                assert pointwise_lowering.supported(gm), (name, rounding, x_dtype)


@pytest.mark.slow
def test_pointwise_lowering_op_by_op_fallback_equals_reference(monkeypatch):
    """Where the one-pointwise lowering cannot take a graph (an ATen op outside its table), Inductor's own
    lowerings run the same traced graph: same values."""
    import fxquant.ops  # noqa: F401  (defines the op)
    from fxquant import pointwise_lowering, lowering
    from fxquant.formats.tensor_quant import TensorQuant

    monkeypatch.setattr(pointwise_lowering, "supported", lambda gm: False)
    specs = [TensorQuant("hifp8").spec(), TensorQuant("mxfp8_e4m3", rounding="sr").spec()]
    x = inputs(HIF8)[: 1 << 16].reshape(-1, 64)

    def fn(t):
        return tuple(torch.ops.fxquant.quantize(t, s, -1, 5) for s in specs)

    torch._dynamo.reset()
    got = torch.compile(fn, backend=lowering.inductor_backend)(x)
    for s, y in zip(specs, got):
        assert_bitwise_equal(y, TensorQuant.from_spec(s).quantize(x, -1, seed=5), s)


@pytest.mark.slow
def test_formats_compile_under_dynamo_without_a_graph_break():
    """``torch.compile(fullgraph=True)`` of code that calls ``Format.quantize`` (every format, defaults and SR):
    one graph, Inductor-generated kernels (no fxquant op left in the code), values equal to eager."""
    from torch._inductor.utils import run_and_get_code

    from fxquant import formats

    names = formats.names()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(48, 96, generator=g) * torch.pow(2.0, torch.empty(48, 96).uniform_(-20, 20, generator=g))

    def fn(t):
        return tuple(formats.get(n).quantize(t, rounding=r, seed=4) for n in names for r in (None, "sr"))

    got, codes = run_and_get_code(torch.compile(fn, fullgraph=True), x)
    assert "torch.ops.fxquant" not in "\n".join(codes)
    want = fn(x)
    for (n, r), y, w in zip([(n, r) for n in names for r in (None, "sr")], got, want):
        assert_bitwise_equal(y, w, f"{n} rounding={r}:")
