"""Shared pytest configuration: hardware/dependency gates (each skip states its reason) and paths."""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

# Triton decides between compiling and interpreting when its modules are first imported (its own standard
# library included), so the choice is made here, once, before any test module or torch.compile imports it:
# without an NVIDIA driver the kernels run in Triton's interpreter on CPU (ARCHITECTURE.md trap 7).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The caller's Inductor cache directory, read before torch is imported: an import may set the variable to
# Inductor's default (a directory shared by every run), which must not count as the caller's choice.
_CALLER_INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FXQUANT_SHARED_DATA", REPO.parent / "shared" / "data"))  # env: another checkout


def _gate(item: pytest.Item, marker: str, ok: bool, reason: str) -> None:
    if item.get_closest_marker(marker) is not None and not ok:
        item.add_marker(pytest.mark.skip(reason=reason))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch.cuda.is_available()
    has_triton = importlib.util.find_spec("triton") is not None
    has_megatron = importlib.util.find_spec("megatron.core") is not None if importlib.util.find_spec("megatron") else False
    for item in items:
        _gate(item, "gpu", has_cuda, "needs a CUDA device; none is present")
        _gate(item, "triton", has_triton, "needs Triton (pip install triton); not importable")
        _gate(item, "megatron", has_megatron, "needs megatron-core (pip install megatron-core); not importable")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``FXQUANT_FAILURE_LOG`` set, each failure's report is appended to that file as it happens (by the
    controller under xdist), so a run killed at a time cap (scripts/gpu_check.sh) keeps its tracebacks."""
    path = os.environ.get("FXQUANT_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(scope="session")
def wikitext_dir() -> Path:
    path = SHARED_DATA / "wikitext-2"
    if not (path / "valid.txt").is_file():
        pytest.skip(f"shared WikiText-2 data not found at {path} (expected ../shared/data beside the repo, or $FXQUANT_SHARED_DATA)")
    return path


@pytest.fixture(scope="session", autouse=True)
def _inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One Inductor cache per test session unless the caller chose one (scripts/run_tests.sh does)."""
    chosen = _CALLER_INDUCTOR_CACHE or str(tmp_path_factory.mktemp("inductor-cache"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = chosen


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts from a fresh Dynamo. Fresh models of one class (tests.models' Llama, Megatron's
    GPTModel) share one forward code object: without a reset, Dynamo's recompile limit is reached after some
    tests, and a later test of the same worker silently runs eager, nothing rewritten (so a check such as
    test_compile_layers' "match no site" would pass or fail depending on test order)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
