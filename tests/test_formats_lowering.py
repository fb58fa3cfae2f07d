"""``fxquant::quantize`` lowered for Inductor (``fxquant.lowering``, ``kernels="inductor"``) equals the
reference bit for bit: every format, rounding mode, scale mode, saturation and tensor-scaling option, over
every bf16 and fp16 bit pattern (NaN, Inf and subnormals included), boundary blocks, partial blocks, other
dims, input dtypes and hypothesis-drawn values; plus the exactness arguments the lowering relies on.

Inductor compiles one graph per test holding many quantize calls (C++ codegen on CPU), so the whole sweep
costs a few compiles, not one per option.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxquant.ops  # noqa: F401  (defines the op)
from fxquant import formats, lowering
from fxquant.formats._bits import fdiv, fdiv_wide, seed_key, uniforms
from fxquant.formats.tensor_quant import TensorQuant
from tests.bitwise import assert_bitwise_equal, assert_lowered, generated_code
from tests.test_formats_exhaustive import every_pattern

pytestmark = pytest.mark.slow

ROUNDINGS = ("rne", "ta", "sr", "rz")
MX = [n for n in formats.names() if n.startswith("mx")]
SEED = 7


def all_specs() -> list[str]:
    """One spec per distinct arithmetic path of the reference (FORMATS.md options)."""
    specs = [TensorQuant(f, rounding=r).spec() for f in MX + ["nvfp4"] for r in ROUNDINGS]
    specs += [TensorQuant("nvfp4", rounding=r, block_2d=True).spec() for r in ROUNDINGS]  # 16x16 tiles
    specs += [TensorQuant(f, scale_mode=m).spec() for f in MX for m in ("ceil", "rceil", "even")]
    for f in ("hifp8", "fp8_e4m3", "fp8_e5m2", "bf16", "fp16"):
        has_inf = formats.get(f).element.has_inf
        for r in ROUNDINGS:
            for sat in (True, False) if has_inf else (True,):
                specs.append(TensorQuant(f, rounding=r, saturate=sat).spec())
        if formats.get(f).allow_tensor_scaling:
            specs.append(TensorQuant(f, scaling="tensor").spec())
            specs.append(TensorQuant(f, scaling="tensor", scale_target=224.0, rounding="sr").spec())
    return specs + [TensorQuant("hifp8_legacy_clamp").spec()]  # the compatibility format, reference arithmetic


DEFAULT_SPECS = [TensorQuant(f).spec() for f in formats.names()] + [TensorQuant(f, rounding="sr").spec() for f in formats.names()]


class _Lowered:
    """One Inductor-compiled function returning every spec's quantization of its input (the lowering); keeps the
    output code of each compile its calls ran (``codes``), so a check can see the quantizes were lowered."""

    def __init__(self, specs: list[str], dim: int = -1, dynamic: bool = False) -> None:
        self.specs, self.dim, self.codes = specs, dim, []

        def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(torch.ops.fxquant.quantize(x, s, dim, SEED) for s in specs)

        self.fn = torch.compile(fn, backend=lowering.inductor_backend, dynamic=dynamic)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with generated_code() as codes:
            out = self.fn(x)
        self.codes += codes
        return out


def _check(fn: _Lowered, got: tuple, x: torch.Tensor, device: str = "cpu") -> None:
    """``got`` (``fn``'s outputs for ``x``) equals the reference, and ``fn``'s code computes every quantize that
    ``lowering.lowers_exactly`` says lowers on ``device`` (the op's CPU kernel is the reference itself: a
    quantize left as the op would equal it too)."""
    for spec, y in zip(fn.specs, got, strict=True):
        want = TensorQuant.from_spec(spec).quantize(x, fn.dim, seed=SEED)
        assert_bitwise_equal(y, want, f"{spec} dim={fn.dim} {x.dtype} {tuple(x.shape)}:")
    assert_lowered(fn.codes, fn.specs, device, f"dim={fn.dim} {x.dtype} {tuple(x.shape)}:")


def boundary_rows(length: int) -> torch.Tensor:
    """Blocks that exercise the scale rules: zero, tiny (scale clamped at 2**-127), power-of-two amax and its
    neighbours (floor/ceil/rceil/even differ there), near each element's max normal, huge (scale > 127)."""
    rows = [torch.zeros(length)]
    for amax in (2.0**-140, 2.0**-130, 2.0**-120, 1.0, 1.0 + 2**-23, 2.0 - 2**-23, 448.0, 448.0 * (1 + 2**-23), 447.99,
                 57344.0, 28.0, 7.5, 6.0, 1.984375, 32768.0, 40960.0, 2.0**126, 3.0e38):
        ramp = torch.linspace(-1.0, 1.0, length) * amax
        ramp[length // 3] = amax
        rows.append(ramp)
    return torch.stack(rows)


def patterns(dtype: torch.dtype, length: int = 100) -> torch.Tensor:
    """Every bit pattern of ``dtype`` (a 16-bit float), shuffled into rows of ``length`` (not a multiple of 32 or 16:
    every row ends in a short block), followed by the boundary rows; float32."""
    x = every_pattern(dtype)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    rows = x.numel() // length
    return torch.cat([x[: rows * length].reshape(rows, length), boundary_rows(length)])


def finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with non-finite values zeroed: NVFP4 and tensor scaling then see a finite tensor amax."""
    return torch.where(torch.isfinite(x), x, 0.0)


@pytest.mark.parametrize("source", ["bfloat16", "float16"])
def test_every_option_on_every_pattern_float32(source):
    specs = all_specs()
    x = patterns(getattr(torch, source))
    fn = _Lowered(specs)
    for data in (x, finite(x)):
        _check(fn, fn(data), data)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_defaults_and_sr_in_half_precision_inputs(dtype):
    x = patterns(dtype).to(dtype)
    fn = _Lowered(DEFAULT_SPECS)
    for data in (x, finite(x)):
        _check(fn, fn(data), data)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_several_block_formats_of_one_half_precision_tensor_along_a_non_last_dim(dtype):
    """Two MX quantizes of one bf16/fp16 tensor blocked along dim 0 (a weight's two formats, an input's wgrad for two
    linears) expand to twin block-amax reductions; merged after the expansion (Inductor's C++ code generation
    fused the twins into a kernel declaring their accumulator twice, which did not compile)."""
    specs = [TensorQuant("mxfp8_e4m3").spec(), TensorQuant("mxfp4_e2m1").spec(),
             TensorQuant("mxfp8_e4m3", scale_mode="rceil").spec()]
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(64, 100, generator=g) * torch.pow(2.0, torch.empty(64, 100).uniform_(-6, 6, generator=g))).to(dtype)
    torch._dynamo.reset()
    fn = _Lowered(specs, dim=0)
    _check(fn, fn(x), x)


@pytest.mark.parametrize("dim", [0, 1])
def test_other_dims_with_partial_blocks(dim):
    """Blocks along a non-last dim of a 3-D tensor, its length (37) not a multiple of the block."""
    specs = [TensorQuant(f).spec() for f in MX + ["nvfp4"]] + [TensorQuant("mxfp8_e4m3", rounding="sr").spec()]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 37, 8, generator=g) * torch.pow(10.0, torch.empty(37, 37, 8).uniform_(-6, 6, generator=g))
    fn = _Lowered(specs, dim)
    _check(fn, fn(x), x)


CONSUMED_SPECS = [TensorQuant(f).spec() for f in MX + ["nvfp4"]] + [
    TensorQuant("mxfp8_e4m3", rounding="sr").spec(), TensorQuant("nvfp4", rounding="sr").spec()]


CONSUMERS = {"relu": lambda y: torch.relu(y) * 2.0, "none": lambda y: y * 1.0, "mm": lambda y: y @ torch.ones(
    y.shape[-1], 3)}


def _consumed_check(spec: str, shape: tuple, dim: int, consumer: str = "relu") -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 3
    use = CONSUMERS[consumer]
    torch._dynamo.reset()
    fn = torch.compile(lambda t: use(torch.ops.fxquant.quantize(t, spec, dim, SEED)), backend=lowering.inductor_backend)
    want = use(TensorQuant.from_spec(spec).quantize(x, dim, seed=SEED))
    with generated_code() as codes:
        got = fn(x)
    assert_bitwise_equal(got, want, f"{spec} then {consumer}, {shape} dim={dim}:")
    assert_lowered(codes, [spec], "cpu", f"{spec} then {consumer}, {shape} dim={dim}:")


@pytest.mark.parametrize("spec", CONSUMED_SPECS)
@pytest.mark.parametrize(("shape", "consumer"), [((4, 50), "relu"), ((1, 40), "none")])
def test_a_consumer_of_a_partial_block_result_reads_every_block(spec, shape, consumer):
    """A block format's result with a short last block, read by a pointwise op Inductor fuses with it (relu, then
    a doubling: both exact) or by nothing, with several rows and with one, equals the reference in every block.
    Inductor's CPU code generation gets two other traced forms of this wrong (``fxquant.formats.mx.block_stage``).
    One quantize per graph: with several, Inductor schedules them differently and the defects hide."""
    _consumed_check(spec, shape, -1, consumer)


@pytest.mark.parametrize(("shape", "dim", "consumer"), [
    ((3, 33), -1, "relu"), ((50, 3), 0, "relu"), ((2, 5, 100), 1, "relu"), ((1, 48), -1, "relu"),
    ((1, 33), -1, "mm"), ((1, 80), -1, "none"), ((40, 1), 0, "none"), ((1, 1, 40), -1, "relu")])
def test_a_consumer_reads_every_block_along_other_dims_lengths_and_single_rows(shape, dim, consumer):
    _consumed_check(TensorQuant("mxfp8_e4m3").spec(), shape, dim, consumer)


@pytest.mark.parametrize(("shape", "dim"), [((1, 24), -1), ((40, 1), 0)])
def test_nvfp4_single_rows_with_a_partial_block(shape, dim):
    _consumed_check(TensorQuant("nvfp4").spec(), shape, dim, "none")


@pytest.mark.parametrize(("length", "amaxes"), [(50, 3), (64, 2)])
def test_nvfp4_traced_takes_each_amax_once(length, amaxes):
    """Traced, NVFP4 reduces x once per block and once for the tensor: with a short last block the pieces' block
    amaxes and a plain tensor amax (3), not also the padded blocks' amaxes for the tensor's (4); full blocks: the
    block amaxes and the largest of them (2)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    fmt = formats.get("nvfp4")
    x = torch.randn(4, length)
    gm = make_fx(lambda t: fmt.quantize(t, -1), tracing_mode="fake")(x)
    gm.graph.eliminate_dead_code()
    assert sum(n.target is torch.ops.aten.amax.default for n in gm.graph.nodes) == amaxes
    assert_bitwise_equal(torch.compile(lambda t: fmt.quantize(t, -1), backend=lowering.inductor_backend)(x),
                         fmt.quantize(x, -1), "nvfp4 traced")


def test_format_quantize_compiled_by_plain_torch_compile_equals_eager_with_a_partial_block(monkeypatch):
    """``Format.quantize`` (its own final cast reads the result) under plain ``torch.compile``, a short last block;
    tracing it warns of nothing (Dynamo warns once per process, e.g. of a cache-wrapped function it traces)."""
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(6))
    for name in ("mxfp8_e4m3", "nvfp4"):
        fmt = formats.get(name)
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = torch.compile(lambda t: fmt.quantize(t, rounding="rne"), fullgraph=True)(x)
        assert [str(w.message) for w in caught if "dynamo" in w.filename.lower()] == [], name
        assert_bitwise_equal(got, fmt.quantize(x), name)


