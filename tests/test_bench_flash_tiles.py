"""benchmarks/bench_flash_tiles.py end to end on CPU (the kernels in Triton's interpreter, a toy size): every
setting of the CPU grid runs, the defaults first, each checked against the defaults' outputs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_helpers import run_interpreted

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_flash_tiles.py"


@pytest.mark.triton
def test_sweep_runs_every_setting_against_the_defaults(tmp_path):
    result = run_interpreted("bench_flash_tiles.py", tmp_path / "tiles.json", "--presets", "bf16,FA_QKPV_mxfp8")
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
    assert result["environment"]["host"] and "--json" in result["environment"]["argv"]


def test_unknown_preset_is_refused():
    run = subprocess.run([sys.executable, str(SCRIPT), "--presets", "bf16,FA_nope"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 2 and "FA_nope" in run.stderr


@pytest.mark.triton
def test_warps_grid_tries_the_default_tiles_at_4_and_8_warps(tmp_path):
    rows = run_interpreted("bench_flash_tiles.py", tmp_path / "warps.json", "--presets", "bf16", "--grid", "warps")["rows"]
    for part, key in (("forward", "fwd_warps"), ("backward", "bwd_warps")):
        mine = [r for r in rows if r["part"] == part]
        assert [(r["default"], r[key]) for r in mine] == [(True, 0), (False, 4), (False, 8)]
        # the default tiles (64 x 64 forward, 64 x 32 backward) launch 4 warps, as the explicit 4 does
        assert [r["launch"]["num_warps"] for r in mine] == [4, 4, 8]
        for r in mine:
            assert (r["block_m"], r["block_n"], r["bwd_m"], r["bwd_n"]) == (64, 64, 64, 32)
            assert "note" not in r and r["rel_diff_vs_default"] <= 2.0 ** -6, r
