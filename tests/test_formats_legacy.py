"""The compatibility format hifp8_legacy_clamp: hifp8 except tiny non-zero values clamp up to +-2^-22."""
from __future__ import annotations

import pytest
import torch

from fxquant import formats, ops
from fxquant.formats.tensor_quant import TensorQuant
from tests.bitwise import assert_bitwise_equal

TINY = 2.0**-22


def _all_bf16() -> torch.Tensor:
    return torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("rounding", ["ta", "rne", "rz"])
def test_every_bf16_value_equals_hifp8_except_the_clamped_ones(rounding):
    x = _all_bf16().float()
    legacy = formats.get("hifp8_legacy_clamp").quantize(x, rounding=rounding)
    plain = formats.get("hifp8").quantize(x, rounding=rounding)
    clamped = (plain == 0) & (x != 0) & torch.isfinite(x)
    assert int(clamped.sum()) > 1000  # every bf16 magnitude below 2^-23 (and [2^-23, 2^-22) under rz)
    assert_bitwise_equal(legacy[~clamped], plain[~clamped])
    assert_bitwise_equal(legacy[clamped], torch.copysign(torch.full_like(x[clamped], TINY), x[clamped]))


def test_named_values_and_the_default_format_unchanged():
    x = torch.tensor([0.0, -0.0, 1e-30, -1e-9, 2.0**-24, 2.0**-23, 2.0**-22, 1.0, 5e4, float("inf"), float("nan")])
    want = torch.tensor([0.0, 0.0, TINY, -TINY, TINY, TINY, TINY, 1.0, 32768.0, float("inf"), float("nan")])
    got = formats.get("hifp8_legacy_clamp").quantize(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[:-1], want[:-1])
    assert torch.equal(got[1].signbit(), torch.tensor(False))  # -0 stays the single zero
    assert formats.get("hifp8").quantize(x)[2:5].eq(0).all()  # hifp8 itself still rounds them to 0
    assert "hifp8_legacy_clamp" not in formats.names() and "hifp8_legacy_clamp" in formats.compat_names()


def test_spec_string_op_and_encode_roundtrip():
    tq = TensorQuant("hifp8_legacy_clamp", rounding="ta")
    assert tq.spec() == "hifp8_legacy_clamp:rounding=ta,saturate=1"
    assert TensorQuant.from_spec(tq.spec()) == tq and tq != TensorQuant("hifp8")
    x = torch.randn(4, 40) * torch.logspace(-35, 3, 40, base=2.0)
    ref = tq.quantize(x)
    assert_bitwise_equal(ops.quantize_tensor(x.bfloat16(), tq), tq.quantize(x.bfloat16()))
    fmt = formats.get("hifp8_legacy_clamp")
    assert_bitwise_equal(fmt.decode(fmt.encode(x)), ref)
    torch.library.opcheck(torch.ops.fxquant.quantize.default, (x, tq.spec(), -1, None))


def test_options_validated():
    with pytest.raises(ValueError, match="scaling='tensor' is not offered for 'hifp8_legacy_clamp'"):
        TensorQuant("hifp8_legacy_clamp", scaling="tensor")
    with pytest.raises(ValueError, match="did you mean 'hifp8_legacy_clamp'"):
        formats.get("hifp8_legacy_clmp")


def test_scheme_yaml_uses_it_in_a_compiled_linear(tmp_path):
    import fxquant

    path = tmp_path / "legacy.yaml"
    path.write_text("name: legacy_clamp\nrules:\n  - linear: {fprop: {x: hifp8_legacy_clamp}}\n")
    lin = torch.nn.Linear(8, 4, bias=False)
    torch.nn.init.eye_(lin.weight)
    x = torch.tensor([[1e-9, -1e-10, 0.0, 1.0, 3.0, 0.0, 2.0**-30, 0.5]])
    y = fxquant.compile(lin, scheme=str(path), backend="aot_eager")(x)
    assert_bitwise_equal(y.detach(), torch.tensor([[TINY, -TINY, 0.0, 1.0]]))


def test_kernel_registry_runs_the_reference_for_it():
    from fxquant import kernels

    assert not kernels.has_kernel(formats.get("hifp8_legacy_clamp")) and kernels.has_kernel(formats.get("hifp8"))
    assert not kernels.has_kernel("hifp8_legacy_clamp") and kernels.has_kernel("hifp8")  # names too
    with pytest.raises(ValueError, match="hifp9"):
        kernels.has_kernel("hifp9")
    with pytest.raises(TypeError, match="a Format or a format name"):
        kernels.has_kernel(3)
    from fxquant.kernels.flash_attention_spec import QGEMM_KERNEL, operand_code

    legacy = TensorQuant("hifp8_legacy_clamp")
    with pytest.raises(ValueError, match=r"inside the flash-attention kernel \(a compatibility format that only the"):
        operand_code(legacy, "q")
    with pytest.raises(ValueError, match=r"inside the quantizing GEMM kernel .*\(a compatibility format"):
        operand_code(legacy, "a", QGEMM_KERNEL)
    with pytest.raises(ValueError, match=r"\(NVFP4's tensor scale needs the amax of a whole tensor\)"):
        operand_code(TensorQuant("nvfp4"), "q")
    x = torch.tensor([1e-9, -3.0])
    tq = TensorQuant("hifp8_legacy_clamp")
    assert_bitwise_equal(kernels._quantize_op_impl(x, tq.spec(), -1), tq.quantize(x))
