"""benchmarks/bench_formats.py: its ``--floor`` rows (parts of a quantize's work compiled by Inductor) run on the
same tensor as the formats' rows, a block size that does not divide the tensor is refused, and the CPU's name in
every benchmark's JSON carries its vector ISA."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_formats  # noqa: E402
import envinfo  # noqa: E402


def _args(**kw) -> argparse.Namespace:
    base = dict(size="2^14", dtype="bf16", device="cpu", formats="mxfp8_e4m3", impls="inductor", repeat=1,
                floor=True, floor_blocks=[32, 512])
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.slow
def test_floor_rows_beside_the_format_rows():
    result = bench_formats.bench(_args())
    impls = [(r["format"], r["impl"]) for r in result["rows"]]
    assert impls == [("(copy)", "x.clone()"), ("(copy)", "x * 1 (Inductor)"),
                     ("(floor)", "float32 round trip, x * 2 (Inductor)"),
                     ("(floor)", "block amax x block, 32 (Inductor)"), ("(floor)", "block amax x block, 512 (Inductor)"),
                     ("mxfp8_e4m3", "fxquant::quantize (Inductor)")]
    for r in result["rows"]:
        assert r["ms"] > 0 and r["x copy"] > 0, r


def test_floor_blocks_must_divide_the_tensor():
    with pytest.raises(ValueError, match="--floor-blocks: 3000 does not divide"):
        bench_formats.bench(_args(floor_blocks=[3000], formats="fp8_e4m3"))


def test_without_floor_no_floor_rows():
    result = bench_formats.bench(_args(floor=False, formats="fp8_e4m3"))
    assert not [r for r in result["rows"] if r["format"] == "(floor)"]


def test_cpu_device_name_lists_the_vector_isa_from_cpuinfo():
    import torch

    name = envinfo.device_name(torch.device("cpu"))
    assert f"{torch.get_num_threads()} threads" in name
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo on this system")
    flags = next((set(ln.split(":", 1)[1].split()) for ln in cpuinfo.read_text().splitlines()
                  if ln.startswith("flags")), set())
    for flag, label in envinfo.CPU_ISA:
        if flag == "avx2" and "avx512f" in flags:
            assert "AVX2" not in name  # the wider ISA is named instead
        else:
            assert (label in name) == (flag in flags), (flag, name)
