"""Bitwise comparison for tests: equal bit patterns, except that any NaN equals any NaN (payloads and
NaN signs carry no meaning in FORMATS.md). Signed zeros are distinguished."""
from __future__ import annotations

import torch


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor, context: str = "") -> None:
    assert got.shape == want.shape, f"{context} shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{context} dtype {got.dtype} != {want.dtype}"
    g, w = got.float(), want.float()
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    bad = (nan_g != nan_w) | (~nan_g & (g.view(torch.int32) != w.view(torch.int32)))
    if bool(bad.any()):
        idx = bad.flatten().nonzero().flatten()[:5]
        raise AssertionError(
            f"{context} {int(bad.sum())} of {bad.numel()} elements differ; first at flat {idx.tolist()}: "
            f"got {g.flatten()[idx].tolist()} want {w.flatten()[idx].tolist()}"
        )