HYPOTHESIS_SPECS = [TensorQuant("mxfp8_e4m3").spec(), TensorQuant("mxfp4_e2m1", rounding="sr").spec(),
                    TensorQuant("nvfp4").spec(), TensorQuant("hifp8").spec(),
                    TensorQuant("fp8_e5m2", scaling="tensor").spec()]
_HYPOTHESIS_FN = []


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 9), length=st.integers(1, 80), lo=st.integers(-30, 0), hi=st.integers(0, 30),
       seed=st.integers(0, 2**31 - 1))
def test_hypothesis_values_and_shapes(rows, length, lo, hi, seed):
    """Random magnitudes and shapes through one dynamic-shape compile (no recompile per shape)."""
    if not _HYPOTHESIS_FN:
        _HYPOTHESIS_FN.append(_Lowered(HYPOTHESIS_SPECS, dynamic=True))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, length, generator=g) * torch.pow(2.0, torch.empty(rows, length).uniform_(lo, hi, generator=g))
    _check(_HYPOTHESIS_FN[0], _HYPOTHESIS_FN[0](x), x)


def test_sr_without_a_seed_draws_inside_the_graph_and_is_unbiased():
    """seed=None: a fresh seed per call, drawn in the graph (no host sync); the mean of many roundings of a
    value between two grid points tends to the value (FORMATS.md: stochastic rounding is unbiased).

    Every element is 1.03125 = 264 * 2**-8: the MX floor scale is 2**-8, E4M3's grid around 264 is
    256, 288, so each element becomes 1.0 or 1.125, the latter with probability 8 / 32."""
    spec = TensorQuant("mxfp8_e4m3", rounding="sr").spec()
    fn = torch.compile(lambda x: torch.ops.fxquant.quantize(x, spec, -1, None), backend=lowering.inductor_backend)
    x = torch.full((64, 64), 1.03125)
    draws = torch.stack([fn(x) for _ in range(8)])
    assert not torch.equal(draws[0], draws[1]), "two calls drew the same stochastic rounding"
    assert bool(((draws == 1.0) | (draws == 1.125)).all()), "SR must land on a neighbouring grid point"
    assert abs(float(draws.mean()) - 1.03125) < 2e-3  # std of the mean ~3e-4


