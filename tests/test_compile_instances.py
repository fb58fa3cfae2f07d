"""Layers compiled as frames of their own: Dynamo's compiled code for a frame would serve every instance of a layer
class, so a graph with sites or capture taps is compiled per instance (fxquant.passes.instances): per-layer formats,
site reports, strict coverage and capture labels are each layer's own."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxquant
from fxquant import capture, schemes
from fxquant.api import compile_state
from fxquant.counters import count_quantize_calls
from fxquant.passes.instances import instance_arguments
from fxquant.passes.module_paths import ModuleNames

LAYER_1 = schemes.Scheme.from_yaml_text("""
name: layer1
rules:
  - match: {layers: [1]}
    linear: mxfp8
""", "layer1.yaml")


class Block(nn.Module):
    def __init__(self, dim: int, graph_break: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.graph_break:  # Dynamo gives up the caller's loop: each layer's call is a frame of this code
            torch._dynamo.graph_break()
        return torch.relu(y) + x


class Stack(nn.Module):
    def __init__(self, graph_break: bool, n_layers: int = 3, dim: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, graph_break) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _pair(seed: int = 0) -> tuple[Stack, Stack]:
    """(a stack whose layers are frames of their own, the same weights in one frame)."""
    torch.manual_seed(seed)
    broken = Stack(graph_break=True)
    whole = copy.deepcopy(broken)
    for block in whole.layers:
        block.graph_break = False
    return broken, whole


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _sites(compiled: nn.Module) -> dict[str, str]:
    return {s.site.module_path: s.status.value for s in compile_state(compiled).sites()}


def test_a_per_layer_rule_quantizes_only_its_layer_when_layers_are_frames_of_their_own():
    broken, whole = _pair()
    a = fxquant.compile(broken, LAYER_1, backend="aot_eager", strict=True)
    b = fxquant.compile(whole, LAYER_1, backend="aot_eager", strict=True)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        out_a, grads_a = _step(a, x)
        out_b, grads_b = _step(b, x)
        assert torch.equal(out_a, out_b)
        assert all(torch.equal(g, h) for g, h in zip(grads_a, grads_b))
    assert _sites(a) == {"layers.0.fc": "high", "layers.1.fc": "rewritten", "layers.2.fc": "high"}
    frames = [r for r in compile_state(a).backend.reports if r.sites]
    assert [r.instance for r in frames] == [{"self": f"layers.{i}"} for i in range(3)]
    with count_quantize_calls(a) as count:
        _step(a, x)
    assert not count.compiled and count.ok and count.executed == 6  # layer 1 only: 2 forward + 4 backward


def test_every_layer_has_its_own_graph_and_sites_when_every_layer_is_alike():
    """Strict mode's coverage check sees every layer's site rewritten (a shared graph reported layer 0's only)."""
    broken, whole = _pair()
    a = fxquant.compile(broken, "linear_mxfp8", backend="aot_eager", strict=True)
    b = fxquant.compile(whole, "linear_mxfp8", backend="aot_eager")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        out_a, grads_a = _step(a, x)
        out_b, grads_b = _step(b, x)
        assert torch.equal(out_a, out_b) and all(torch.equal(g, h) for g, h in zip(grads_a, grads_b))
    assert _sites(a) == {f"layers.{i}.fc": "rewritten" for i in range(3)}
    backend = compile_state(a).backend
    assert [backend.runs[r.index] for r in backend.reports if r.sites] == [2, 2, 2]
    with count_quantize_calls(a) as count:
        _step(a, x)
    assert not count.compiled and count.ok and count.executed == 6 + 4 + 6  # layer 0's input needs no dgrad


class Headed(Stack):
    """Layers without sites, then a head linear."""

    def __init__(self) -> None:
        super().__init__(graph_break=True)
        for block in self.layers:
            block.fc = nn.Identity()
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(super().forward(x))


def test_a_frame_without_sites_stays_shared():
    compiled = fxquant.compile(Headed(), "linear_mxfp8", backend="aot_eager", strict=True)
    x = torch.randn(8, 64)
    for _ in range(2):
        compiled(x)
    reports = compile_state(compiled).backend.reports
    assert all(not r.instance for r in reports) and len({r.frame for r in reports}) == len(reports)
    assert _sites(compiled) == {"head": "rewritten"}


def test_capture_labels_each_layer_of_a_shared_frame_with_its_own_path(tmp_path):
    spec = capture.load_spec("t.yaml", text="""
sections:
  - layers: {kinds: [linear]}
    points: [{component: linear, roles: [input, output]}]
""")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    found = []
    for model, where in zip(_pair(), ("broken", "whole")):
        compiled = fxquant.compile(model, "linear_mxfp8", backend="aot_eager", strict=True, capture=spec,
                                   capture_dir=tmp_path / where)
        compiled(x).sum().backward()
        compile_state(compiled).capture_session.close()
        cs = capture.open(tmp_path / where)
        found.append({(rec.module, rec.layer, rec.role): cs.load(rec) for rec in cs.query()})
    broken, whole = found
    assert sorted(broken) == sorted((f"layers.{i}.fc", i, role) for i in range(3) for role in ("input", "output"))
    assert sorted(broken) == sorted(whole)
    assert all(torch.equal(broken[k], whole[k]) for k in whole)  # the one-frame model's own labels and values


def test_which_module_arguments_are_guarded():
    model = Stack(graph_break=True)
    names = ModuleNames(model)
    args = {"self": model.layers[1], "fc": model.layers[1].fc, "other": model.layers[0], "root": model,
            "n": 3, "foreign": Block(64, False)}
    assert instance_arguments(args, names, ["layers.1.fc"]) == {"self": "layers.1", "fc": "layers.1.fc"}
    assert instance_arguments(args, names, ["layers.0.fc"]) == {"other": "layers.0"}
    assert instance_arguments(args, names, []) == {}



def _run_layer(fn, x):
    return fn(x)


def _run_first(x, *mods):
    return mods[0](x)


def _closure(layer):
    def run(x):
        return layer(x)
    return run


class Reached(Stack):
    """Layers that reach their frame other than as an argument: a bound method, ``*args``, a closure cell."""

    def __init__(self, how: str) -> None:
        super().__init__(graph_break=False)
        self.how = how
        self.fns = [_closure(layer) for layer in self.layers]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if self.how == "bound":
                x = _run_layer(layer.forward, x)
            elif self.how == "star":
                x = _run_first(x, layer)
            else:
                x = self.fns[i](x)
            torch._dynamo.graph_break()  # each call a frame of its own, the layer not among its arguments
        return x


class AttentionBlock(nn.Module):
    """A frame whose graph holds an attention site and no parameter: the layer is a closure variable of the frame."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)


class AttentionStack(nn.Module):
    def __init__(self, graph_break: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"self_attn": AttentionBlock()}) for _ in range(3))
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            module = layer["self_attn"]

            def attend(t: torch.Tensor) -> torch.Tensor:
                return module(t) + t  # a nested function: its frame reads the module from a closure cell

            x = attend(x)
            if self.graph_break:
                torch._dynamo.graph_break()
        return x


@pytest.mark.parametrize("how", ["bound", "star", "closure"])
def test_a_layer_reached_through_a_method_args_or_a_closure_is_guarded(how):
    torch.manual_seed(0)
    reached = Reached(how)
    whole = Stack(graph_break=False)
    whole.load_state_dict(reached.state_dict())
    a = fxquant.compile(reached, LAYER_1, backend="aot_eager", strict=True)
    b = fxquant.compile(whole, LAYER_1, backend="aot_eager")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        out_a, grads_a = _step(a, x)
        out_b, grads_b = _step(b, x)
        assert torch.equal(out_a, out_b) and all(torch.equal(g, h) for g, h in zip(grads_a, grads_b))
    assert _sites(a) == {"layers.0.fc": "high", "layers.1.fc": "rewritten", "layers.2.fc": "high"}
    # the closure's layer is a cell of the frame (guarded itself); a bound method's or *args' through its parameters
    guarded = [r.instance for r in compile_state(a).backend.reports if r.sites]
    assert [sorted(set(g.values())) for g in guarded] == (
        [[f"layers.{i}"] for i in range(3)] if how == "closure" else [[f"layers.{i}.fc"] for i in range(3)])


def test_an_attention_layer_in_a_closure_cell_is_guarded_by_identity():
    scheme = schemes.Scheme.from_yaml_text("""
name: attention1
rules:
  - match: {layers: [1]}
    attention: mxfp8
""", "attention1.yaml")
    q = torch.randn(2, 2, 32, 32, generator=torch.Generator().manual_seed(1))
    compiled = fxquant.compile(AttentionStack(), scheme, backend="aot_eager", strict=True)
    whole = fxquant.compile(AttentionStack(graph_break=False), scheme, backend="aot_eager")
    for _ in range(2):
        assert torch.equal(compiled(q), whole(q))
    reports = [r for r in compile_state(compiled).backend.reports if r.sites]
    assert [r.instance for r in reports] == [{"module": f"layers.{i}.self_attn"} for i in range(3)]
    assert _sites(compiled) == {"layers.0.self_attn": "high", "layers.1.self_attn": "rewritten",
                                "layers.2.self_attn": "high"}
