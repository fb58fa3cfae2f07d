"""aot_eager graphs call fxquant::capture directly (passes/effects.py): no with_effects wrapper is left, the
calls keep their order and arguments, and what is captured equals the eager reference bit for bit."""
from __future__ import annotations

import torch
from torch import nn

from fxquant import capture, schemes
from fxquant.backend import FxquantBackend

from tests.capture_helpers import spec_text


def _captures(node_list) -> list[tuple]:
    out = []
    for n in node_list:
        if n.op != "call_function":
            continue
        if n.target is torch.ops.higher_order.with_effects and n.args[1] is torch.ops.fxquant.capture.default:
            out.append(("wrapped", n.args[3]))
        elif n.target is torch.ops.fxquant.capture.default:
            out.append(("direct", n.args[1]))
    return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _run(model, backend, root, x) -> list[tuple[str, str, torch.Tensor]]:
    compiled = torch.compile(model, backend=backend) if backend is not None else model
    with capture.start(spec_text(), root):
        compiled(x).sum().backward()
    cs = capture.open(root)
    return [(r.module, r.role, cs.load(r)) for r in cs]


def test_aot_eager_graphs_call_the_capture_op_directly_in_order(tmp_path, monkeypatch):
    from torch._dynamo.backends import debugging

    seen: list[list[tuple]] = []
    real = debugging.boxed_nop

    def spy(gm, inputs):
        seen.append(_captures(gm.graph.nodes))
        return real(gm, inputs)

    monkeypatch.setattr(debugging, "boxed_nop", spy)
    torch._dynamo.reset()
    model = _model()
    x = torch.randn(4, 16)
    backend = FxquantBackend(schemes.get("bf16"), inner="aot_eager", root=model, capture=spec_text())
    got = _run(model, backend, tmp_path / "aot", x)
    assert len(seen) == 2  # forward and backward graphs
    assert all(kind == "direct" for g in seen for kind, _ in g)
    roles = [tap for g in seen for _, tap in g]
    assert len(roles) == 11 and any('"r":"grad_output"' in t for t in roles)  # forward: input, weight, output x 2; backward: grad_output, grad_weight x 2, grad_input of layer 2
    # order and values: equal to the eager tap-hook reference
    model.zero_grad(set_to_none=True)
    ref = _run(model, FxquantBackend(schemes.get("bf16"), inner="eager", root=model, capture=spec_text()),
               tmp_path / "eager", x)
    assert [(m, r) for m, r, _ in got] == [(m, r) for m, r, _ in ref]
    for (_, _, a), (_, _, b) in zip(got, ref):
        assert torch.equal(a, b)


def test_rewrite_counts_and_keeps_taps_and_order(tmp_path):
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    from fxquant.passes.effects import direct_capture_calls

    before, after, counts = [], [], []

    def compiler(gm, inputs):
        before.append(_captures(gm.graph.nodes))
        counts.append(direct_capture_calls(gm))
        after.append(_captures(gm.graph.nodes))
        return boxed_nop(gm, inputs)

    torch._dynamo.reset()
    model = _model()
    backend = FxquantBackend(schemes.get("bf16"), inner="aot_eager", root=model, capture=spec_text())
    backend.compile_inner = lambda gm, ex, index=-1: aot_autograd(fw_compiler=compiler, bw_compiler=compiler)(gm, ex)
    with capture.start(spec_text(), tmp_path):
        torch.compile(model, backend=backend)(torch.randn(4, 16)).sum().backward()
    assert counts == [len(b) for b in before] and sum(counts) == 11
    for b, a in zip(before, after):
        assert [k for k, _ in b] == ["wrapped"] * len(b) and [k for k, _ in a] == ["direct"] * len(a)
        assert [t for _, t in b] == [t for _, t in a]  # same taps, same order
    assert len(capture.open(tmp_path)) == 11
