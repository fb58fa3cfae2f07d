"""Triton kernels == the pure-torch reference, bit for bit (FORMATS.md; ARCHITECTURE.md trap 8).

Every format x every rounding mode (x every MX scale mode, per-tensor scaling, saturate on/off where the
format allows it, NVFP4's 16x16 tiles), on shapes with partial blocks, dims other than the last, non-contiguous inputs,
fp32/bf16/fp16 inputs and special values. Without a GPU the kernels run in Triton's interpreter on CPU,
which must be chosen before the kernels are defined: this module sets TRITON_INTERPRET=1 at import time
(fxquant.kernels imports Triton's kernels lazily, on first use). With a GPU they run compiled on CUDA
and are compared with the reference computed on CPU (the contract's IEEE arithmetic).
"""
from __future__ import annotations

import itertools
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from fxquant import formats, kernels
from fxquant.formats.element import ElementSpec
from fxquant.formats.tensor_quant import TensorQuant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROUNDINGS = ("rne", "ta", "rz", "sr")
SCALE_MODES = ("floor", "rceil", "ceil", "even")
MX_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1", "mxint8")
ELEMENT_FORMATS = ("hifp8", "fp8_e4m3", "fp8_e5m2", "bf16", "fp16")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SEED = 1234

pytestmark = [
    pytest.mark.triton,
    # The interpreter computes in numpy, which warns where IEEE arithmetic overflows (intended: x * 2**k
    # to Inf, the hash's wrapping uint32 multiply).
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]

_SPECIAL_FINITE = [0.0, -0.0, 1e-40, -3e-39, 2.0**-149, 2.0**-126, 3.0e38, -3.3e38, 2.0**-133, 40960.0,
                   -45000.0, 32768.0, 57344.0, 61440.0, 448.0, 464.0, -480.0, 6.0, 5.0, 7.0, 65504.0, 65520.0]
_NON_FINITE = [float("nan"), float("inf"), float("-inf")]


def make_input(shape: tuple[int, ...], seed: int, non_finite: bool) -> torch.Tensor:
    """float32 values over a wide exponent range, a quarter with few significant bits (rounding ties on
    every small grid), finite extremes (subnormals, near float32 max, format thresholds) and, when asked,
    NaN and +-Inf."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.Size(shape).numel())
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-14, 15, (n,), generator=g).float())
    idx = torch.randperm(n, generator=g)
    k = n // 4
    sign = torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0)
    ties = torch.randint(1, 64, (k,), generator=g).float() * torch.exp2(torch.randint(-12, 12, (k,), generator=g).float())
    x[idx[:k]] = sign * ties
    specials = _SPECIAL_FINITE + (_NON_FINITE if non_finite else [])
    x[idx[k : k + len(specials)]] = torch.tensor(specials[: n - k])
    return x.reshape(shape)


def mx_edge_rows(spec: ElementSpec, width: int = 64) -> torch.Tensor:
    """Rows of two 32-blocks whose amax sits on the scale rules' boundaries: m * 2**k for m around the
    element's largest mantissa and max normal, all-zero, all-subnormal and float32-max blocks."""
    rows = []
    g = torch.Generator().manual_seed(7)
    body = torch.rand(width, generator=g) * 2 - 1
    mx = torch.tensor(spec.max_normal)
    ulp_up = torch.nextafter(mx, torch.tensor(float("inf"))).item()  # rceil: amax / max_normal just above 2**k
    ulp_down = torch.nextafter(mx, torch.tensor(0.0)).item()
    tops = (spec.max_normal, ulp_up, ulp_down, spec.max_normal * (1 + 2.0**-(spec.mbits + 1)), 2.0**spec.emax,
            2.0**spec.emax * 1.9375, 2.0 ** (spec.emax + 1) * (1 - 2.0**-20), 1.0)
    for top in tops:
        for k in (-130, -40, -3, 0, 17, 100):
            row = body * (top * 2.0**k)
            row[::32] = top * 2.0**k
            rows.append(row)
    rows.append(torch.zeros(width))
    rows.append(body * 1e-39)
    rows.append(torch.full((width,), 3.4e38))
    return torch.stack(rows)


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype and shape, NaN exactly where the reference has NaN, identical bits everywhere else."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.cpu(), want.cpu()
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_got, nan_want), f"NaN at {nan_got.sum()} vs {nan_want.sum()} places"
    bits = torch.int16 if got.element_size() == 2 else torch.int32
    g, w = got[~nan_got].view(bits), want[~nan_want].view(bits)
    bad = (g != w).nonzero()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {g.numel()} values differ; first: got {got[~nan_got][bad[0]].item()!r}, "
        f"want {want[~nan_want][bad[0]].item()!r}"
    )


