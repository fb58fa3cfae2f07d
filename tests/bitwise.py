"""Bitwise comparison for tests: equal bit patterns, except that any NaN equals any NaN (payloads and
NaN signs carry no meaning in FORMATS.md). Signed zeros are distinguished. Also: whether Inductor's output code
kept ``fxquant::quantize`` as an op call instead of lowering it (``assert_lowered``)."""
from __future__ import annotations

import contextlib

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


# -- where a bitwise comparison alone cannot tell: was fxquant::quantize lowered? ------------------------------
# The op's registered CPU kernel *is* the reference, so a compiled graph that kept the op as a call equals the
# reference bit for bit without exercising the lowering at all. Tests of the lowering also read the code Inductor
# generated (``generated_code`` / ``torch._inductor.utils.run_and_get_code``) and check it with ``assert_lowered``.
@contextlib.contextmanager
def generated_code():
    """Collect the output code of every Inductor compile (cache hits included) run inside the block, as
    ``torch._inductor.utils.run_and_get_code`` does, without resetting Dynamo (a compiled function's later calls
    and recompiles are collected too). Yields the list the codes are appended to."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        yield codes


def op_calls(code: str, op: str = "quantize") -> list[str]:
    """The calls of the fxquant op ``op`` (``quantize``: also ``quantize_reference``) in Inductor output code, e.g.
    ``torch.ops.fxquant.quantize.default(...)``: where the op was kept instead of computed in generated kernels.
    Comments (Inductor names a kernel's source nodes in them) are not calls."""
    import re

    call = re.compile(rf"fxquant\.{op}\w*(\.\w+)?\(")
    return [line.strip() for line in code.splitlines() if not line.lstrip().startswith("#") and call.search(line)]


def assert_lowered(codes: list[str] | str, specs: list[str], device: str, context: str = "") -> None:
    """No quantize of a spec that ``fxquant.lowering.lowers_exactly(spec, device)`` says lowers is left as an op
    call in ``codes`` (Inductor output code, at least one); a call may remain only for a spec that does not lower
    there, named in the call."""
    from fxquant.lowering import lowers_exactly

    codes = [codes] if isinstance(codes, str) else list(codes)
    assert codes, f"{context} no Inductor output code was captured: nothing compiled, so nothing shows the lowering"
    kept = [s for s in specs if not lowers_exactly(s, device)]
    left = [line for code in codes for line in op_calls(code) if not any(repr(s) in line for s in kept)]
    assert not left, f"{context} fxquant::quantize left as an op call, not lowered, on {device}: {left[:3]}"
