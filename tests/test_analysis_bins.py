"""The analysis sketches: fixed bins (exact threshold counts, bf16 == float32 bins, quantile accuracy),
block-relative histograms against the MX reference, mergeable moments, and the MX study's laws."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fxquant import formats
from fxquant.analysis import bins, moments, mx_study
from fxquant.analysis.aggregate import flow_counts
from fxquant.analysis.summary import AnalysisConfig, dense, summarize, tensor_counts
from fxquant.capture import stats as capture_stats
from fxquant.formats.options import ScaleMode
from fxquant.formats.tensor_quant import TensorQuant


def _data(n=1 << 14, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 20, (n,), generator=g).float())
    x[:8] = torch.tensor([448.0, -448.0, 57344.0, 6.0, 2.0**-10, -(2.0**-23), 0.0, -0.0])  # exact edges, zeros
    return x


def _hist(x):
    """(signed, binade) histograms of a float32/bf16 tensor."""
    signed, binade, _, _ = tensor_counts(x, x.dim() - 1)
    return signed, binade


@pytest.mark.parametrize("threshold", [448.0, 57344.0, 6.0, 7.5, 28.0, 32768.0, 40960.0, 2.0**-10, 2.0**-23, 1.0])
def test_counts_at_bin_edges_are_exact(threshold):
    x = _data()
    h, _ = _hist(x)
    mag = bins.magnitude(h)
    above, exact = bins.count_above(mag, threshold)
    at_most, exact2 = bins.count_at_most(mag, threshold)
    assert exact and exact2
    assert above == int((x.abs() > threshold).sum())
    assert at_most == int(((x.abs() <= threshold) & (x != 0)).sum())
    assert mag[0] == 2 and h.sum() == x.numel()


def test_bf16_bins_equal_float32_bins_and_binades_are_exact():
    x = _data().bfloat16()
    h16, b16 = _hist(x)
    h32, b32 = _hist(x.float())
    assert np.array_equal(h16, h32)
    assert np.array_equal(b16, b32)
    assert h16[0] == 1 and h16[bins.NMAG] == 1  # +0.0 and -0.0 told apart
    nz = x.float()[x.float() != 0]
    want = np.bincount((torch.frexp(nz)[1] - 1 + 127).clamp(min=0).numpy(), minlength=256)
    got = b32.copy()
    got[0] -= 2  # the two zeros
    assert np.array_equal(got, want)


def test_quantiles_exact_in_rank_within_one_bin_in_value():
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(1)) * 3 + 1
    h, _ = _hist(x)
    qs = (0.001, 0.05, 0.5, 0.95, 0.999)
    got = bins.quantiles(h, qs)
    want = torch.quantile(x.double(), torch.tensor(qs, dtype=torch.float64)).tolist()
    for q, w in zip(qs, want):
        assert abs(got[f"q{q:g}"] - w) <= abs(w) / 16 + 1e-12, (q, got[f"q{q:g}"], w)
    assert bins.quantiles(np.zeros(bins.NSIGNED, dtype=np.int64), qs) == {f"q{q:g}": None for q in qs}
    inf = torch.tensor([-math.inf] * 10 + [1.0] * 80 + [math.inf] * 10)  # ranks in the Inf bins: the infinities
    got = bins.quantiles(_hist(inf)[0], (0.01, 0.5, 0.99))
    assert got["q0.01"] == -math.inf and got["q0.99"] == math.inf and got["q0.5"] == pytest.approx(1.0, rel=1 / 16)


def test_a_quantile_whose_rank_ends_a_bin_is_that_bins_top_and_q1_is_the_largest_finite_value():
    """q * total landing exactly on a cumulative count, empty bins between the two occupied ones: the quantile is
    the top of the bin the rank ends in (1.0, or 0.0 for the zero bin), not the bottom of the next occupied bin
    (3.875); q = 1.0 is the top of the largest finite value's bin (4.0), not the Inf bin past it."""
    for x, want in (([1.0, 1.0, 4.0, 4.0], 1.0), ([0.0, 0.0, 4.0, 4.0], 0.0), ([-4.0, -4.0, 4.0, 4.0], -3.875)):
        got = bins.quantiles(_hist(torch.tensor(x))[0], (0.5, 1.0))
        assert got == {"q0.5": want, "q1": 4.0}, (x, got)


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1"])
def test_block_relative_histogram_gives_the_reference_saturation_and_flush_counts(name):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(48, 70, generator=g) * torch.exp2(torch.randint(-12, 12, (48, 70), generator=g).float())
    x[0, :5] = 0.0  # zeros inside a block, and a short last block (70 = 2 * 32 + 6)
    tq = TensorQuant(name)
    ref = capture_stats.compute(tq.quantize(x, 0), x, tq, 0)  # blocks along dim 0
    cfg = AnalysisConfig(formats=(name,), mx_formats=(), sample_blocks=0)
    s = summarize(0, {"blocked_dim": 0, "copy": "hp", "role": "output"}, x, cfg)
    numel, nonzero, flushed, saturated, nonfinite, below_clamp = flow_counts(s, name).tolist()
    assert (numel, nonzero, nonfinite, below_clamp) == (x.numel(), int((x != 0).sum()), 0, 0)
    assert 100 * saturated / numel == pytest.approx(ref["saturated_pct"], abs=1e-12)
    assert 100 * flushed / nonzero == pytest.approx(ref["flushed_pct"], abs=1e-12)


