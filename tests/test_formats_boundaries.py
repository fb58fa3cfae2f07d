"""Named boundary cases of FORMATS.md, one rule per test, values written out by hand."""
from __future__ import annotations

import math

import pytest
import torch

from fxquant import formats

INF, NAN = math.inf, math.nan


def q(name: str, values, **opts) -> list[float]:
    return formats.get(name).quantize(torch.tensor(values, dtype=torch.float32), **opts).tolist()


# -- ties ------------------------------------------------------------------------------------------------
def test_rne_vs_ta_ties_e4m3():
    # 1.0625 is halfway between 1.0 (mantissa 000, even) and 1.125 (001, odd).
    assert q("fp8_e4m3", [1.0625, 1.1875, -1.0625], rounding="rne") == [1.0, 1.25, -1.0]
    assert q("fp8_e4m3", [1.0625, 1.1875, -1.0625], rounding="ta") == [1.125, 1.25, -1.125]
    assert q("fp8_e4m3", [1.0625, 1.124, -1.124], rounding="rz") == [1.0, 1.0, -1.0]


def test_hifp8_ties_away_by_default_and_rne_on_request():
    # In binade 2**0 HiF8 has 3 mantissa bits: 1.0625 is a tie between 1.0 and 1.125.
    assert q("hifp8", [1.0625, -1.0625]) == [1.125, -1.125]
    assert q("hifp8", [1.0625, 1.1875], rounding="rne") == [1.0, 1.25]
    # Binade 2**4 has 2 mantissa bits (step 4): 18 is a tie between 16 and 20.
    assert q("hifp8", [18.0]) == [20.0]
    assert q("hifp8", [18.0], rounding="rne") == [16.0]
    # A carry lands on the next power of two: 15.5 (binade 2**3, step 1) -> 16.
    assert q("hifp8", [15.5]) == [16.0]


# -- saturation ----------------------------------------------------------------------------------------
def test_saturation_at_and_past_max():
    assert q("fp8_e4m3", [448.0, 464.0, 479.0, 480.0, 1e30, -1e30]) == [448.0] * 4 + [448.0, -448.0]
    assert q("fp8_e5m2", [57344.0, 61439.0, 61440.0, 1e30]) == [57344.0] * 4
    assert q("fp8_e5m2", [57344.0, 61439.0, 61440.0, -1e30], saturate=False) == [57344.0, 57344.0, INF, -INF]
    # Round-toward-zero never overflows to Inf (IEEE 754).
    assert q("fp8_e5m2", [1e30], saturate=False, rounding="rz") == [57344.0]


def test_saturate_false_needs_inf():
    with pytest.raises(ValueError, match="saturate=False needs a format with Inf"):
        q("fp8_e4m3", [1.0], saturate=False)
    with pytest.raises(ValueError, match="always saturate"):
        q("mxfp8_e4m3", [1.0], saturate=False)


def test_hifp8_overflow_threshold_40960():
    below = 40960.0 - 2.0**-8  # the float32 just below 40960 (ulp 2**-8 in binade 2**15)
    vals = [32768.0, below, 40960.0, 1e9, -40960.0]
    assert q("hifp8", vals) == [32768.0, 32768.0, 32768.0, 32768.0, -32768.0]
    assert q("hifp8", vals, saturate=False) == [32768.0, 32768.0, INF, INF, -INF]
    # With rne the tie 1.25 * 2**15 goes to the even neighbour 2**15.
    assert q("hifp8", [40960.0, 40961.0], saturate=False, rounding="rne") == [32768.0, INF]


def test_non_finite_inputs():
    assert q("fp8_e5m2", [INF, -INF]) == [INF, -INF]  # Inf stays Inf where the format has Inf
    assert q("hifp8", [INF, -INF]) == [INF, -INF]
    r = q("fp8_e4m3", [INF, NAN, -INF])  # E4M3 has no Inf: NaN
    assert all(math.isnan(v) for v in r)
    assert math.isnan(q("hifp8", [NAN])[0])


