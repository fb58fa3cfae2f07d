"""fxquant.kernels.host: the numba one-pass reductions equal their pure-torch twins (counts and extrema
exactly, float64 sums to rounding) on every shape the callers pass, with zeros of both signs, subnormals,
NaN, Inf and short MX blocks; the capture statistics equal the torch definition in fxquant.capture.stats."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxquant.capture import stats as capture_stats
from fxquant.formats.tensor_quant import TensorQuant
from fxquant.kernels import host

pytestmark = pytest.mark.skipif(host.backend() != "numba", reason="numba is not installed: only the torch twins run")

SHAPES = [(), (1,), (5,), (64,), (3, 70), (4, 32), (2, 3, 96), (0,), (0, 32), (7, 1)]


def _tensor(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
    special = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 2.0**-140, -(2.0**-149), 3.0e38, -1.0])
    k = min(n, special.numel())
    pos = torch.randperm(n, generator=g)[:k]
    x[pos] = special[:k]
    return x.reshape(shape).to(dtype)


def _assert_same(a, b) -> None:
    for name in a.__dataclass_fields__:
        va, vb = getattr(a, name), getattr(b, name)
        if isinstance(va, np.ndarray):
            assert np.array_equal(va, vb), name
        elif isinstance(va, int):
            assert va == vb, name
        else:
            assert va == pytest.approx(vb, rel=1e-12, abs=1e-300), name


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [32, 16, 5])
def test_float32_counts_equal_the_torch_twin(shape, block):
    x = _tensor(shape, seed=len(shape) + block)
    _assert_same(host.f32_counts(x, block), host.f32_counts_torch(x, block))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [32, 7])
def test_bf16_counts_equal_the_torch_twin(shape, block):
    x = _tensor(shape, seed=len(shape) * 3 + block, dtype=torch.bfloat16)
    c = host.bf16_counts(x, block)
    _assert_same(c, host.bf16_counts_torch(x, block))
    assert c.patterns.sum() == x.numel() and c.rel.sum() == x.numel()


def test_bf16_pattern_histogram_is_the_pattern_count():
    x = _tensor((16, 64), seed=9, dtype=torch.bfloat16)
    want = np.bincount(x.view(torch.int16).numpy().view(np.uint16).reshape(-1), minlength=1 << 16)
    assert np.array_equal(host.bf16_counts(x).patterns, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 70), (256, 64)])
def test_pair_sums_equal_the_torch_twin(dtype, shape):
    x = _tensor(shape, seed=11, dtype=dtype)
    q = TensorQuant("mxfp4_e2m1").quantize(torch.nan_to_num(x.float()), -1).to(dtype) if x.numel() else x.clone()
    if x.numel() > 3:
        q.view(-1)[:3] = torch.tensor([math.nan, 0.0, math.inf], dtype=dtype)
    _assert_same(host.pair_sums(q, x), host.pair_sums_torch(q, x))


def test_counts_refuse_wrong_dtypes_and_blocks():
    with pytest.raises(TypeError, match="bf16_counts takes a torch.bfloat16 tensor"):
        host.bf16_counts(torch.zeros(4))
    with pytest.raises(ValueError, match="block=0"):
        host.f32_counts(torch.zeros(4), 0)


def test_pair_sums_refuse_mismatched_sizes():
    with pytest.raises(ValueError, match="elements"):
        host.pair_sums(torch.zeros(3), torch.zeros(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(0,), (1,), (300,), (64, 65)])
def test_capture_statistics_equal_the_torch_definition(dtype, shape):
    x = _tensor(shape, seed=13, dtype=dtype)
    got = capture_stats.unpack(capture_stats.pack_tensor_stats(x).tolist(), False)
    want = capture_stats.unpack(capture_stats.pack_tensor_stats_torch(x).tolist(), False)
    for k, v in want.items():
        if isinstance(v, float) and math.isfinite(v):
            assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-300), k
        else:
            assert got[k] == v, k


def test_capture_quantized_statistics_equal_the_torch_definition():
    x = _tensor((32, 96), seed=17)
    x = torch.nan_to_num(x, nan=1.0, posinf=2.0, neginf=-2.0)
    tq = TensorQuant("mxfp8_e4m3")
    q = tq.quantize(x, -1)
    got = capture_stats.pack_quantized_stats(q, x, tq, -1)
    want = capture_stats.pack_quantized_stats_torch(q, x, tq, -1)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    assert torch.equal(got[:3], want[:3])  # the counts exactly


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=200),
       st.integers(1, 40))
def test_counts_law_any_values_any_block(values, block):
    """Whatever the values: numba == torch twin, and every element is counted once in each histogram."""
    x = torch.tensor(values, dtype=torch.float32)
    c = host.f32_counts(x, block)
    _assert_same(c, host.f32_counts_torch(x, block))
    assert c.signed.sum() == c.binade.sum() == c.rel.sum() == x.numel()
    assert c.n_finite + c.nan + c.inf == x.numel()


def test_backend_switch(monkeypatch):
    monkeypatch.setenv("FXQUANT_HOST_KERNELS", "torch")
    assert host.backend() == "torch"
    x = _tensor((4, 64), seed=3)
    _assert_same(host.f32_counts(x), host.f32_counts_torch(x))
    monkeypatch.setenv("FXQUANT_HOST_KERNELS", "fortran")
    with pytest.raises(ValueError, match="FXQUANT_HOST_KERNELS='fortran'"):
        host.backend()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [32, 7])
def test_blocks_holding_nan_or_inf_go_to_their_own_relative_bin(dtype, block):
    """Every element of a block with a NaN or an Inf (a short last block included) lands in REL_NONFINITE,
    in the compiled kernel and its twin alike; the other blocks are binned as before."""
    x = torch.randn(5, 70, generator=torch.Generator().manual_seed(8)).to(dtype)
    x[0, 1], x[1, 69], x[2, 33], x[4, 2] = math.inf, math.nan, -math.inf, 0.0
    counts = host.f32_counts if dtype == torch.float32 else host.bf16_counts
    twin = host.f32_counts_torch if dtype == torch.float32 else host.bf16_counts_torch
    c, t = counts(x, block), twin(x, block)
    assert np.array_equal(c.rel, t.rel)
    bad, clean = 0, x.clone()
    for row, col in ((0, 1), (1, 69), (2, 33)):
        b0 = col // block * block
        bad += min(b0 + block, 70) - b0
        clean[row, b0:b0 + block] = 0.0  # the same tensor with zero blocks in their place
    assert c.rel[host.REL_NONFINITE] == bad and c.rel.sum() == x.numel()
    rest = counts(clean, block).rel
    assert np.array_equal(np.delete(c.rel, [host.REL_ZERO, host.REL_NONFINITE]),
                          np.delete(rest, [host.REL_ZERO, host.REL_NONFINITE]))
