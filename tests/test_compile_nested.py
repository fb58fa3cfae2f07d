"""A module fxquant.compile returned, used inside a model compiled again (docs/compile.md, "A compiled module
inside a compiled model"): by torch.compile, or by fxquant.compile with another scheme. The inner module runs its
own compiled graphs with its own scheme (Dynamo, left alone, inlines it into the outer graph and compiles it with
the outer backend): its output and gradients equal the module called alone, bit for bit, and its quantizes run."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxquant
from fxquant.counters import count_quantize_calls
from fxquant.qfunctions import quantized_linear
from fxquant.schemes import Site


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.block = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        return self.block(torch.relu(self.pre(x)))


def _net_with_compiled_block() -> tuple[_Net, nn.Linear]:
    torch.manual_seed(0)
    net = _Net()
    raw = net.block
    net.block = fxquant.compile(raw, "linear_mxfp8", backend="aot_eager", kernels="reference", strict=True)
    return net, raw


def _outer(net: _Net, how: str) -> nn.Module:
    if how == "torch.compile":
        return torch.compile(net, backend="aot_eager")
    return fxquant.compile(net, how, backend="aot_eager", kernels="reference", strict=True)


def _block_input(net: _Net, how: str, x: torch.Tensor) -> torch.Tensor:
    """What the block receives inside the model: relu(pre(x)), ``pre`` quantized where the outer scheme says."""
    if how == "linear_hifp8":
        spec = fxquant.schemes.get(how).linear_for(Site.from_path("pre"))
        return torch.relu(quantized_linear(x, net.pre.weight, net.pre.bias, spec)).detach()
    return torch.relu(net.pre(x)).detach()


def _step(fn, x, block):
    """(output, the block's weight gradient) of one forward + backward of ``fn``."""
    block.zero_grad(set_to_none=True)
    out = fn(x)
    out.square().sum().backward()
    return out.detach(), block._orig_mod.weight.grad.clone()


@pytest.mark.parametrize("how", ["torch.compile", "bf16", "linear_hifp8"])
def test_a_compiled_block_inside_a_compiled_model_runs_its_own_graphs(how):
    """Outer torch.compile, outer fxquant.compile with bf16 and with another quantized scheme (its own linear,
    ``pre``, quantized in hifp8, the block in mxfp8)."""
    net, raw = _net_with_compiled_block()
    outer = _outer(net, how)
    x = torch.randn(4, 32)
    _step(outer, x, net.block)
    got, grad = _step(outer, x, net.block)
    h = _block_input(net, how, x).requires_grad_()
    want, want_grad = _step(lambda _: net.block(h), x, net.block)  # the block alone, on the same input
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
    assert not torch.equal(got, raw(h)), "the block's scheme must change its output"
    if how in ("torch.compile", "bf16"):  # executed counts every quantize in the block: here the block's only
        with count_quantize_calls(net.block, strict=True) as count:
            outer(x).square().sum().backward()
        assert count.executed == count.expected == 2 + 4  # fprop x, W; dgrad and wgrad
    if how != "torch.compile":
        state = fxquant.compile_state(outer)
        assert [s.site.module_path for s in state.sites()] == ["pre"]
        with count_quantize_calls(outer, strict=True) as whole:  # the outer's quantizes and the block's
            outer(x).square().sum().backward()
        assert whole.executed == whole.expected == 6 + (0 if how == "bf16" else 2 + 2)  # pre: fprop, wgrad


def test_a_compiled_block_breaks_a_full_graph_compile_and_says_why():
    net, _ = _net_with_compiled_block()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"fxquant.compile'd module: it runs its own compiled"):
        torch.compile(net, backend="aot_eager", fullgraph=True)(torch.randn(4, 32))