def test_tensor_seeds_give_the_reference_uniforms():
    """The in-graph seed path (a 0-dim int64 tensor) hashes exactly as the Python-int path."""
    for seed in (0, 1, 7, 2**40 + 3, 2**62 - 1):
        assert int(seed_key(torch.tensor(seed, dtype=torch.int64))) == seed_key(seed)
        assert torch.equal(uniforms(1000, torch.tensor(seed, dtype=torch.int64), torch.device("cpu"), 17),
                           uniforms(1000, seed, torch.device("cpu"), 17))


DIVISORS = (448.0, 57344.0, 28.0, 7.5, 6.0, 127 / 64, 2688.0)


def test_fdiv_equals_float32_division_and_survives_reciprocal_rewrites():
    """fdiv_wide (float64 division rounded to float32, the form used off CPU) == IEEE float32 division (CPU
    eager); the float64 product with a rounded reciprocal, which Inductor on CUDA emits for constant divisors,
    gives the same float32; and fdiv on CPU, compiled by Inductor's C++ backend, is that division too."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F800000, (1 << 20,), generator=g, dtype=torch.int32)
    a = torch.cat([bits.view(torch.float32), every_pattern(torch.bfloat16).abs(), torch.tensor([0.0, 2.0**-149])])
    a = a[torch.isfinite(a)]
    compiled = torch.compile(lambda t, c: fdiv(t, c), backend="inductor", dynamic=False)
    for c in DIVISORS:
        want = a / torch.tensor(c, dtype=torch.float32)
        assert_bitwise_equal(fdiv_wide(a, c), want, f"fdiv_wide by {c}:")
        assert_bitwise_equal((a.double() * (1.0 / c)).float(), want, f"reciprocal of {c}:")
        assert_bitwise_equal(compiled(a, c), want, f"Inductor C++ fdiv by {c}:")
    b = torch.randint(1, 0x7F800000, (1 << 20,), generator=g, dtype=torch.int32).view(torch.float32)
    want = a[: b.numel()] / b[: a.numel()]
    assert_bitwise_equal(fdiv_wide(a[: b.numel()], b[: a.numel()]), want, "tensor divisor:")
    assert_bitwise_equal(compiled(a[: b.numel()], b[: a.numel()]), want, "Inductor C++ tensor divisor:")
    assert_bitwise_equal(fdiv_wide(1.0, b), 1.0 / b, "scalar dividend:")


def test_lowered_graph_has_no_quantize_call_and_fuses_each_operand():
    """Inductor's code for a quantized linear forward calls no fxquant op: the quantizes are generated kernels."""
    from torch._inductor.utils import run_and_get_code

    spec = TensorQuant("mxfp8_e4m3").spec()

    def f(x, w):
        xq = torch.ops.fxquant.quantize(torch.relu(x), spec, -1, None)
        return torch.mm(xq, torch.ops.fxquant.quantize(w, spec, 0, None))

    x, w = torch.randn(64, 96), torch.randn(96, 48)
    out, codes = run_and_get_code(torch.compile(f, backend=lowering.inductor_backend), x, w)
    code = "\n".join(codes)
    assert "torch.ops.fxquant" not in code
    assert 1 <= code.count("cpp_pybinding(") <= 2  # relu fused into quantize(x); quantize(w) alone or with it
    want = torch.mm(TensorQuant("mxfp8_e4m3").quantize(torch.relu(x), -1), TensorQuant("mxfp8_e4m3").quantize(w, 0))
    assert_bitwise_equal(out, want, "lowered linear:")


