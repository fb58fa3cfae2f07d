"""Helpers shared by the capture tests: a spec from text, taps, and a session writing into a directory."""
from __future__ import annotations

import torch

from fxquant import capture
from fxquant.capture.spec import Component, ModuleKind, Role
from fxquant.capture.tap import Tap

LINEAR_ALL = """\
sections:
  - name: lin
    points: [{component: linear}]
    when: {iterations: {start: 0, end: %(end)d}}
budget: %(budget)s
on_error: %(policy)s
"""


def spec_text(end: int = 100, budget: str = "{}", policy: str = "stop") -> capture.CaptureSpec:
    return capture.load_spec("test.yaml", text=LINEAR_ALL % {"end": end, "budget": budget, "policy": policy})


def tap(module: str = "layers.0.mlp.down_proj", role: Role = Role.INPUT, layer: int | None = 0) -> str:
    return Tap(Component.LINEAR, role, module, (0,), ModuleKind.FC2, layer).encode()


def emit(n: int, shape=(8, 16), t: str | None = None, seed: int = 0) -> list[torch.Tensor]:
    """Capture ``n`` random tensors through the op (one per iteration); returns them."""
    s = capture.active_session()
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        s.set_iteration(i)
        x = torch.randn(*shape, generator=g)
        torch.ops.fxquant.capture(x, t or tap())
        out.append(x.clone())
        x.zero_()  # the buffer is reused at once: the capture must have copied it (trap 4)
    return out
