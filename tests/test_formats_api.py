"""The public API of fxquant.formats: names, lookup, shapes, dtypes, layouts and bad input."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxquant import formats
from fxquant.cli import main as cli_main
from fxquant.formats.tensor_quant import TensorQuant
from tests.bitwise import assert_bitwise_equal

ALL = formats.names()


def test_names_and_aliases():
    assert ALL == [
        "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1", "mxint8",
        "nvfp4", "hifp8", "fp8_e4m3", "fp8_e5m2", "bf16", "fp16",
    ]  # fmt: skip
    assert formats.get("mxfp8") is formats.get("mxfp8_e4m3")
    assert formats.get("mxfp4") is formats.get("mxfp4_e2m1")
    assert formats.get("hif8") is formats.get("hifp8")
    assert formats.get(" MXFP8 ") is formats.get("mxfp8_e4m3")


def test_unknown_name_did_you_mean():
    with pytest.raises(ValueError, match=r"unknown format 'mxfp8_e4m4'.*did you mean 'mxfp8_e4m3'.*known formats: mxfp8_e4m3"):
        formats.get("mxfp8_e4m4")
    with pytest.raises(TypeError):
        formats.get(8)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.complex64, torch.float64, torch.bool])
def test_rejects_non_float_dtypes(dtype):
    x = torch.zeros(4, dtype=dtype)
    with pytest.raises(ValueError, match=r"dtype .* quantize takes floating tensors"):
        formats.get("hifp8").quantize(x)


def test_rejects_bad_dim_and_options():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"dim=2 is out of range .* allowed \[-2, 1\]"):
        formats.get("mxfp8").quantize(x, dim=2)
    with pytest.raises(TypeError, match="dim must be an int"):
        formats.get("mxfp8").quantize(x, dim=1.0)
    with pytest.raises(ValueError, match=r"rounding='nearest' is not allowed; choose one of \['rne', 'ta', 'sr', 'rz'\]"):
        formats.get("mxfp8").quantize(x, rounding="nearest")
    with pytest.raises(ValueError, match=r"scale_mode='flor'.*did you mean 'floor'"):
        formats.get("mxfp8").quantize(x, scale_mode="flor")
    with pytest.raises(ValueError, match="scale_mode=.* applies to MX"):
        formats.get("hifp8").quantize(x, scale_mode="floor")
    with pytest.raises(ValueError, match="scaling='tensor' is not offered for 'bf16'"):
        formats.get("bf16").quantize(x, scaling="tensor")
    with pytest.raises(ValueError, match=r"scale_target=1000.0 must lie in \[2\*\*-126 \(1.17549e-38\), 448\]"):
        formats.get("fp8_e4m3").quantize(x, scaling="tensor", scale_target=1000.0)
    with pytest.raises(TypeError, match="mxfp8_e4m3 has no option 'blocksize'; its options: rounding, scale_mode"):
        formats.get("mxfp8").quantize(x, blocksize=16)
    with pytest.raises(TypeError, match="nvfp4 has no option 'scaling'"):
        formats.get("nvfp4").quantize(x, scaling="tensor")
    with pytest.raises(ValueError, match=r"scale_target='abc' must be a number in \[2\*\*-126 .*, 448\] for 'fp8_e4m3'"):
        formats.get("fp8_e4m3").quantize(x, scaling="tensor", scale_target="abc")
    with pytest.raises(ValueError, match="scale_target='abc' in spec .*: must be a number"):
        TensorQuant.from_spec("fp8_e4m3:scaling=tensor,scale_target=abc")
    with pytest.raises(ValueError, match="applies to MX block formats only, not 'hifp8_legacy_clamp'"):
        formats.get("hifp8_legacy_clamp").quantize(x, scale_mode="floor")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        formats.get("mxfp8").quantize([1.0, 2.0])


@pytest.mark.parametrize("name", ALL)
def test_quantize_is_differentiable_straight_through(name):
    """The gradient reaches x unchanged (as through fxquant::quantize), whatever the format's arithmetic; the values
    are the no-grad values."""
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)).requires_grad_()
    fmt = formats.get(name)
    y = fmt.quantize(x)
    (y * torch.arange(50.0)).sum().backward()
    assert torch.equal(y.detach(), fmt.quantize(x.detach()))
    assert torch.equal(x.grad, torch.arange(50.0).expand(4, 50))


def test_seed_keys_differ_for_seeds_that_share_their_words():
    """Seeds whose 32-bit words are equal as a set, or one word moved to the other, get different keys (and SR
    streams); a tensor seed gets the int seed's key."""
    from fxquant.formats._bits import seed_key

    pairs = [(1, 2**32), (0, -1), ((3 << 32) | 5, (5 << 32) | 3), (7, 7 << 32)]
    for a, b in pairs:
        assert seed_key(a) != seed_key(b), (a, b)
    for seed in (0, 1, 2**32, (3 << 32) | 5, 2**63 - 1):
        assert int(seed_key(torch.tensor(seed, dtype=torch.int64))) == seed_key(seed)
    x = torch.rand(4, 64)
    fmt = formats.get("mxfp4")
    assert not torch.equal(fmt.quantize(x, rounding="sr", seed=1), fmt.quantize(x, rounding="sr", seed=2**32))