class _UserPass:
    """A user's post-grad pass: records ``probe(graph)`` for each graph it runs on."""

    def __init__(self, probe) -> None:
        self.probe = probe
        self.seen: list = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.seen.append(self.probe(graph))


def _quantize_nodes(graph: torch.fx.Graph) -> int:
    return sum(n.target is torch.ops.fxquant.quantize.default for n in graph.nodes)


def _tail_vectorised(graph: torch.fx.Graph) -> bool:
    """Inductor's ``cpp.enable_loop_tail_vec`` in effect while ``graph`` compiles."""
    from torch._inductor import config

    return config.cpp.enable_loop_tail_vec


def test_block_quantizes_reach_the_partitioner_as_one_node_each_and_a_users_pass_still_runs():
    """Under Inductor a block-format quantize stays one node through AOT autograd (its partitioner sees no
    arithmetic); LowerQuantize expands it in the forward and the backward graph after running the pass the
    user had installed, and the result is still the reference's. An element format is expanded while AOT
    traces, so no node of it is left by then."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    for name, spec, want_nodes in (("mxfp8", TensorQuant("mxfp8_e4m3").spec(), 2),
                                   ("hifp8", TensorQuant("hifp8").spec(), 0)):
        seen = _UserPass(_quantize_nodes)

        def f(x, w, spec=spec):
            xq = torch.ops.fxquant.quantize(torch.relu(x), spec, -1, None)
            return torch.mm(xq, torch.ops.fxquant.quantize(w, spec, 0, None))

        torch._dynamo.reset()
        x, w = torch.randn(64, 96, requires_grad=True), torch.randn(96, 48, requires_grad=True)
        with config.patch(post_grad_custom_pre_pass=seen):
            fn = torch.compile(f, backend=lowering.inductor_backend)
            out, codes = run_and_get_code(lambda: fn(x, w))
            out.sum().backward()
        assert "torch.ops.fxquant" not in "\n".join(codes), name
        assert seen.seen[0] == want_nodes, f"{name}: quantize nodes seen after partitioning {seen.seen}"
        tq = TensorQuant.from_spec(spec)
        assert_bitwise_equal(out, torch.mm(tq.quantize(torch.relu(x.detach()), -1), tq.quantize(w.detach(), 0)),
                             f"{name}:")
        assert x.grad is not None and w.grad is not None
    inner = lowering.LowerQuantize(_UserPass(_quantize_nodes))
    assert inner.uuid() is None, "a user's pass without a uuid opts the graph out of caching"
    assert isinstance(lowering.LowerQuantize().uuid(), str)


def test_compiles_run_loop_remainders_scalar_and_leave_the_users_setting_alone():
    """fxquant's Inductor compiles turn off the masked vector kernel for a loop's remainder (docs/compile.md,
    "Compile time"), so the setting must exist in this torch, be in effect while fxquant's graph compiles, and be
    the user's again afterwards; rows of 40 (MX blocks of 32 and 8, 16-lane vectors and a remainder of 8) and 3
    rows of NVFP4 blocks still give the reference's bits."""
    from torch._inductor import config

    assert hasattr(config.cpp, "enable_loop_tail_vec"), "Inductor renamed cpp.enable_loop_tail_vec: follow it"
    specs = [TensorQuant(f).spec() for f in ("mxfp8_e4m3", "mxfp4_e2m1", "nvfp4", "hifp8")]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 40, generator=g) * torch.pow(10.0, torch.empty(3, 40).uniform_(-4, 4, generator=g))
    user = _UserPass(_tail_vectorised)
    torch._dynamo.reset()
    with config.patch({"post_grad_custom_pre_pass": user, "cpp.enable_loop_tail_vec": True}):  # the user's choice
        fn = _Lowered(specs)
        got = fn(x)
        assert config.cpp.enable_loop_tail_vec is True, "the user's setting is back after the compile"
    assert user.seen and not any(user.seen), f"tail vectorisation in effect while compiling: {user.seen}"
    _check(fn, got, x)


