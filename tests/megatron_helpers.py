"""Fixtures shared by the single-process Megatron tests (import them into a test module to use them)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def single_process():
    """Megatron's parallel state for one process (TP = PP = 1)."""
    from fxquant.megatron_glue import parallel

    yield parallel.initialize_parallel()