def test_element_format_counts_match_the_reference():
    x = _data(seed=3).reshape(64, -1)
    for name in ("hifp8", "fp8_e4m3", "fp8_e5m2"):
        tq = TensorQuant(name)
        q = tq.quantize(x)
        ref = capture_stats.compute(q, x, tq, -1)
        s = summarize(0, {"copy": "hp", "role": "output"}, x, AnalysisConfig((name,), (), sample_blocks=0))
        numel, nonzero, flushed, saturated, _, _ = flow_counts(s, name).tolist()
        assert 100 * saturated / numel == pytest.approx(ref["saturated_pct"], abs=1e-12)
        assert flushed == int(((q == 0) & (x != 0)).sum()) + (1 if name == "hifp8" else 0)  # HiF8: the -2^-23 tie rounds away, counted flushed


def test_moments_merge_equals_moments_of_the_concatenation():
    parts = [torch.randn(n, generator=torch.Generator().manual_seed(n)) * (n % 7 + 1) + n for n in (1, 10, 1000, 4096)]
    m = moments.Moments()
    for p in parts:
        m.merge(tensor_counts(p, 0)[3])
    whole = torch.cat(parts).double()
    d = m.to_dict()
    assert d["mean"] == pytest.approx(whole.mean().item(), rel=1e-6)
    assert d["std"] == pytest.approx(whole.std().item(), rel=1e-5)
    assert (d["min"], d["max"], d["numel"], d["tensors"]) == (whole.min().item(), whole.max().item(), whole.numel(), 4)
    bad = tensor_counts(torch.tensor([1.0, math.nan, math.inf, -3.0]), 0)[3]
    assert (bad.nan, bad.inf, bad.n_finite, bad.min, bad.max) == (1, 1, 2, -3.0, 1.0)


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1", "mxint8"])
def test_offset_zero_is_the_reference_and_input_scaling_commutes(name):
    fmt = formats.get(name)
    g = torch.Generator().manual_seed(4)
    xb = torch.randn(64, 32, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g).float())
    for mode in ScaleMode:
        q0, _ = mx_study.quantize_with_offset(xb, fmt, mode, 0)
        ref = fmt.quantize(xb, -1, scale_mode=mode)
        assert torch.equal(q0.view(torch.int32), ref.view(torch.int32)), mode
        for k in (-3, 1, 5):  # the law: MX quantization commutes with powers of two (in range)
            assert torch.equal(fmt.quantize(xb * 2.0**k, -1, scale_mode=mode), ref * 2.0**k)
    # an offset acts on the shared exponent: +1 halves the elements, so none reaches max normal (floor)
    q1, p1 = mx_study.quantize_with_offset(xb, fmt, ScaleMode.FLOOR, 1)
    assert p1.abs().max() <= 2.0**fmt.element.emax < fmt.element.max_normal
    assert not torch.equal(q1, mx_study.quantize_with_offset(xb, fmt, ScaleMode.FLOOR, 0)[0])