def test_compiled_attention_site_quantizes_in_generated_code():
    """quantized_sdpa under fxquant.compile (Inductor, CPU): no quantize op call is left in the generated code
    (Q, K, V, P and the gradients are quantized inside Inductor's kernels), compile_state says "inductor",
    and the result equals the same site run with the opaque reference op, bit for bit."""
    import torch.nn.functional as F
    from torch._inductor.utils import run_and_get_code

    import fxquant

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 48, 32, generator=g) for _ in range(3))
    outs = {}
    for kernels in ("inductor", "reference"):
        torch._dynamo.reset()
        compiled = fxquant.compile(Attention(), "FA_QKPV_mxfp8", kernels=kernels, attention="math")
        out, codes = run_and_get_code(compiled, q, k, v)
        assert fxquant.compile_state(compiled).kernels() == [lowering.Kernels(kernels)]
        outs[kernels] = (out, "\n".join(codes))
    assert "torch.ops.fxquant.quantize" not in outs["inductor"][1]
    assert "torch.ops.fxquant.quantize_reference" in outs["reference"][1]
    assert_bitwise_equal(outs["inductor"][0], outs["reference"][0], "attention site:")


# -- CUDA: the same lowering through Inductor's Triton code generation -------------------------------------
def _check_cuda(specs: list[str], dim: int, *inputs: torch.Tensor) -> None:
    """Each input (CPU) quantized on the GPU by one compiled graph, compared with the CPU reference."""
    fn = _Lowered(specs, dim)
    for x in inputs:
        got = tuple(y.cpu() for y in fn(x.cuda()))
        _check(fn, got, x, "cuda")


