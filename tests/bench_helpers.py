"""Running a sweep script of benchmarks/ on CPU, its kernels in Triton's interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, out: Path, *args: str) -> dict:
    """Run ``benchmarks/<script>`` with ``args`` and ``--json out`` under ``TRITON_INTERPRET=1``; assert that it
    exits 0 and return the JSON it wrote."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | {"TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())