def check(tq: TensorQuant, x: torch.Tensor, dim: int, seed: int | None = SEED) -> torch.Tensor:
    want = tq.quantize(x, dim, seed=seed)
    got = kernels.quantize(x.to(DEVICE), tq, dim, seed=seed)
    assert got.is_contiguous()
    assert_bitwise_equal(got, want)
    return got


def _dtype_for(i: int) -> torch.dtype:
    return DTYPES[i % len(DTYPES)]


# -- MX: every element type x rounding x scale mode --------------------------------------------------------
MX_CASES = list(itertools.product(MX_FORMATS, ROUNDINGS, SCALE_MODES))


@pytest.mark.parametrize("name,rounding,scale_mode", MX_CASES)
def test_mx_matches_reference(name: str, rounding: str, scale_mode: str) -> None:
    tq = TensorQuant(name, rounding=rounding, scale_mode=scale_mode)
    i = MX_CASES.index((name, rounding, scale_mode))
    # [rows, L] with a short last block; then a 3-D non-contiguous view blocked along dim 0, other dtype.
    check(tq, make_input((6, 100), i, non_finite=True), -1)
    x3 = make_input((70, 3, 8), 1000 + i, non_finite=False).to(_dtype_for(i + 1)).transpose(1, 2)
    check(tq, x3, 0)
    edges = mx_edge_rows(tq.fmt.element)
    check(tq, edges, -1)
    check(tq, edges.to(_dtype_for(i + 2)), -1) if _dtype_for(i + 2) != torch.float32 else None


# -- element formats: every rounding x scaling x saturate that the format allows ---------------------------
def _element_cases() -> list[tuple[str, str, str, bool]]:
    cases = []
    for name, rounding, scaling, saturate in itertools.product(ELEMENT_FORMATS, ROUNDINGS, ("none", "tensor"), (True, False)):
        try:
            TensorQuant(name, rounding=rounding, scaling=scaling, saturate=saturate)
        except ValueError:
            continue  # an option this format does not offer (tensor scaling of bf16, saturate=False of E4M3)
        cases.append((name, rounding, scaling, saturate))
    return cases


ELEMENT_CASES = _element_cases()


def test_element_cases_cover_every_offered_option() -> None:
    # rounding x scaling x saturate: hifp8 4x2x2, fp8_e4m3 4x2x1 (no Inf), fp8_e5m2 4x2x2, bf16/fp16 4x1x2
    assert len(ELEMENT_CASES) == 16 + 8 + 16 + 8 + 8
    assert {c[0] for c in ELEMENT_CASES} == set(ELEMENT_FORMATS)


@pytest.mark.parametrize("name,rounding,scaling,saturate", ELEMENT_CASES)
def test_element_matches_reference(name: str, rounding: str, scaling: str, saturate: bool) -> None:
    tq = TensorQuant(name, rounding=rounding, scaling=scaling, saturate=saturate)
    i = ELEMENT_CASES.index((name, rounding, scaling, saturate))
    # Finite input (so per-tensor scaling is active), then one with NaN/Inf (scaling falls back to k = 0).
    check(tq, make_input((5, 7, 9), i, non_finite=False).to(_dtype_for(i)), 1)
    check(tq, make_input((33, 40), 500 + i, non_finite=True).to(_dtype_for(i + 1))[:, ::3], 0)


@pytest.mark.parametrize("target", [224.0, 1.5, 2.0**-3])
def test_element_tensor_scaling_targets(target: float) -> None:
    for name in ("hifp8", "fp8_e4m3"):
        tq = TensorQuant(name, scaling="tensor", scale_target=target)
        check(tq, make_input((4, 50), 3, non_finite=False), -1)
        check(tq, make_input((4, 50), 4, non_finite=False) * 1e-30, -1)


# -- NVFP4 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nvfp4_matches_reference(rounding: str, dtype: torch.dtype) -> None:
    tq = TensorQuant("nvfp4", rounding=rounding)
    check(tq, make_input((5, 70), 11, non_finite=False).to(dtype), -1)
    check(tq, make_input((40, 2, 3), 12, non_finite=False).to(dtype).permute(2, 0, 1), 1)


