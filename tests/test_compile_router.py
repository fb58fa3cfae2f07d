"""MoE routers: a site kind of their own, high precision unless a rule selects them, and a module path even
when the gating GEMM runs in a compiled frame of its own (no module stack: resolved by parameter identity)."""
from __future__ import annotations

import textwrap

import torch
from torch import nn

import fxquant
from fxquant.api import compile_state
from fxquant.schemes.model import Site, SiteKind


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 32))

    def gating(self, x: torch.Tensor) -> torch.Tensor:  # called as a method: no nn.Module call, no module stack
        return torch.nn.functional.linear(x, self.weight)


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(32, 32)
        self.router = Router()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)
        torch._dynamo.graph_break()  # the router's GEMM lands in a resumed frame of its own
        return self.router.gating(y)


def sites(compiled) -> dict:
    return {s.site.module_path: s for s in compile_state(compiled).sites()}


def test_router_kind_from_names():
    assert Site.from_path("decoder.layers.1.mlp.router").kind is SiteKind.ROUTER
    assert Site.from_path("model.layers.3.block_sparse_moe.gate").kind is SiteKind.ROUTER
    assert Site.from_path("model.layers.3.mlp.gate_proj").kind is SiteKind.FC1


def test_router_path_resolved_and_kept_in_high_precision():
    model = nn.Sequential(MoEBlock())
    compiled = fxquant.compile(model, "linear_mxfp8", backend="aot_eager")
    x = torch.randn(3, 32)
    out = compiled(x)
    found = sites(compiled)
    assert found["0.router"].site.kind is SiteKind.ROUTER
    assert found["0.router"].status.value == "high"
    assert found["0.linear_fc1"].status.value == "rewritten"
    # High precision means the router's output is the plain GEMM of the (quantized-fc1) activation.
    fc1 = fxquant.formats.get("mxfp8")
    q = torch.nn.functional.linear(fc1.quantize(x), fc1.quantize(model[0].linear_fc1.weight), model[0].linear_fc1.bias)
    assert torch.equal(out, torch.nn.functional.linear(q, model[0].router.weight))


def test_router_quantized_when_a_rule_selects_it(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(textwrap.dedent("""
        name: router_mxfp8
        rules:
          - match: {kinds: [router]}
            linear: mxfp8
    """))
    compiled = fxquant.compile(nn.Sequential(MoEBlock()), path, backend="aot_eager")
    compiled(torch.randn(3, 32))
    found = sites(compiled)
    assert found["0.router"].status.value == "rewritten"
    assert found["0.linear_fc1"].status.value == "high"