# -- underflow and subnormals ---------------------------------------------------------------------------
def test_underflow_to_zero_and_subnormals_e4m3():
    half_min = 2.0**-10  # half of E4M3's min subnormal 2**-9: a tie between 0 (even) and 2**-9
    assert q("fp8_e4m3", [half_min], rounding="rne") == [0.0]
    assert q("fp8_e4m3", [half_min], rounding="ta") == [2.0**-9]
    assert q("fp8_e4m3", [half_min * 1.01, 2.0**-11]) == [2.0**-9, 0.0]
    assert q("fp8_e4m3", [3 * 2.0**-9, 7 * 2.0**-9]) == [3 * 2.0**-9, 7 * 2.0**-9]  # subnormals kept
    out = formats.get("fp8_e4m3").quantize(torch.tensor([-(2.0**-12)]))
    assert out.item() == 0.0 and out.signbit().item()  # -0 exists in OCP FP8


def test_hifp8_denormals_and_tiny_values():
    # Denormal range: neighbouring powers of two, tie at 1.5 * 2**e (ties away).
    assert q("hifp8", [2.0**-20, 1.5 * 2.0**-20, 1.49 * 2.0**-20]) == [2.0**-20, 2.0**-19, 2.0**-20]
    # [2**-23, 2**-22) rounds to 2**-22; below 2**-23 to 0 (the predecessor clamped these UP to 2**-22).
    assert q("hifp8", [2.0**-23, 1.9 * 2.0**-23, 0.99 * 2.0**-23, 1e-30]) == [2.0**-22, 2.0**-22, 0.0, 0.0]
    out = formats.get("hifp8").quantize(torch.tensor([-0.0, -1e-30]))
    assert out.tolist() == [0.0, 0.0] and not out.signbit().any()  # 0x00 is the only zero
    assert formats.get("hifp8").encode(torch.tensor([-0.0])).codes.item() == 0x00
    # Min normal 2**-15; between 2**-16 (denormal) and 2**-15 the tie is at 1.5 * 2**-16.
    assert q("hifp8", [1.5 * 2.0**-16, 1.4 * 2.0**-16]) == [2.0**-15, 2.0**-16]


def test_hifp8_tapered_steps():
    # Step at 2**E is 2**(E - m), m = 3 for |E| <= 3, 2 for 4..7, 1 for 8..15.
    assert q("hifp8", [8.0 + 1.0, 16.0 + 4.0, 256.0 + 128.0]) == [9.0, 20.0, 384.0]
    assert q("hifp8", [8.0 + 0.4, 16.0 + 1.9, 256.0 + 63.0]) == [8.0, 16.0, 256.0]


def test_mxint8_elements():
    x = torch.zeros(32)
    x[0] = 1.0  # amax 1: floor scale 2**0, elements on the 2**-6 grid, max 127/64
    x[1], x[2], x[3] = 1 / 128, 3 / 128, -5 / 128  # ties: 0.5, 1.5, -2.5 steps -> 0, 2, -2 (rne)
    out = formats.get("mxint8").quantize(x)
    assert out[:4].tolist() == [1.0, 0.0, 2 / 64, -2 / 64]
    x[0] = 1.999
    assert formats.get("mxint8").quantize(x)[0].item() == 127 / 64  # saturates, never 2.0


# -- MX scale modes -------------------------------------------------------------------------------------
def scale_code(name: str, amax: float, mode: str) -> int:
    x = torch.zeros(32)
    x[5] = amax
    return int(formats.get(name).encode(x, scale_mode=mode).scales.item())


