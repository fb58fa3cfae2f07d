"""tests/conftest.py's failure log (``FXQUANT_FAILURE_LOG``): each failure's traceback is written as it happens,
once, with and without xdist; passing tests write nothing."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

PLANTED = '''
def test_fails():
    assert 1 == 2, "planted failure"

def test_passes():
    pass
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_failure_log_holds_each_failure_once(tmp_path, workers):
    (tmp_path / "test_planted.py").write_text(PLANTED)
    log = tmp_path / "failures.txt"
    env = {**os.environ, "FXQUANT_FAILURE_LOG": str(log)}
    env.pop("PYTEST_XDIST_WORKER", None)  # this test may itself run in an xdist worker
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                          "--rootdir", str(tmp_path), *workers, str(tmp_path / "test_planted.py")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    text = log.read_text()
    assert text.count("==== ") == 1 and "test_planted.py::test_fails (call)" in text, text
    assert "planted failure" in text and "test_passes" not in text
