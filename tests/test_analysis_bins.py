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


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1"])
def test_block_relative_histogram_gives_the_reference_saturation_and_flush_counts(name):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(48, 70, generator=g) * torch.exp2(torch.randint(-12, 12, (48, 70), generator=g).float())
    x[0, :5] = 0.0  # zeros inside a block, and a short last block (70 = 2 * 32 + 6)
    tq = TensorQuant(name)
    ref = capture_stats.compute(tq.quantize(x, 0), x, tq, 0)  # blocks along dim 0
    cfg = AnalysisConfig(formats=(name,), mx_formats=(), sample_blocks=0)
    s = summarize(0, {"blocked_dim": 0, "copy": "hp", "role": "output"}, x, cfg)
    numel, nonzero, flushed, saturated = flow_counts(s, name).tolist()
    assert (numel, nonzero) == (x.numel(), int((x != 0).sum()))
    assert 100 * saturated / numel == pytest.approx(ref["saturated_pct"], abs=1e-12)
    assert 100 * flushed / nonzero == pytest.approx(ref["flushed_pct"], abs=1e-12)


def test_element_format_counts_match_the_reference():
    x = _data(seed=3).reshape(64, -1)
    for name in ("hifp8", "fp8_e4m3", "fp8_e5m2"):
        tq = TensorQuant(name)
        q = tq.quantize(x)
        ref = capture_stats.compute(q, x, tq, -1)
        s = summarize(0, {"copy": "hp", "role": "output"}, x, AnalysisConfig((name,), (), sample_blocks=0))
        numel, nonzero, flushed, saturated = flow_counts(s, name).tolist()
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