def test_study_recommends_the_best_sqnr_and_prefers_floor_on_ties():
    xb = mx_study.sample_blocks(torch.randn(16, 128, generator=torch.Generator().manual_seed(5)), 1, 64, 0)
    sums = mx_study.study(xb, ("mxfp4_e2m1",), (-1, 0, 1))
    rows = [mx_study.metrics(f, m, k, "all", s, 1.0) for (f, m, k), s in sums.items()]
    best = mx_study.recommend(rows)[("mxfp4_e2m1", "all")]
    assert best.sqnr_db == max(r.sqnr_db for r in rows)
    same = [mx_study.StudyRow("f", m, k, "all", 1, 0.0, 0.0, 10.0, None, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
            for m in ("even", "rceil", "floor") for k in (1, -1, 0)]
    assert (mx_study.recommend(same)[("f", "all")].scale_mode, mx_study.recommend(same)[("f", "all")].offset) == ("floor", 0)


def test_bf16_pattern_path_equals_the_float32_path():
    cfg = AnalysisConfig(("hifp8", "mxfp8_e4m3"), (), sample_blocks=0)
    x = _data(seed=6).reshape(32, -1).bfloat16()
    for t in (x, torch.cat([x[:1], torch.tensor([[math.nan, math.inf, -math.inf] + [0.0] * (x.shape[1] - 3)])])
              .bfloat16()):
        s16 = summarize(0, {"copy": "hp", "role": "output"}, t, cfg)
        s32 = summarize(0, {"copy": "hp", "role": "output"}, t.float(), cfg)
        h16, h32 = (np.asarray(s.signed[1]) for s in (s16, s32))
        d16 = np.zeros(bins.NSIGNED, dtype=np.int64)
        d16[s16.signed[0]] = h16
        d32 = np.zeros(bins.NSIGNED, dtype=np.int64)
        d32[s32.signed[0]] = h32
        assert np.array_equal(d16, d32)  # -0.0 included (bin NMAG)
        assert np.array_equal(dense(s16.rel, bins.NREL), dense(s32.rel, bins.NREL))
        m16, m32 = s16.moments.to_dict(), s32.moments.to_dict()
        for k in ("numel", "finite", "nan", "inf", "min", "max", "amax", "zero_fraction"):
            assert m16[k] == m32[k], k
        assert m16["mean"] == pytest.approx(m32["mean"], rel=1e-6)
        assert m16["std"] == pytest.approx(t.float()[torch.isfinite(t.float())].double().std().item(), rel=1e-9)


def test_study_and_nvfp4_sample_leave_out_the_pads_of_short_blocks():
    """Rows of 33 elements: 2 blocks each, the second holding 1 element and 31 pads. Every statistic counts
    the 2112 elements of the tensor, as the capture statistics of fxquant.formats' own quantization do."""
    x = torch.randn(64, 33, generator=torch.Generator().manual_seed(0)) * 100
    blocks = mx_study.sample_blocks(x, 1, 10**6, 0)
    assert blocks.values.shape == (128, 32) and blocks.numel == x.numel() == 2112
    sums = mx_study.study(blocks, ("mxfp8_e4m3",), (0,))[("mxfp8_e4m3", "floor", 0)]
    row = mx_study.metrics("mxfp8_e4m3", "floor", 0, "all", sums, float(x.abs().max()))
    q = formats.get("mxfp8_e4m3").quantize(x, -1)
    ref = capture_stats.compute(q, x, TensorQuant.from_spec("mxfp8_e4m3"), -1)
    err = (q.double() - x.double())
    assert row.n == 2112 and ref["saturated_pct"] > 1
    assert row.mse == pytest.approx(ref["mse"], rel=1e-12) and row.mae == pytest.approx(err.abs().mean().item())
    assert row.saturated_pct == pytest.approx(ref["saturated_pct"], rel=1e-12)
    assert row.psnr_db == pytest.approx(10 * math.log10(x.abs().max().item() ** 2 / ref["mse"]), rel=1e-12)
    nv = mx_study.nvfp4_sample(blocks, float(x.abs().max()))
    q4 = formats.get("nvfp4").quantize(x, -1)
    ref4 = capture_stats.compute(q4, x, TensorQuant.from_spec("nvfp4"), -1)
    assert nv[0] == 2112 and nv[1] == 2112
    assert 100 * nv[3] / nv[0] == pytest.approx(ref4["saturated_pct"], rel=1e-12) and nv[3] > 0
    assert 100 * nv[2] / nv[1] == pytest.approx(ref4["flushed_pct"], rel=1e-12)


def test_sampled_clip_percentages_leave_out_the_pads_of_short_blocks():
    """Blocked along dim 0 of 33 rows (the reference path, not the histograms): the saturated share is of the
    tensor's elements, as the capture statistics give it, not of the zero-padded blocks."""
    from fxquant.analysis import summary

    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(1)) * 10
    tq = TensorQuant.from_spec("mxfp4_e2m1")
    q = tq.quantize(x, 0)
    ref = capture_stats.compute(q, x, tq, 0)
    got = summary._clip_stats(q, x, {"qspec": tq.spec(), "blocked_dim": 0}, None)
    assert ref["saturated_pct"] > 1 and got["clip_source"] == "reference"
    assert got["saturated_pct"] == pytest.approx(ref["saturated_pct"], rel=1e-12)
    assert got["flushed_pct"] == pytest.approx(ref["flushed_pct"], rel=1e-12)


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp4_e2m1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_holding_nan_or_inf_are_counted_apart_not_as_flushed(name, dtype):
    """MX quantizes a block holding a NaN or an Inf to NaN: its elements are neither flushed nor saturated
    nor non-zero, but counted in nonfinite_blocks; the other blocks' counts equal the reference's."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(16, 70, generator=g) * torch.exp2(torch.randint(-8, 8, (16, 70), generator=g).float())).to(dtype)
    x[0, 3], x[1, 40], x[2, 66], x[3, 0] = math.inf, -math.inf, math.nan, 0.0  # 66: in the short last block
    tq = TensorQuant(name)
    q = tq.quantize(x.float(), -1)
    cfg = AnalysisConfig(formats=(name,), mx_formats=(), sample_blocks=0)
    s = summarize(0, {"copy": "hp", "role": "output"}, x, cfg)
    numel, nonzero, flushed, saturated, nonfinite, _ = flow_counts(s, name).tolist()
    xf = x.float()
    good = torch.isfinite(q)  # the blocks without NaN/Inf
    assert nonfinite == int((~good).sum()) == 32 + 32 + 6 and numel == x.numel()
    assert nonzero == int((good & (xf != 0)).sum())
    assert flushed == int((good & (xf != 0) & (q == 0)).sum())
    ref = capture_stats.compute(tq.quantize(torch.where(good, xf, 0.0), -1), torch.where(good, xf, 0.0), tq, -1)
    assert 100 * saturated / numel == pytest.approx(ref["saturated_pct"], abs=1e-12) and saturated > 0


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp4_e2m1"])
def test_elements_below_every_element_bin_of_their_block_are_counted_flushed_not_zero(name):
    """2**-80 and -2**-90 in a block whose amax is 2**60 lie below the smallest element-domain bin of the format
    (block-relative bins clamped at the bottom end): non-zero and flushed, as the reference quantizer has them,
    not counted with the exact zeros."""
    x = torch.zeros(2, 32)
    x[0, :3] = torch.tensor([2.0**60, 2.0**-80, -(2.0**-90)])
    x[1] = 1.0
    q = TensorQuant(name).quantize(x, -1)
    assert int(((q == 0) & (x != 0)).sum()) == 2
    s = summarize(0, {"copy": "hp", "role": "output"}, x, AnalysisConfig((name,), (), sample_blocks=0))
    numel, nonzero, flushed, saturated, nonfinite, below_clamp = flow_counts(s, name).tolist()
    assert (numel, nonzero, flushed, saturated, nonfinite, below_clamp) == (64, 35, 2, 0, 0, 0)


@pytest.mark.parametrize("threshold", [127 / 64, 65504.0])
def test_counts_at_thresholds_inside_a_bin_are_labelled_upper_bounds(threshold):
    """127/64 (MXINT8) and 65504 (fp16) are no bin edges: their bin counts whole, so the count is an upper
    bound (exact False) that holds every value truly beyond the threshold."""
    j = bins.mag_bin_of(threshold)
    lo, hi = bins.upper_edges()[j - 1], bins.upper_edges()[j]
    assert lo < threshold < hi
    inside = [(lo + threshold) / 2, (threshold + hi) / 2, -(threshold + hi) / 2]  # both sides, in the same bin
    x = torch.cat([_data(), torch.tensor(inside, dtype=torch.float32)])
    mag = bins.magnitude(_hist(x)[0])
    above, exact = bins.count_above(mag, threshold)
    at_most, exact2 = bins.count_at_most(mag, threshold)
    assert not exact and not exact2
    assert above == int((x.abs() > lo).sum()) >= int((x.abs() > threshold).sum()) + 1
    assert at_most == int(((x.abs() <= hi) & (x != 0)).sum()) >= int(((x.abs() <= threshold) & (x != 0)).sum()) + 2


def test_mxint8_saturation_is_an_upper_bound_holding_the_reference_count():
    """MXINT8's max normal 127/64 lies inside the bin (1.9375, 2]: the saturated count is that bin's count,
    never below the reference's (it was 0 when the bin was left out), and the overflow table says so."""
    from fxquant.analysis.overflow import _method

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=g)
    x[:, 0] = 1.995 * 2.0 ** torch.randint(-3, 3, (256,), generator=g).float()  # (127/64, 2) after scaling
    tq = TensorQuant("mxint8")
    ref = capture_stats.compute(tq.quantize(x, -1), x, tq, -1)
    s = summarize(0, {"copy": "hp", "role": "output"}, x, AnalysisConfig(("mxint8",), (), sample_blocks=0))
    saturated = int(flow_counts(s, "mxint8")[3])
    blocks = x.abs().reshape(256, -1, 32)
    elem = blocks / torch.exp2(torch.floor(torch.log2(blocks.amax(-1, keepdim=True))))  # floor scale, emax 0
    assert round(ref["saturated_pct"] * x.numel() / 100) == int((elem > 127 / 64).sum()) > 0
    assert saturated == int((elem > 1.9375).sum()) >= int((elem > 127 / 64).sum())
    assert "saturated is an upper bound (1.984375" in _method("mxint8", flow_counts(s, "mxint8"))
    assert _method("mxfp8_e4m3", flow_counts(s, "mxfp8_e4m3")).endswith("exact")


