"""benchmarks/bench_step.py end to end at a tiny size: the round-robin rows, the eager baseline,
and the --cold-compile children (a fresh process each, an empty Inductor cache of its own, then one more on
the cache it filled)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_step_reports_every_variant_and_where_the_cold_compile_went(tmp_path):
    out = tmp_path / "step.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--models", "torch", "--presets", "linear_mxfp8",
           "--reference", "", "--eager", "linear_mxfp8", "--dim", "64", "--heads", "2", "--ffn", "128",
           "--vocab", "256", "--layers", "1", "--batch", "1", "--seq", "32", "--rounds", "2", "--cold-compile",
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["plain torch.compile", "linear_mxfp8", "linear_mxfp8 [eager]"]
    plain, preset = rows["plain torch.compile"], rows["linear_mxfp8"]
    assert plain["x_plain"] == 1.0 and plain["target"] is None
    assert preset["target"] == 1.3 and preset["meets"] == (preset["x_plain"] <= 1.3)
    for r in rows.values():
        assert r["step_ms"] > 0 and r["min_ms"] <= r["step_ms"] and r["compile_s"] > 0
    # eager / this: the eager variant's median step over the preset's, on the preset's row only
    assert preset["eager_over_this"] == pytest.approx(rows["linear_mxfp8 [eager]"]["step_ms"] / preset["step_ms"])
    assert rows["linear_mxfp8 [eager]"]["eager_over_this"] is None
    for label in ("plain torch.compile", "linear_mxfp8"):  # cold: a fresh process with its own empty cache
        cold = rows[label]["cold_compile"]
        assert cold["first_step_s"] > 0 and cold["codegen_s"] > 0 and cold["gcc_s"] > 0
        assert cold["kernel_libraries"] >= 1 and cold["cpp_kb"] > 0
        assert rows[label]["cold_compile_s"] == cold["first_step_s"]
        # warm: another fresh process on the filled cache loads the forward and backward graphs from it
        assert (cold["fx_graph_cache_hits"], cold["aot_autograd_cache_hits"]) == (0, 0)
        assert (cold["warm_fx_graph_cache_hits"], cold["warm_aot_autograd_cache_hits"]) == (2, 1)
        assert rows[label]["warm_compile_s"] == cold["warm_s"] > 0
    assert rows["linear_mxfp8 [eager]"]["cold_compile"] is None  # plain and the presets only
    # the quantizes add kernels: the preset's cold compile writes more C++ than plain's
    assert preset["cold_compile"]["cpp_kb"] > plain["cold_compile"]["cpp_kb"]
    assert preset["cold_compile_x_plain"] == pytest.approx(preset["cold_compile_s"] / plain["cold_compile_s"])
    assert result["environment"]["torch"] and "--cold-compile" in result["environment"]["argv"]


def test_bench_step_hf_model_runs_where_transformers_is_installed_and_says_what_is_missing_where_not(tmp_path):
    """``--models hf`` (transformers' LlamaForCausalLM, not a dependency): with transformers importable, the
    tiny round-robin gives the plain, preset and eager rows; without it, a one-line error naming the package."""
    import importlib.util

    out = tmp_path / "hf.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--models", "hf", "--presets", "linear_mxfp8",
           "--reference", "", "--eager", "linear_mxfp8", "--dim", "64", "--heads", "2", "--ffn", "128",
           "--vocab", "256", "--layers", "1", "--batch", "1", "--seq", "32", "--rounds", "1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, check=False)
    if importlib.util.find_spec("transformers") is None:
        assert done.returncode != 0 and not out.exists()
        assert "--models hf needs Hugging Face transformers (pip install transformers)" in done.stderr
        assert "Traceback" not in done.stderr
        return
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["plain torch.compile", "linear_mxfp8", "linear_mxfp8 [eager]"]
    assert all(r["model"] == "hf" and r["step_ms"] > 0 for r in rows.values())



@pytest.mark.parametrize("cache_set", [False, True])
def test_bench_step_leaves_no_inductor_cache_directory_behind(tmp_path, cache_set):
    """Run as a script without TORCHINDUCTOR_CACHE_DIR, the benchmark compiles into a fresh temporary cache that it
    removes at exit; with the variable set, it makes none."""
    import os

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["TMPDIR"] = str(scratch)
    if cache_set:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--help"],
                          capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0 and "--cold-compile" in done.stdout, done.stderr[-3000:]
    assert list(scratch.iterdir()) == []
