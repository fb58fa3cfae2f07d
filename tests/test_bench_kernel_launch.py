"""benchmarks/bench_kernel_launch.py end to end on CPU (the quantize kernels in Triton's interpreter, a small
tensor): every setting of the CPU grid runs after the default and gives the default's bits; and the launch
settings' validation."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are first imported (fxquant.kernels imports them lazily)
    os.environ["TRITON_INTERPRET"] = "1"

from fxquant.formats.tensor_quant import TensorQuant  # noqa: E402
from tests.bench_helpers import run_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_kernel_launch.py"


@pytest.mark.triton
def test_sweep_runs_every_setting_against_the_default(tmp_path):
    result = run_interpreted("bench_kernel_launch.py", tmp_path / "launch.json", "--formats", "nvfp4,mxfp8_e4m3,hifp8")
    for name, warps in (("nvfp4", 4), ("mxfp8_e4m3", 4), ("hifp8", 8)):
        mine = [r for r in result["rows"] if r["format"] == name]
        # the interpreter's default is one program of 65536 elements; 1024 gives the [2, 4096] tensor 8 programs
        assert [(r["default"], r["per_program"], r["num_warps"]) for r in mine] == \
            [(True, 65536, warps), (False, 1024, warps), (False, 4096, 2)]
        assert all(r["same_bits"] is True and r["ms"] is None for r in mine), mine
    assert result["summary"] == []  # nothing timed on CPU
    assert result["environment"]["device"] == "cpu (interpreter)"
    assert result["environment"]["host"] and result["environment"]["argv"][:2] == ["--formats", "nvfp4,mxfp8_e4m3,hifp8"]


def test_bad_arguments_are_refused():
    for args, needle in ((["--formats", "nvfp4,fp7"], "fp7"), (["--size", "2^x"], "--size")):
        run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert run.returncode == 2 and needle in run.stderr, run.stderr


class _Recorder:
    """Stands in for a Triton kernel: records each launch's grid and num_warps, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def run(**kwargs):
            self.launches.append((grid, kwargs["num_warps"]))
            return self.kernel[grid](**kwargs)
        return run


@pytest.mark.triton
def test_launch_settings_set_the_programs_and_warps(monkeypatch):
    """elements per program decides the grid and warps the launch's num_warps: NVFP4 on [5, 100] has 5 x 7 = 35
    blocks of 16 (1 per program at 16 elements, 4 at 64); MX 5 x 4 = 20 blocks of 32; the element kernel 500
    elements."""
    from fxquant.kernels import launch

    x = torch.randn(5, 100, device=DEVICE)
    cases = [("nvfp4", "_quantize_nvfp4_kernel", 16, 35), ("nvfp4", "_quantize_nvfp4_kernel", 64, 9),
             ("mxfp4_e2m1", "_quantize_mx_kernel", 64, 10), ("fp8_e4m3", "_quantize_element_kernel", 128, 4)]
    for name, kernel, elements, programs in cases:
        recorder = _Recorder(getattr(launch, kernel))
        monkeypatch.setattr(launch, kernel, recorder)
        launch.quantize(x, TensorQuant(name), launch=launch.KernelLaunch(elements=elements, warps=2))
        launch.quantize(x, TensorQuant(name))
        default = launch.KernelLaunch()
        blocked = kernel != "_quantize_element_kernel"
        size = 16 if name == "nvfp4" else 32 if blocked else 1
        want_default = -(-(5 * -(-100 // size)) // max(1, default.per_program() // size))
        assert recorder.launches == [((programs,), 2), ((want_default,), 4 if blocked else 8)], (name, elements)


@pytest.mark.triton
def test_launch_settings_are_checked_and_change_no_bits():
    from fxquant.kernels import launch

    for bad in (dict(elements=3000), dict(warps=3), dict(warps=64), dict(elements=-2), dict(warps=True)):
        with pytest.raises(ValueError, match="KernelLaunch"):
            launch.KernelLaunch(**bad)
    with pytest.raises(TypeError, match="KernelLaunch"):
        launch.quantize(torch.ones(4, 32, device=DEVICE), TensorQuant("mxfp8_e4m3"), launch={"elements": 1024})
    x = torch.randn(5, 100, generator=torch.Generator().manual_seed(3))  # short last blocks, rows across programs
    for name in ("nvfp4", "mxfp4_e2m1", "fp8_e4m3"):
        tq = TensorQuant(name)
        want = tq.quantize(x)  # the reference, on CPU
        for setting in (launch.KernelLaunch(elements=16), launch.KernelLaunch(elements=64, warps=2)):
            got = launch.quantize(x.to(DEVICE), tq, launch=setting).cpu()
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (name, setting)