def test_quantile_accuracy_statement_holds_for_normals_and_subnormals():
    """What global_stats.json says about quantile accuracy is what the bins give: within 6.25 % for normal
    float32 values; for subnormals within 2**-130 absolute, where the relative error can exceed 6.25 %."""
    from fxquant.analysis.stats_report import QUANTILE_ACCURACY

    g = torch.Generator().manual_seed(9)
    qs = (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99)
    normal = torch.randn(1 << 14, generator=g) * 100
    sub = torch.rand(1 << 14, generator=g) * 2.0**-128  # float32 subnormals
    worst_sub_rel = 0.0
    for x, subnormal in ((normal, False), (sub, True)):
        got = bins.quantiles(_hist(x)[0], qs)
        xs = x.double().sort().values
        for q in qs:
            k = min(int(q * x.numel()), x.numel() - 2)
            true, err = min(((xs[i].item(), abs(got[f"q{q:g}"] - xs[i].item())) for i in (k - 1, k, k + 1)),
                            key=lambda t: t[1])  # exact in rank: at one of the order statistics around q * n
            if subnormal:
                assert err <= 2.0**-130
                worst_sub_rel = max(worst_sub_rel, err / abs(true))
            else:
                assert err <= abs(true) / 16
    assert worst_sub_rel > 1 / 16  # the 6.25 % bound does not reach subnormals, and the statement says so
    assert "6.25%" in QUANTILE_ACCURACY and "2**-130" in QUANTILE_ACCURACY and "subnormal" in QUANTILE_ACCURACY


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_values_near_the_float32_max_are_finite_in_every_count(dtype):
    """Finite values above 1.9375 * 2**127 share bit-bin 4080 with Inf: they were read as Inf (quantiles -inf/inf
    with no Inf in the tensor) and left out of the saturated counts labelled exact (0 of 24 above 448)."""
    big = torch.tensor([3.3e38, 3.38e38, -3.36e38, 1.0, 3.389e38, -(2.0**127) * 1.96] * 8).to(dtype)
    assert torch.isfinite(big).all()  # bf16 too: its largest value is 3.3895e38
    x = torch.cat([big, torch.tensor([math.inf, -math.inf, math.inf]).to(dtype)])
    signed, _, _, m = tensor_counts(x, 0)
    assert m.inf == 3 and signed[bins.INF_BIN] == 2 and signed[bins.NMAG + bins.INF_BIN] == 1
    finite = x[torch.isfinite(x)].float()
    top = finite.abs() > 1.875 * 2.0**127
    assert signed[bins.TOP_BIN] == int((top & (finite > 0)).sum()) and signed[bins.NMAG + bins.TOP_BIN] == int(
        (top & (finite < 0)).sum())
    q = bins.quantiles(signed, (0.05, 0.5, 0.9))
    assert -bins.FLT_MAX <= q["q0.05"] < -1.875 * 2.0**127 and 1.875 * 2.0**127 < q["q0.9"] <= bins.FLT_MAX
    assert bins.quantiles(tensor_counts(torch.tensor([math.inf, 1.0]).to(dtype), 0)[0], (0.99,))["q0.99"] == math.inf
    assert bins.count_above(bins.magnitude(signed), 448.0) == (int((finite.abs() > 448).sum()), True)
    s = summarize(0, {"copy": "hp", "role": "output"}, big.reshape(1, -1), AnalysisConfig(("fp8_e4m3",), (), sample_blocks=0))
    assert flow_counts(s, "fp8_e4m3").tolist()[3] == int((big.float().abs() > 448).sum())
    assert bins.mag_bin_of(bins.FLT_MAX) == bins.TOP_BIN and bins.mag_bin_of(math.inf) == bins.INF_BIN


def test_a_study_scaled_past_the_float32_range_reports_an_unbounded_error():
    """A finite block near the float32 max: some scale rules and offsets scale it past float32 (err_sq inf), and
    metrics raised 'math domain error' (log10 of 0), ending `fxquant report` and `mx-sweep` with a half-written
    report; such a configuration's SQNR and PSNR are -inf, as what-if reports them."""
    xb = mx_study.sample_blocks(torch.tensor([[3e38, 1.0] * 16]), 1, 64, 0)
    sums = mx_study.study(xb, ("mxfp4_e2m1",), (0, 1))
    rows = {(m, k): mx_study.metrics(f, m, k, "all", s, 3e38) for (f, m, k), s in sums.items()}
    unbounded = [key for key, r in rows.items() if r.sqnr_db == -math.inf]
    assert ("floor", 1) in unbounded and ("floor", 0) not in unbounded
    assert all(rows[key].psnr_db == -math.inf and rows[key].cosine is None for key in unbounded)
    assert math.isfinite(rows[("floor", 0)].sqnr_db)
    best = mx_study.recommend(list(rows.values()))[("mxfp4_e2m1", "all")]
    assert best.sqnr_db == max(r.sqnr_db for r in rows.values())
