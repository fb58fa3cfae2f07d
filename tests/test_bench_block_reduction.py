"""benchmarks/bench_block_reduction.py: its C++ variants of an MX block's amax-and-scale loop build with Inductor's
flags and compute Inductor's result (the benchmark refuses to time a variant that does not), and a variant that
computes something else is caught."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_block_reduction as bbr  # noqa: E402


@pytest.mark.slow
def test_every_variant_equals_inductor_and_is_timed():
    result = bbr.bench(argparse.Namespace(elements=1 << 14, repeat=1))
    assert [r["kernel"] for r in result["rows"]] == ["x.clone()", "torch.compile (Inductor)", *bbr.KERNELS]
    for r in result["rows"]:
        assert r["fresh_ms"] > 0 and (r["reused_ms"] is None or r["reused_ms"] > 0), r


@pytest.mark.slow
def test_check_catches_a_wrong_variant(tmp_path):
    fns = bbr.kernels(bbr.build(tmp_path))
    x = torch.randn(1 << 12).bfloat16()

    def halves(x, amax, out):  # right amaxes, a wrong product
        fns["inductor"](x, amax, out)
        out.mul_(0.5)

    with pytest.raises(AssertionError, match="bad: output differs"):
        bbr.check(x, {"bad": halves})
    with pytest.raises(AssertionError, match="bad: block amaxes differ"):
        bbr.check(x, {"bad": lambda x, amax, out: fns["multiply only"](x, amax.mul_(2), out)})


def test_elements_must_be_whole_pairs_of_blocks():
    with pytest.raises(ValueError, match="multiple of 64"):
        bbr.bench(argparse.Namespace(elements=96, repeat=1))
