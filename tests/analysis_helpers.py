"""Capture sets for the analysis tests, written through the real capture runtime and writer."""
from __future__ import annotations

from pathlib import Path

import torch

from fxquant import capture
from fxquant.capture.runtime import RankInfo
from fxquant.capture.spec import Component, Copy, Gemm, ModuleKind, Role
from fxquant.capture.tap import Tap
from fxquant.formats.tensor_quant import TensorQuant

SPEC = """\
sections:
  - name: all
    points: [{component: linear}, {component: attention}]
    when: {iterations: {start: 0, end: 100}}
    what: %(what)s
"""

OPERANDS = (  # role, module kind, GEMM, format, blocked dim of the [M, K] view, scale (magnitude) of the data
    (Role.INPUT, ModuleKind.FC1, Gemm.FPROP, "mxfp8_e4m3", -1, 1.0),
    (Role.WEIGHT, ModuleKind.FC1, Gemm.FPROP, "mxfp8_e4m3", -1, 0.02),
    (Role.GRAD_OUTPUT, ModuleKind.FC1, Gemm.DGRAD, "mxfp8_e5m2", -1, 1e-4),
)


def spec(what: str = "both") -> capture.CaptureSpec:
    return capture.load_spec("analysis-test.yaml", text=SPEC % {"what": what})


def write_set(root: Path, *, scheme: str = "FA_linear_mxfp8", layers: int = 3, ranks: int = 2, iterations: int = 1,
              quantized: bool = True, shape=(4, 8, 64), what: str = "both", seed: int = 0,
              fmt: str | None = None) -> list[torch.Tensor]:
    """A capture set: every rank captures input/weight/grad_output of fc1 in each layer, high-precision
    copies and (``quantized``) the quantized copies as the GEMM consumed them. Returns the hp tensors."""
    g = torch.Generator().manual_seed(seed)
    sent = []
    for rank in range(ranks):
        info = RankInfo(rank=rank, world_size=ranks, tp_rank=rank, tp_size=ranks)
        with capture.start(spec(what), root, scheme=scheme, rank=info, run_id=f"run-{scheme}") as s:
            for it in range(iterations):
                s.set_iteration(it)
                for layer in range(layers):
                    module = f"decoder.layers.{layer}.mlp.linear_fc1"
                    for role, kind, gemm, f, dim, scale in OPERANDS:
                        x = torch.randn(*shape, generator=g) * scale * (1 + layer) * (1 + 0.5 * rank)
                        sent.append(x.clone())
                        hp = Tap(Component.LINEAR, role, module, (0,), kind, layer)
                        torch.ops.fxquant.capture(x, hp.encode())
                        if quantized:
                            tq = TensorQuant.from_spec(fmt or f)
                            x2 = x.reshape(-1, x.shape[-1])
                            q = tq.quantize(x2, dim)
                            tap = Tap(Component.LINEAR, role, module, (0,), kind, layer, copy=Copy.QUANTIZED,
                                      gemm=gemm, qspec=tq.spec(), dim=dim)
                            torch.ops.fxquant.capture(q, tap.encode(), x2)
    return sent


def write_tensors(root: Path, tensors: list[torch.Tensor], *, scheme: str = "bf16", what: str = "full") -> None:
    """One record per given tensor (linear inputs of consecutive layers), rank 0."""
    with capture.start(spec(what), root, scheme=scheme, rank=RankInfo(0, 1), run_id=f"run-{scheme}") as s:
        s.set_iteration(0)
        for layer, x in enumerate(tensors):
            tap = Tap(Component.LINEAR, Role.INPUT, f"decoder.layers.{layer}.mlp.linear_fc1", (0,), ModuleKind.FC1, layer)
            torch.ops.fxquant.capture(x, tap.encode())
