"""benchmarks/run_all.py: which quantize implementations it compares, and a --quick run of every section on CPU
(the GPU rows read n/a there) that writes JSON and markdown with no errors."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import run_all  # noqa: E402


def test_cuda_compares_what_auto_picks_first_and_nvfp4_runs_the_kernels():
    cuda = torch.device("cuda")  # the choice needs no device: it reads the scheme's formats
    assert run_all.kernel_choices(cuda, "inductor", "linear_mxfp8") == ("inductor", "triton")
    assert run_all.kernel_choices(cuda, "inductor", "FA_linear_hifp8") == ("inductor", "triton")
    assert run_all.kernel_choices(cuda, "inductor", "linear_nvfp4") == ("triton",)
    assert run_all.kernel_choices(cuda, "aot_eager", "linear_mxfp8") == ("auto",)
    assert run_all.kernel_choices(torch.device("cpu"), "inductor", "linear_mxfp8") == ("auto",)


def test_model_rows_are_ratios_to_the_named_baseline_row():
    """On CPU the model section's baseline is float32 torch.compile with aot_eager, not bf16: the baseline row
    says so and the ratio columns are named for it, in the rows (the JSON) and in the markdown table. The timer
    hands out fixed seconds in call order, so the ratios are known."""
    seconds = iter([0.010, 0.020, 0.030, 0.040, 0.050, 0.060])
    args = types.SimpleNamespace(quick=True, layers=2)
    rows = run_all.model_step(args, torch.device("cpu"), lambda fn: next(seconds))
    assert [r["impl"] for r in rows][0] == "baseline: float32 torch.compile (aot_eager)"
    assert [r["x baseline"] for r in rows] == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert all("peak x baseline" in r and not any("bf16" in c for c in r) for r in rows)
    header = [c.strip() for c in run_all.render("model", rows).splitlines()[2].strip("|").split("|")]
    assert header == ["model", "impl", "ms", "x baseline", "peak GiB", "peak x baseline", "note", "target"]


@pytest.mark.slow
def test_quick_run_of_every_section(tmp_path):
    out, md = tmp_path / "run_all.json", tmp_path / "run_all.md"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick", "--device", "cpu",
                          "--json", str(out), "--markdown", str(md)], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == []
    assert list(result["sections"]) == list(run_all.SECTIONS)
    for name, section in result["sections"].items():
        assert section["rows"], name
        assert not any(str(r.get("note", "")).startswith("error") for r in section["rows"]), name
    model = result["sections"]["model"]["rows"]
    assert model[0]["impl"] == "baseline: float32 torch.compile (aot_eager)" and model[0]["x baseline"] == 1.0
    assert all(r["ms"] > 0 for r in model)
    assert [r["impl"].split()[1] for r in model[1:-1]] == list(run_all.MODEL_PRESETS)
    text = md.read_text()
    assert all(f"### {name}" in text for name in run_all.SECTIONS)