@pytest.mark.parametrize("name", ALL)
def test_zero_dim_and_empty(name):
    fmt = formats.get(name)
    s = torch.tensor(1.3)
    out = fmt.quantize(s)
    assert out.shape == () and out.dtype == s.dtype
    assert_bitwise_equal(fmt.decode(fmt.encode(s)), out)
    for shape, dim in [((0,), 0), ((3, 0), 1), ((0, 40), 1), ((0, 40), 0)]:
        e = torch.empty(shape)
        assert fmt.quantize(e, dim).shape == shape
        enc = fmt.encode(e, dim)
        assert enc.codes.shape == shape
        assert fmt.decode(enc).shape == shape
        if name == "nvfp4" and len(shape) == 2:  # 16x16 tiles of an empty matrix (encode raised IndexError)
            assert fmt.quantize(e, dim, block_2d=True).shape == shape
            assert fmt.decode(fmt.encode(e, dim, block_2d=True)).shape == shape


@pytest.mark.parametrize("name", ALL)
def test_non_finite_never_crash(name):
    x = torch.tensor([[math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, 3e38, 1e-45] * 5])
    out = formats.get(name).quantize(x)
    assert out.shape == x.shape and torch.isnan(out[0, 0])


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=15, deadline=None)
@given(
    shape=st.lists(st.integers(1, 37), min_size=1, max_size=3),
    dim_seed=st.integers(0, 100),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    rounding=st.sampled_from(["rne", "ta", "rz", "sr"]),
    transpose=st.booleans(),
)
def test_quantize_contract(name, shape, dim_seed, dtype, rounding, transpose):
    """Same shape/dtype, input untouched, layout-independent, decode(encode(x)) == quantize(x)."""
    fmt = formats.get(name)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(dim_seed)) * 3).to(dtype)
    if transpose and x.dim() >= 2:
        x = x.transpose(0, -1)  # non-contiguous
    dim = dim_seed % x.dim()
    before = x.clone()
    out = fmt.quantize(x, dim, rounding=rounding, seed=11)
    assert torch.equal(x, before)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    assert_bitwise_equal(fmt.quantize(x.contiguous(), dim, rounding=rounding, seed=11), out)
    enc = fmt.encode(x, dim, rounding=rounding, seed=11)
    assert enc.codes.shape == x.shape
    if fmt.block_size:
        assert enc.scales.dtype == torch.uint8
        assert enc.scales.shape[dim] == -(-x.shape[dim] // fmt.block_size)
    assert_bitwise_equal(fmt.decode(enc), out)


def test_blocked_dim_matters():
    x = torch.randn(32, 32)
    x[0, 0] = 1000.0  # one huge value: its block is coarse; which block depends on dim
    fmt = formats.get("mxfp8")
    rows, cols = fmt.quantize(x, dim=1), fmt.quantize(x, dim=0)
    assert not torch.equal(rows, cols)
    assert torch.equal(rows, fmt.quantize(x.t().contiguous(), dim=0).t())


def test_tensor_quant_roundtrip_and_equality():
    tq = TensorQuant("mxfp8", rounding="sr")
    assert tq.spec() == "mxfp8_e4m3:rounding=sr,scale_mode=floor,saturate=1"
    assert TensorQuant.from_spec(tq.spec()) == tq
    assert TensorQuant("hif8") == TensorQuant("hifp8", rounding="ta", saturate=True)
    assert TensorQuant.from_spec("hifp8:scaling=tensor,scale_target=224.0").options.scale_target == 224.0
    with pytest.raises(ValueError, match="bad option 'roundng=rne'.*did you mean 'rounding'"):
        TensorQuant.from_spec("mxfp8:roundng=rne")
    with pytest.raises(ValueError, match=r"^option 'rounding' in spec 'mxfp8:rounding' needs a value: rounding=VALUE$"):
        TensorQuant.from_spec("mxfp8:rounding")  # was "bad option ... (did you mean 'rounding'?)"
    with pytest.raises(ValueError, match="bad option 'roundng'.*did you mean 'rounding'"):
        TensorQuant.from_spec("mxfp8:roundng")
    with pytest.raises(ValueError, match="unknown format"):
        TensorQuant("mxfp9")
    with pytest.raises(ValueError, match=r"scaling='tensor' does not apply to format 'mxfp8_e4m3', which is "
                                         r"block-scaled \(blocks of 32\): per-tensor scaling"):
        TensorQuant("mxfp8", scaling="tensor")  # was resolve()'s "unexpected keyword argument"
    with pytest.raises(ValueError, match="scale_target=224.0 does not apply to format 'nvfp4'"):
        TensorQuant.from_spec("nvfp4:scale_target=224.0")


@pytest.mark.parametrize("target", [1e-50, 1e-40, 2.0**-127, 0.0, -1.0, math.inf, math.nan, True, 449.0])
def test_scale_target_must_be_a_normal_float32_within_the_formats_range(target):
    # Below 2**-126 the float32 target is subnormal or 0 and the exponent read from its bits is wrong (1e-50 gave
    # a scale of 2048, 1e-40 one of 8.5e37): refused, wherever scale_target comes from.
    x = torch.tensor([1000.0, 3.0, 0.001])
    allowed = r"in \[2\*\*-126 \(1.17549e-38\), 448\] for 'fp8_e4m3' \(a positive, finite, normal float32"
    with pytest.raises(ValueError, match=allowed):
        formats.get("fp8_e4m3").quantize(x, scaling="tensor", scale_target=target)
    with pytest.raises(ValueError, match=allowed):
        TensorQuant("fp8_e4m3", scaling="tensor", scale_target=target)
    if not isinstance(target, bool):
        with pytest.raises(ValueError, match=allowed):
            TensorQuant.from_spec(f"fp8_e4m3:scaling=tensor,scale_target={target!r}")


def test_scale_target_at_the_smallest_normal_float32_is_accepted():
    tq = TensorQuant("fp8_e4m3", scaling="tensor", scale_target=2.0**-126)
    assert tq.options.scale_target == 2.0**-126
    # amax 1 is placed at 2**-126: k = -126, the tensor scale 2**-k = 2**126; the scale falls as the target rises
    x = torch.tensor([1.0, 0.5])
    scales = [
        formats.get("fp8_e4m3").encode(x, scaling="tensor", scale_target=t).tensor_scale.item()
        for t in (2.0**-126, 2.0**-100, 1.0, 448.0)
    ]
    assert scales == [2.0**126, 2.0**100, 1.0, 2.0**-8]


def test_a_repeated_option_in_a_spec_is_refused():
    with pytest.raises(ValueError, match=r"option 'rounding' is given twice in spec 'mxfp8:rounding=ta,rounding=rne'"):
        TensorQuant.from_spec("mxfp8:rounding=ta,rounding=rne")
    with pytest.raises(ValueError, match="option 'saturate' is given twice"):
        TensorQuant.from_spec("hifp8:saturate=0, saturate=0")


def test_quantize_op_matches_reference_and_passes_opcheck():
    from fxquant import ops

    x = torch.randn(5, 70)
    for spec in ("mxfp4_e2m1:rounding=rne,scale_mode=even,saturate=1", "hifp8:rounding=sr,saturate=0"):
        tq = TensorQuant.from_spec(spec)
        assert_bitwise_equal(ops.quantize_tensor(x, tq, 1, 3), tq.quantize(x, 1, seed=3))
        torch.library.opcheck(torch.ops.fxquant.quantize.default, (x, spec, 1, 3))
        torch.library.opcheck(torch.ops.fxquant.quantize.default, (x.t(), spec, 0, 3))


@pytest.mark.parametrize("seed", [2**63, 2**64 - 1, 2**64 + 5, 3 * 2**70 + 11, -(2**63) - 1])
def test_quantize_op_takes_every_seed_the_reference_takes(seed: int) -> None:
    """A seed outside int64 (the op schema's int) gives the reference's bits: the same low 64 bits, passed as
    the signed int64 (the dispatcher refused it); equal to the in-range seed of those bits."""
    from fxquant import ops

    x = torch.randn(5, 70)
    tq = TensorQuant.from_spec("mxfp8_e4m3:rounding=sr")
    want = tq.quantize(x, 1, seed=seed)
    assert_bitwise_equal(ops.quantize_tensor(x, tq, 1, seed), want)
    low = seed & (2**64 - 1)
    assert_bitwise_equal(ops.quantize_tensor(x, tq, 1, low - 2**64 if low >= 2**63 else low), want)
    assert not torch.equal(want, tq.quantize(x, 1, seed=seed + 1))


def test_cli_formats_table(capsys):
    assert cli_main(["formats"]) == 0
    out = capsys.readouterr().out
    for name in ALL:
        assert name in out
    assert "mxfp8_e4m3 (mxfp8)" in out and "0x6F/0xEF +-Inf" in out and "127/64" in out
    assert cli_main(["formats", "--json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)
    assert {r["format"] for r in rows if not r.get("compatibility")} == set(ALL)  # names formats.get takes
    assert {r["format"] for r in rows if r.get("compatibility")} == set(formats.compat_names())
    by_name = {r["format"]: r for r in rows}
    assert by_name["mxfp8_e4m3"]["aliases"] == ["mxfp8"] and by_name["fp8_e5m2"]["aliases"] == []
    assert all(formats.canonical_name(a) == r["format"] for r in rows for a in r["aliases"])
    assert by_name["mxint8"]["min normal"] == "-" and by_name["mxint8"]["min subnormal"] == "2^-6"  # FORMATS.md: -, 1/64
    assert by_name["mxfp8_e4m3"]["min normal"] == "2^-6"


CHUNK_CASES = [(n, r, {}) for n in ALL for r in ("rne", "ta", "rz", "sr")] + [
    ("mxfp8_e4m3", "rne", {"scale_mode": m}) for m in ("rceil", "ceil", "even")
] + [("hifp8", "ta", {"scaling": "tensor", "scale_target": 224.0}), ("fp8_e5m2", "sr", {"scaling": "tensor"})]


@pytest.mark.parametrize("name,rounding,extra", CHUNK_CASES, ids=[f"{n}-{r}-{'-'.join(e)}" for n, r, e in CHUNK_CASES])
def test_quantizing_in_row_slabs_equals_one_pass(name, rounding, extra):
    """The CPU reference quantizes large tensors in slabs of rows; any slab size gives the same bits."""
    fmt = formats.get(name)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(37, 100, generator=gen) * torch.pow(10.0, torch.empty(37, 1).uniform_(-3, 3, generator=gen))
    x[5, 7] = 1e4  # the tensor's amax sits in one slab only: NVFP4 and per-tensor scaling must see it in all
    d, opts, seed = fmt._prepare(x, -1, 9, rounding=rounding, **extra)
    whole = fmt._quantize_rows(x, opts, seed, torch.float32, chunk_elements=10**9)
    for chunk in (100, 350, 1000):  # 1, 3 and 10 rows per slab (the last slab short)
        assert_bitwise_equal(fmt._quantize_rows(x, opts, seed, torch.float32, chunk_elements=chunk), whole, f"chunk {chunk}")
    assert_bitwise_equal(fmt.quantize(x, rounding=rounding, seed=9, **extra), whole)
