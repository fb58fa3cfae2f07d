"""benchmarks/bench_flash_ab.py end to end on CPU (the kernels in Triton's interpreter): an earlier commit's
flash kernels extracted with git, then compared with this checkout's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_flash_ab.py"


@pytest.mark.triton
def test_ab_against_head_runs_both_versions_and_reports_equal_bits(tmp_path):
    """HEAD's committed kernels against the working tree's (in CI the same files, loaded as two modules):
    every row has both first calls, and the bit check finds them equal."""
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | {"TRITON_INTERPRET": "1"}
    old = tmp_path / "old"
    subprocess.run([sys.executable, str(SCRIPT), "--extract", str(old), "--rev", "HEAD"], check=True, env=env, cwd=ROOT)
    assert (old / "_old_flash_attention_launch.py").is_file() and (old / "REV").read_text().strip() == "HEAD"
    out = tmp_path / "ab.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--old", str(old), "--presets", "bf16,FA_QKPV_mxfp8",
                          "--json", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["environment"]["torch"] and result["environment"]["argv"][:2] == ["--old", str(old)]
    rows = result["rows"]
    assert [r["preset"] for r in rows] == ["bf16", "FA_QKPV_mxfp8"]
    for r in rows:
        assert r["bitwise_equal"] and r["max_abs_diff"] == 0.0, r
        assert r["old_first_call_s"] > 0 and r["new_first_call_s"] > 0, r


def test_without_old_or_extract_it_says_what_to_give():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 2 and "--old DIR" in run.stderr
