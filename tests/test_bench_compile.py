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
    out = tmp_path / "sub" / "compile.json"
    done = _bench(plain, "--json", str(out))  # run from a repository-like root: nothing may appear there
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(plain torch.compile)" in done.stdout and f"wrote {out}" in done.stdout
    assert list(plain.iterdir()) == []
    result = json.loads(out.read_text())
    assert result["environment"]["argv"] == ["--backends", "aot_eager", "--json", str(out)]
    rows = result["rows"]
    assert [(r["backend"], r["scheme"]) for r in rows] == [("aot_eager", "(plain torch.compile)"),
                                                            ("aot_eager", "bf16"), ("aot_eager", "FA_linear_mxfp8")]
    assert rows[0]["compile_ratio_vs_plain"] == 1.0 and all(r["first_step_s"] > 0 for r in rows)


@pytest.mark.slow
def test_every_inductor_case_compiles_cold(monkeypatch):
    """A case run after another one of the same model in the same process still generates and builds its kernels:
    each has a fresh cache directory and Inductor's in-memory code caches are cleared, and the process's own cache
    setting is restored afterwards."""
    import os

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_compile
    from tests.models import make_llama, make_tokens

    built, timed, first = [], bench_compile.step, []

    def step(model, tokens):
        seconds = timed(model, tokens)
        if first.pop() if first else False:  # a case's first step: the kernel libraries it built
            built.append(len(list(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).rglob("*.so"))))
        return seconds

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr(bench_compile, "step", step)
    tokens = make_tokens(make_llama().cfg, batch=1, seq_len=8)
    for _ in range(2):
        first.append(True)
        bench_compile.case("inductor", None, tokens)
    assert len(built) == 2 and all(n >= 1 for n in built), built
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before
