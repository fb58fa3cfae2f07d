"""benchmarks/bench_host.py at a tiny size: its read rate counts every tensor a reduction reads."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_host_read_rate_counts_both_inputs_of_the_pair_sums(tmp_path):
    pytest.importorskip("numba", reason="bench_host compares the numba kernels with their torch twins")
    out = tmp_path / "host.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_host.py"), "--rows", "64", "--cols", "256",
           "--repeat", "1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, check=False, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["environment"]["argv"] == cmd[2:] and "1 threads" in result["environment"]["device"]
    results = {r["case"]: r for r in result["results"]}
    n = 64 * 256
    inputs = {"bf16 counts (patterns + block-relative)": 2 * n, "float32 counts (histograms + moments)": 4 * n,
              "pair sums, bf16": 2 * 2 * n, "pair sums, float32": 2 * 4 * n,  # the quantized copy and its source
              "capture statistics, bf16": 2 * n, "capture statistics, float32": 4 * n}
    assert set(results) == set(inputs)
    for case, nbytes in inputs.items():
        r = results[case]
        assert r["bytes_read"] == nbytes, case
        assert r["numba_gb_per_s"] == pytest.approx(nbytes / r["numba_ms"] / 1e6, rel=1e-12), case