@pytest.mark.parametrize("k", [-20, 0, 7])
def test_mx_scale_modes_around_the_largest_mantissa_e4m3(k):
    """E4M3: emax 8, max normal 1.75 * 2**8 = 448, 3 mantissa bits."""
    two_k = 2.0**k
    base = 127 + k - 8
    # amax = 1.75 * 2**k: every mode but rceil uses floor(log2) = k; the top element is exactly 448.
    assert scale_code("mxfp8_e4m3", 1.75 * two_k, "floor") == base
    assert scale_code("mxfp8_e4m3", 1.75 * two_k, "ceil") == base + 1
    assert scale_code("mxfp8_e4m3", 1.75 * two_k, "even") == base
    assert scale_code("mxfp8_e4m3", 1.75 * two_k, "rceil") == base  # d = 2**(k-8) exactly
    # amax = 1.875 * 2**k: floor clips it to 448 * X; rceil moves up one so it fits (240 * 2X).
    assert scale_code("mxfp8_e4m3", 1.875 * two_k, "floor") == base
    assert scale_code("mxfp8_e4m3", 1.875 * two_k, "rceil") == base + 1
    assert scale_code("mxfp8_e4m3", 1.875 * two_k, "even") == base  # 1.875 has 3 mantissa bits: no carry
    # amax = 1.96875 * 2**k (1.11111b): rounded to 3 bits it carries to 2.0, so even moves up one.
    assert scale_code("mxfp8_e4m3", 1.96875 * two_k, "even") == base + 1
    assert scale_code("mxfp8_e4m3", 1.96875 * two_k, "floor") == base
    # A power of two: ceil == floor.
    assert scale_code("mxfp8_e4m3", two_k, "ceil") == base


def test_mx_floor_clips_and_rceil_does_not():
    x = torch.zeros(32)
    x[0] = 1.875 * 2.0**8
    assert formats.get("mxfp8_e4m3").quantize(x, scale_mode="floor")[0].item() == 448.0
    assert formats.get("mxfp8_e4m3").quantize(x, scale_mode="rceil")[0].item() == 480.0


def test_mx_zero_block():
    enc = formats.get("mxfp4_e2m1").encode(torch.zeros(2, 64))
    assert enc.scales.tolist() == [[0, 0], [0, 0]]  # 2**-127
    assert formats.get("mxfp4_e2m1").decode(enc).abs().sum().item() == 0


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_mx_nan_or_inf_poisons_only_its_block(bad):
    x = torch.ones(96)
    x[40] = bad
    fmt = formats.get("mxfp8_e4m3")
    out = fmt.quantize(x)
    assert torch.isnan(out[32:64]).all() and not torch.isnan(out[:32]).any() and not torch.isnan(out[64:]).any()
    assert fmt.encode(x).scales.tolist() == [119, 255, 119]  # amax 1: floor gives 2**(0 - 8)


def test_mx_scale_clamped_at_minus_127():
    x = torch.zeros(32)
    x[0] = 2.0**-140  # a float32 subnormal
    x[1] = 2.0**-130  # amax: floor would give s = -138
    enc = formats.get("mxfp8_e4m3").encode(x)
    assert enc.scales.item() == 0
    # Elements are x / 2**-127: 2**-13 is below E4M3's min subnormal 2**-9 (-> 0); 2**-3 is representable.
    out = formats.get("mxfp8_e4m3").quantize(x)
    assert out[0].item() == 0.0 and out[1].item() == 2.0**-130
    y = torch.zeros(32)
    y[0] = 2.0**-120  # s = -128 -> -127, element 2**7 = 128 exactly representable
    assert formats.get("mxfp8_e4m3").quantize(y)[0].item() == 2.0**-120


def test_mx_scale_above_127_is_nan():
    x = torch.zeros(32)
    x[0] = 1.5 * 2.0**127  # ceil(log2) = 128, INT8 emax 0 -> s = 128 > 127
    enc = formats.get("mxint8").encode(x, scale_mode="ceil")
    assert enc.scales.item() == 255
    assert torch.isnan(formats.get("mxint8").quantize(x, scale_mode="ceil")).all()
    assert not torch.isnan(formats.get("mxint8").quantize(x, scale_mode="floor")).any()


def test_mx_short_last_block_is_zero_padded():
    x = torch.tensor([[1.0] * 32 + [0.3, -0.7, 0.05]])
    fmt = formats.get("mxfp8_e4m3")
    out = fmt.quantize(x)
    alone = fmt.quantize(torch.tensor([[0.3, -0.7, 0.05]]))
    assert torch.equal(out[:, 32:], alone)
    assert fmt.encode(x).scales.shape == (1, 2)