def spec_groups() -> dict[str, list[str]]:
    """``all_specs`` by format: one compiled graph each (one graph of all of them ran past 200 s on an H200)."""
    groups: dict[str, list[str]] = {}
    for spec in all_specs():
        groups.setdefault(spec.split(":")[0], []).append(spec)
    return groups


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(spec_groups()))
@pytest.mark.parametrize("source", ["bfloat16", "float16"])
def test_cuda_every_option_on_every_pattern(source, fmt):
    """Inductor on CUDA emits Triton (its own division and reciprocal rules, FMA contraction by ptxas):
    the lowered op still equals the CPU reference for every option and every 16-bit pattern."""
    x = patterns(getattr(torch, source))
    _check_cuda(spec_groups()[fmt], -1, x, finite(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_precision_inputs_and_other_dims(dtype):
    x = patterns(dtype).to(dtype)
    _check_cuda(DEFAULT_SPECS, -1, x, finite(x))
    specs = [TensorQuant(f).spec() for f in MX + ["nvfp4"]] + [TensorQuant("mxfp8_e4m3", rounding="sr").spec()]
    g = torch.Generator().manual_seed(3)
    y = torch.randn(37, 37, 8, generator=g) * torch.pow(10.0, torch.empty(37, 37, 8).uniform_(-6, 6, generator=g))
    for dim in (0, 1):
        torch._dynamo.reset()
        _check_cuda(specs, dim, y)


@pytest.mark.gpu
def test_cuda_nvfp4_stays_the_op_and_other_formats_are_lowered():
    """On CUDA, NVFP4's quantize is left to its registered kernel (its lowering is not exact there); an MX
    quantize becomes generated code."""
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(64, 96, device="cuda")
    for name, kept in (("nvfp4", True), ("mxfp8_e4m3", False)):
        torch._dynamo.reset()
        spec = TensorQuant(name).spec()
        fn = torch.compile(lambda t, spec=spec: torch.ops.fxquant.quantize(torch.relu(t), spec, -1, None),
                           backend=lowering.inductor_backend)
        out, codes = run_and_get_code(fn, x)
        assert ("torch.ops.fxquant.quantize" in "\n".join(codes)) is kept, name
        assert_bitwise_equal(out.cpu(), TensorQuant(name).quantize(torch.relu(x).cpu(), -1), f"{name}:")


def test_a_quantize_kept_as_the_op_gets_a_fallback_beside_its_decomposition(monkeypatch):
    """CUDA keeps an NVFP4 quantize the op while the op is in the decomposition table (its AOT-time entry);
    Inductor must still lower it, to its registered kernel (torch >= 2.13 refuses an implicit fallback for an
    op with a decomposition). Exercised on CPU with CUDA's verdict (``lowers_exactly`` False for NVFP4) and
    no fallback registered beforehand."""
    from torch._inductor import lowering as inductor_lowering
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(lowering, "lowers_exactly", lambda qspec, device: "nvfp4" not in qspec)
    monkeypatch.delitem(inductor_lowering.lowerings, torch.ops.fxquant.quantize.default, raising=False)
    torch._dynamo.reset()
    x = torch.randn(64, 96)
    spec = TensorQuant("nvfp4").spec()
    fn = torch.compile(lambda t: torch.ops.fxquant.quantize(torch.relu(t), spec, -1, None),
                       backend=lowering.inductor_backend)
    out, codes = run_and_get_code(fn, x)
    torch._dynamo.reset()
    assert "torch.ops.fxquant.quantize" in "\n".join(codes)
    assert_bitwise_equal(out, TensorQuant("nvfp4").quantize(torch.relu(x), -1), "nvfp4 kept as the op:")


def test_lowering_choice_per_device_and_format():
    """lowers_exactly / inexact_formats / resolve: NVFP4 lowers exactly on CPU only; "auto" under Inductor
    lowers on CPU and on CUDA unless the graph has an inexact format; "inductor" is then refused."""
    from fxquant import schemes
    from fxquant.lowering import Kernels, inexact_formats, lowers_exactly, resolve
    from fxquant.schemes import Site, SiteKind

    assert lowers_exactly(TensorQuant("nvfp4").spec(), "cpu")
    assert not lowers_exactly(TensorQuant("nvfp4", rounding="sr").spec(), "cuda")
    assert all(lowers_exactly(TensorQuant(f).spec(), "cuda") for f in formats.names() if f != "nvfp4")
    linear = Site.from_path("layers.0.mlp.fc1", SiteKind.LINEAR)
    nv, mx = (schemes.get(f"linear_{f}").linear_for(linear) for f in ("nvfp4", "mxfp8"))
    attn = schemes.get("FA_QKPV_mxfp8").attention_for(Site.from_path("layers.0.self_attn", SiteKind.ATTENTION))
    assert inexact_formats([mx, attn, None, nv], "cuda") == ["nvfp4"]
    assert inexact_formats([mx, attn, nv], "cpu") == [] and inexact_formats([mx, attn], "cuda") == []
    assert resolve(Kernels.AUTO, inductor=True, device="cuda") is Kernels.INDUCTOR
    assert resolve(Kernels.AUTO, inductor=True, device="cpu", inexact=[]) is Kernels.INDUCTOR
    fallback = resolve(Kernels.AUTO, inductor=True, device="cuda", inexact=["nvfp4"])
    assert fallback in (Kernels.TRITON, Kernels.REFERENCE)
    assert resolve(Kernels.AUTO, inductor=False, device="cpu") in (Kernels.TRITON, Kernels.REFERENCE)
    assert resolve(Kernels.INDUCTOR, inductor=False, device="cuda", inexact=["nvfp4"]) is Kernels.INDUCTOR  # eager ops
    with pytest.raises(ValueError, match=r"kernels='inductor'.*nvfp4.*allowed here: 'auto'"):
        resolve(Kernels.INDUCTOR, inductor=True, device="cuda", inexact=["nvfp4"])


@pytest.mark.gpu
def test_cuda_fdiv_is_float32_division():
    """fdiv compiled by Inductor for CUDA (Triton) == IEEE float32 division, constant and tensor divisors."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 0x7F800000, (1 << 20,), generator=g, dtype=torch.int32).view(torch.float32)
    b = torch.randint(1, 0x7F800000, (1 << 20,), generator=g, dtype=torch.int32).view(torch.float32)
    compiled = torch.compile(lambda t, c: fdiv(t, c), backend="inductor", dynamic=False)
    for c in DIVISORS:
        assert_bitwise_equal(compiled(a.cuda(), c).cpu(), a / torch.tensor(c, dtype=torch.float32), f"by {c}:")
    assert_bitwise_equal(compiled(a.cuda(), b.cuda()).cpu(), a / b, "tensor divisor:")


def test_a_seed_that_changes_every_call_does_not_recompile_every_call():
    """An explicit SR seed per call (the step number) entered the graph as a guarded constant: each new seed
    recompiled, and after Dynamo's recompile limit (8) calls ran eagerly. A changing seed is a SymInt after the
    second compile, passed into the graph as an int64 tensor: the uniforms equal the reference's, negative too."""
    from torch._dynamo.utils import counters

    spec = TensorQuant("mxfp8_e4m3", rounding="sr").spec()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(9))
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(lambda t, s: torch.ops.fxquant.quantize(t, spec, -1, s), backend=lowering.inductor_backend)
    for seed in (0, 1, 2, 3, -5, 2**40 + 7):
        assert_bitwise_equal(fn(x, seed), TensorQuant.from_spec(spec).quantize(x, -1, seed=seed), f"seed={seed}:")
    assert counters["stats"]["unique_graphs"] <= 2


def test_merging_duplicates_leaves_the_graphs_own_calls_alone():
    """The merge of the expansion's twin reductions touches nothing else: two equal results the model returns
    separately stay two tensors, and so do the weight gradients of two linears fed the same input (a merge over
    the whole graph returned one shared tensor for each pair)."""
    import fxquant

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

        def forward(self, x):
            h = x * 2
            return self.a(x) + self.b(x), h.sum(0), h.sum(0)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Model()
    y, s1, s2 = fxquant.compile(model, "linear_mxfp8", backend="inductor")(torch.randn(8, 32))
    assert s1.data_ptr() != s2.data_ptr() and torch.equal(s1, s2)
    ga, gb = torch.autograd.grad(y.sum(), [model.a.weight, model.b.weight])
    assert ga.data_ptr() != gb.data_ptr()
