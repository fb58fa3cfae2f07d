"""benchmarks/bench_compile.py: the command in its docstring writes no file (the committed results under
benchmarks/results/ stay as they are); --json PATH writes the rows there."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_compile.py"), "--backends", "aot_eager", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, check=False, timeout=600)


@pytest.mark.slow
def test_bench_compile_writes_json_only_where_asked(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    done = _bench(plain)  # run from a repository-like root: nothing may appear under benchmarks/results/
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(plain torch.compile)" in done.stdout and "wrote" not in done.stdout
    assert list(plain.iterdir()) == []

    out = tmp_path / "sub" / "compile.json"
    done = _bench(tmp_path, "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["environment"]["argv"] == ["--backends", "aot_eager", "--json", str(out)]
    rows = result["rows"]
    assert [(r["backend"], r["scheme"]) for r in rows] == [("aot_eager", "(plain torch.compile)"),
                                                            ("aot_eager", "bf16"), ("aot_eager", "FA_linear_mxfp8")]
    assert rows[0]["compile_ratio_vs_plain"] == 1.0 and all(r["first_step_s"] > 0 for r in rows)