# -- NVFP4 ----------------------------------------------------------------------------------------------
def test_nvfp4_recipe_by_hand():
    """Two blocks of 16, the recipe evaluated step by step in float32 with plain torch arithmetic."""
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([6.0, -3.0, 0.4, 1.1])
    x[0, 16:18] = torch.tensor([0.02, -0.013])
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    g = f32(6.0) / f32(2688.0)
    e2m1_grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    e4m3 = formats.get("fp8_e4m3")

    def nearest_e2m1(v: torch.Tensor) -> torch.Tensor:  # no ties occur in this data
        idx = (v.abs().unsqueeze(-1) - e2m1_grid).abs().argmin(-1)
        return torch.copysign(e2m1_grid[idx], v)

    expected = torch.zeros(1, 32)
    for lo in (0, 16):
        blk = x[0, lo : lo + 16]
        b = e4m3.quantize(torch.clamp(blk.abs().max() / f32(6.0) / g, 2.0**-9, 448.0))
        p = nearest_e2m1(torch.clamp(blk * ((f32(1.0) / g) / b), -6.0, 6.0))
        expected[0, lo : lo + 16] = p * (g * b)
    assert e4m3.quantize(f32(6.0) / f32(6.0) / g).item() == 448.0  # block 0's scale
    fmt = formats.get("nvfp4")
    out = fmt.quantize(x)
    assert torch.equal(out, expected)
    enc = fmt.encode(x)
    assert enc.scales.shape == (1, 2) and enc.tensor_scale.item() == g.item()
    assert torch.equal(fmt.decode(enc), out)


def test_nvfp4_zero_and_nonfinite():
    assert formats.get("nvfp4").quantize(torch.zeros(3, 16)).abs().sum().item() == 0
    x = torch.ones(2, 16)
    x[1, 3] = INF
    assert torch.isnan(formats.get("nvfp4").quantize(x)).all()


# -- per-tensor scaling --------------------------------------------------------------------------------
def test_hifp8_tensor_scaling_power_of_two():
    x = torch.tensor([1e-4, 3e-5, -2e-4])
    fmt = formats.get("hifp8")
    out = fmt.quantize(x, scaling="tensor", scale_target=224.0)
    # amax 2e-4 * 2**k <= 224 < amax * 2**(k+1): k = 20 (2e-4 * 2**20 = 209.7)
    k = 20
    assert out.tolist() == (fmt.quantize(x * 2.0**k) / 2.0**k).tolist()
    enc = fmt.encode(x, scaling="tensor", scale_target=224.0)
    assert enc.tensor_scale.item() == 2.0**-k
    assert fmt.decode(enc).tolist() == out.tolist()


def test_fp8_tensor_scaling_uses_max_normal_by_default():
    x = torch.tensor([0.5, -1.0, 0.25])
    out = formats.get("fp8_e4m3").quantize(x, scaling="tensor")
    assert out.tolist() == [0.5, -1.0, 0.25]  # 1.0 * 2**8 = 256 <= 448: exact powers of two stay exact
    assert formats.get("fp8_e4m3").encode(x, scaling="tensor").tensor_scale.item() == 2.0**-8


def test_nvfp4_tensor_too_small_for_the_recipe_is_zero():
    # 1 / g overflows float32 for amax_tensor < 2688 * 2**-128: the tensor quantizes to zeros, never NaN.
    x = torch.tensor([[1e-37, -3e-38, 0.0] + [0.0] * 13])
    out = formats.get("nvfp4").quantize(x)
    assert torch.equal(out, torch.zeros_like(x))
    enc = formats.get("nvfp4").encode(x)
    assert enc.tensor_scale.item() == 0.0 and torch.equal(formats.get("nvfp4").decode(enc), out)
    y = torch.tensor([[1e-30, -3e-31] + [0.0] * 14])  # large enough: quantized normally
    assert formats.get("nvfp4").quantize(y)[0, 0].item() == pytest.approx(1e-30, rel=0.2)
