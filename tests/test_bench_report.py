"""benchmarks/bench_report.py at a tiny size: its figures count the capture set this run wrote, and a --dir
whose capture folder already holds a set is refused rather than appended to."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(tmp_path: Path, out: Path, workdir: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_report.py"), "--size-mb", "1", "--rows", "256",
           "--cols", "1024", "--quantized-every", "0", "--workers", "1", "--dir", str(workdir), "--json", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, check=False, timeout=600)


@pytest.mark.slow
def test_bench_report_measures_what_it_wrote_and_refuses_a_dir_holding_a_capture_set(tmp_path):
    workdir = tmp_path / "d"
    first = _bench(tmp_path, tmp_path / "first.json", workdir)
    assert first.returncode == 0, first.stderr[-3000:]
    result = json.loads((tmp_path / "first.json").read_text())
    shards = sorted((workdir / "capture").rglob("*.safetensors"))
    on_disk = {p: p.stat().st_size for p in shards}
    # 1 MB of 256x1024 bf16 tensors (512 KiB each): two tensors, every byte of them in this run's shards
    assert result["tensors"] == 2 and result["bytes"] == sum(on_disk.values())
    assert result["environment"]["torch"] and "--workers" in result["environment"]["argv"]
    assert 2 * 256 * 1024 * 2 < result["bytes"] < 2 * 256 * 1024 * 2 + (64 << 10)

    second = _bench(tmp_path, tmp_path / "second.json", workdir)
    assert second.returncode == 2
    assert str(workdir / "capture") in second.stderr and "already holds a capture set" in second.stderr
    assert not (tmp_path / "second.json").exists()
    assert {p: p.stat().st_size for p in sorted((workdir / "capture").rglob("*.safetensors"))} == on_disk
