"""fxquant.capture: placement spec, capture op and session, async writer, reader (issue 4).

    >>> from fxquant import capture
    >>> spec = capture.load_spec("predecessor")            # or a YAML path; `fxquant check-spec FILE`
    >>> with capture.start(spec, "captures/run1", scheme="FA_linear_mxfp8") as s:
    ...     for it in range(n):
    ...         s.set_iteration(it); loss = model(batch); loss.backward()
    >>> cs = capture.open("captures/run1")                   # all ranks, lazily loaded tensors
    >>> for rec in cs.query(role="input", layer=[0, 1]): t = cs.load(rec)

See docs/capture.md for the spec schema, the on-disk layout and the manifest fields.
"""
from __future__ import annotations

from fxquant.capture.reader import CaptureReadError, CaptureSet, Record
from fxquant.capture.reader import open_capture as open  # noqa: A001 - the documented entry point
from fxquant.capture.runtime import (
    CaptureError,
    CaptureSession,
    RankDirBusy,
    RankInfo,
    SessionConfig,
    active_session,
    capture_grad,
    capture_operand,
    save,
    start,
)
from fxquant.capture.spec import (
    CapturePoint,
    CaptureSpec,
    Component,
    Copy,
    Direction,
    Gemm,
    ModuleKind,
    Phase,
    Role,
    SpecError,
    What,
    load_spec,
    shipped_specs,
)
from fxquant.capture.tap import Tap

__all__ = [
    "CaptureError", "CapturePoint", "CaptureReadError", "CaptureSession", "CaptureSet", "CaptureSpec", "Component",
    "Copy", "Direction", "Gemm", "ModuleKind", "Phase", "RankDirBusy", "RankInfo", "Record", "Role", "SessionConfig", "SpecError",
    "Tap", "What", "active_session", "capture_grad", "capture_operand", "load_spec", "open", "save", "shipped_specs",
    "start",
]
