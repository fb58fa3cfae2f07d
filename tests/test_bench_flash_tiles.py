"""benchmarks/bench_flash_tiles.py end to end on CPU (the kernels in Triton's interpreter, a toy size): every
setting of the CPU grid runs, the defaults first, each checked against the defaults' outputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_flash_tiles.py"


@pytest.mark.triton
def test_sweep_runs_every_setting_against_the_defaults(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | {"TRITON_INTERPRET": "1"}
    out = tmp_path / "tiles.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--presets", "bf16,FA_QKPV_mxfp8", "--json", str(out)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    for preset in ("bf16", "FA_QKPV_mxfp8"):
        for part, changed in (("forward", [{"block_m": 32}, {"fwd_warps": 2}]),
                              ("backward", [{"bwd_m": 32, "bwd_n": 32}, {"bwd_stages": 1}])):
            mine = [r for r in rows if r["preset"] == preset and r["part"] == part]
            assert [r["default"] for r in mine] == [True, False, False]
            for r, change in zip(mine[1:], changed):
                assert all(r[k] == v for k, v in change.items()), (r, change)
            for r in mine:
                assert "note" not in r and r["first_call_s"] > 0 and r["ms"] is None, r
                assert r["rel_diff_vs_default"] <= 2.0 ** -6, r
    assert result["summary"] == []  # nothing timed on CPU
    assert result["environment"]["device"] == "cpu (interpreter)"


def test_unknown_preset_is_refused():
    run = subprocess.run([sys.executable, str(SCRIPT), "--presets", "bf16,FA_nope"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 2 and "FA_nope" in run.stderr