NVFP4_EDGES = ["zeros", "nan", "inf", "tiny_amax", "subnormal_amax", "huge"]


def nvfp4_edge_input(case: str, shape: tuple[int, int]) -> torch.Tensor:
    """An input of ``shape`` for one of ``NVFP4_EDGES``: all zeros, a NaN, a -Inf, amax 2**-140 (g underflows:
    zeros), amax 2**-120, amax 3.3e38."""
    x = make_input(shape, 21, non_finite=False)
    rows, cols = shape
    if case == "zeros":
        x = torch.zeros(shape)
    elif case == "nan":
        x[rows // 3, 5 % cols] = float("nan")
    elif case == "inf":
        x[rows - 1, cols - 8 if cols > 8 else 0] = float("-inf")
    elif case == "tiny_amax":
        x = x / x.abs().amax() * 2.0**-140
    elif case == "subnormal_amax":
        x = x / x.abs().amax() * 2.0**-120
    else:
        x = x / x.abs().amax() * 3.3e38
    return x


@pytest.mark.parametrize("case", NVFP4_EDGES)
def test_nvfp4_tensor_scale_edges(case: str) -> None:
    """amax == 0 gives zeros; NaN/Inf make every element NaN; tiny amax (g underflow) and huge amax."""
    x = nvfp4_edge_input(case, (3, 48))
    for rounding in ("rne", "sr"):
        check(TensorQuant("nvfp4", rounding=rounding), x, -1)


# -- NVFP4 with 16x16 tiles (block_2d) ---------------------------------------------------------------------
TILE_SHAPES = [(33, 47), (1, 5), (17, 16), (16, 17), (40, 64)]  # partial tiles along either edge, or both


def tile_input(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """make_input's finite values, those beyond 2**15 set to +-2**15 (float32's extremes would give every other tile
    the smallest scale; fp16 holds 2**15), each 16x16 tile then scaled by its own 2**-k, k in 0..12: tiles of
    different scales, and rows of a tile whose own block amaxes differ from the tile's."""
    x = make_input(shape, seed, non_finite=False)
    x = torch.where(x.abs() > 2.0**15, torch.copysign(torch.tensor(2.0**15), x), x)
    rows, cols = shape
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, 13, (-(-rows // 16), -(-cols // 16)), generator=g).float()
    return x * torch.exp2(-k).repeat_interleave(16, 0)[:rows].repeat_interleave(16, 1)[:, :cols]


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nvfp4_block_2d_matches_reference(rounding: str, dtype: torch.dtype) -> None:
    """One E4M3 scale per 16x16 tile, along dim 0 and 1 (stochastic rounding draws by position in the layout of
    ``dim``, as the reference does), with partial tiles at either edge, and a transposed view."""
    tq = TensorQuant("nvfp4", rounding=rounding, block_2d=True)
    for i, shape in enumerate(TILE_SHAPES):
        x = tile_input(shape, 80 + i).to(dtype)
        for dim in (0, 1):
            check(tq, x, dim)
    check(tq, tile_input((20, 33), 90).to(dtype).t(), 0)


def test_nvfp4_block_2d_differs_from_one_dimensional_blocks() -> None:
    """The tiles matter on these inputs: with 16x16 tiles the kernels give other values than with 16-element
    blocks (so the tests above would notice a kernel that ignored the option)."""
    x = tile_input((33, 47), 80).to(DEVICE)
    for dim in (0, 1):
        two_d = kernels.quantize(x, TensorQuant("nvfp4", block_2d=True), dim)
        assert not torch.equal(two_d, kernels.quantize(x, TensorQuant("nvfp4"), dim))


@pytest.mark.parametrize("case", NVFP4_EDGES)
def test_nvfp4_block_2d_tensor_scale_edges(case: str) -> None:
    """The tensor-scale rules with 16x16 tiles: zeros, NaN/Inf, tiny amax (the zero-tensor rule), huge amax."""
    x = nvfp4_edge_input(case, (17, 40))
    for rounding in ("rne", "sr"):
        for dim in (0, 1):
            check(TensorQuant("nvfp4", rounding=rounding, block_2d=True), x, dim)


# -- every format: dtypes, shapes, layout ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_abs_max_pre_pass_equals_abs_amax(dtype: torch.dtype) -> None:
    """The pre-passes' one-pass amax (``torch.aminmax``) equals ``x.abs().amax()`` in float32, with NaN wherever
    that has one and +0 (never -0) for zeros of either sign: whole tensors and along the last dim."""
    from fxquant.kernels.launch import abs_max

    g = torch.Generator().manual_seed(7)
    rows = [make_input((6, 40), 11, non_finite=True), torch.zeros(1, 40), -torch.zeros(1, 40),
            -make_input((1, 40), 12, non_finite=False).abs(), torch.full((1, 40), float("-inf"))]
    x = torch.cat(rows)[torch.randperm(10, generator=g)].to(dtype)
    for got, want in ((abs_max(x), x.abs().amax()), (abs_max(x, -1), x.abs().amax(-1))):
        want = want.to(torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num()) and not got[~got.isnan()].signbit().any()
    assert abs_max(-torch.zeros(3, dtype=dtype)).signbit().item() is False


@pytest.mark.parametrize("name", formats.names())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_default_options_all_dtypes_and_layouts(name: str, dtype: torch.dtype) -> None:
    tq = TensorQuant(name)
    x = make_input((3, 65, 4), 31, non_finite=name != "nvfp4").to(dtype)
    for dim in (0, 1, -1):
        check(tq, x, dim)
    check(tq, x[:, 1:, ::2], 1)  # a strided, offset view
    check(tq, make_input((), 32, non_finite=False).to(dtype), 0)  # 0-dim
    check(tq, torch.empty(0, 5, dtype=dtype), -1)  # empty


# -- stochastic rounding -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mxfp4_e2m1", "hifp8", "nvfp4"])
def test_stochastic_rounding_is_reproducible(name: str) -> None:
    tq = TensorQuant(name, rounding="sr")
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(41)).to(DEVICE)
    a = kernels.quantize(x, tq, -1, seed=99)
    assert_bitwise_equal(kernels.quantize(x, tq, -1, seed=99), a)
    assert not torch.equal(kernels.quantize(x, tq, -1, seed=100), a)
    # A seed beyond 32 bits uses its high word too, exactly as the reference does.
    check(tq, x.cpu(), -1, seed=2**40 + 99)
    check(tq, x.cpu(), -1, seed=-5)


def test_large_flat_index_hash_matches_reference() -> None:
    """Uniforms indexed past 2**16 rows/blocks: a long row, sr, MX (the whole hash path, one program)."""
    x = make_input((2, 40_000), 51, non_finite=False)
    check(TensorQuant("mxfp8_e4m3", rounding="sr"), x, -1)


# -- bad input ---------------------------------------------------------------------------------------------
def test_bad_input_raises_like_the_reference() -> None:
    tq = TensorQuant("mxfp8")
    with pytest.raises(ValueError, match="dtype"):
        kernels.quantize(torch.ones(4, dtype=torch.int32, device=DEVICE), tq)
    with pytest.raises(ValueError, match="dim=2"):
        kernels.quantize(torch.ones(4, 4, device=DEVICE), tq, dim=2)
    with pytest.raises(TypeError, match="TensorQuant"):
        kernels.quantize(torch.ones(4, device=DEVICE), "mxfp8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        kernels.quantize([1.0], tq)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_2d=True quantizes 2-D tensors"):
        kernels.quantize(torch.ones(2, 16, 16, device=DEVICE), TensorQuant("nvfp4", block_2d=True))


def test_gradient_is_straight_through_like_the_reference() -> None:
    """``kernels.quantize`` is differentiable as ``Format.quantize`` is: the gradient reaches x unchanged, also when
    another leaf needs one (the kernel's own result has no autograd history)."""
    x = make_input((3, 64), 71, non_finite=False).to(DEVICE).requires_grad_()
    w = torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE).requires_grad_()
    tq = TensorQuant("mxfp4_e2m1")
    y = kernels.quantize(x, tq)
    assert y.requires_grad
    (y * w).sum().backward()
    assert_bitwise_equal(x.grad, w.detach())
    assert_bitwise_equal(w.grad, tq.quantize(x.detach()))
    with torch.no_grad():
        assert not kernels.quantize(x, tq).requires_grad


def test_input_is_not_modified() -> None:
    x = make_input((4, 64), 61, non_finite=True).to(DEVICE)
    before = x.clone()
    for name in ("mxfp4_e2m1", "hifp8", "nvfp4"):
        kernels.quantize(x, TensorQuant(name), -1)
    assert_bitwise_equal(x, before)
