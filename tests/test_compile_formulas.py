"""The COMPILED model against quantized-GEMM formulas written out by hand (issue 3, item 7, second bullet).

``fxquant.compile`` (aot_eager and Inductor) on a module holding one ``nn.Linear``; the expected values use
``fxquant.formats.get(fmt).quantize`` called directly (not fxquant's op, qfunctions or schemes):

    y  = F.linear(q(x, K), q(W, K)) + b
    dX = q(dY, N) @ q(W, N)
    dW = q(dY, M)^T @ q(X, M)          X, dY flattened to [M, .] (M = all leading dims)

For the MX scheme the inputs' magnitudes vary by 2**±6 element to element, so blocking any operand along
the other axis changes the result (checked too).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxquant
from fxquant import formats


def q(x: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    return formats.get(fmt).quantize(x, dim)


def spread(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 7, shape, generator=g).float())


class OneLinear(nn.Module):
    def __init__(self, k: int, n: int):
        super().__init__()
        self.proj = nn.Linear(k, n)

    def forward(self, x):
        return self.proj(x)


M0, M1, K, N = 2, 40, 64, 96  # M = 80 tokens: two full MX blocks and a short one along M


def seeded_step(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Give ``layer`` (K inputs, N outputs) its seeded weight and bias; return the seeded x [M0, M1, K] (requiring
    grad) and dY [M0, M1, N]."""
    with torch.no_grad():
        layer.weight.copy_(spread(*layer.weight.shape, seed=1))
        layer.bias.copy_(torch.randn(N, generator=torch.Generator().manual_seed(3)))
    return spread(M0, M1, K, seed=0).requires_grad_(), spread(M0, M1, N, seed=2)


def compiled_step(scheme: str, backend: str):
    """(x, W, b, dY, y, dX, dW, db) of one compiled forward + backward with dY given."""
    torch._dynamo.reset()
    model = OneLinear(K, N)
    x, dy = seeded_step(model.proj)
    compiled = fxquant.compile(model, scheme, backend=backend, strict=True)
    y = compiled(x)
    y.backward(dy)
    (site,) = fxquant.compile_state(compiled).sites()
    assert site.status.value == "rewritten"
    w, b = model.proj.weight.detach(), model.proj.bias.detach()
    return x.detach(), w, b, dy, y.detach(), x.grad, model.proj.weight.grad, model.proj.bias.grad


def check_output(y, qx, qw, b, backend) -> None:
    """y == F.linear(qx, qw) + b: bit for bit against ATen's fused bias add under aot_eager, within fp32
    rounding of the separate add (and under Inductor, which may add the bias in its own kernel)."""
    torch.testing.assert_close(y, F.linear(qx, qw) + b, rtol=1e-6, atol=1e-6)
    if backend == "aot_eager":
        assert torch.equal(y, F.linear(qx, qw, b))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_linear_hifp8_equals_hand_formulas(backend):
    x, w, b, dy, y, dx, dw, db = compiled_step("linear_hifp8", backend)
    h = lambda t: q(t, "hifp8", -1)  # noqa: E731  element-wise: the axis does not matter
    x2, dy2 = x.reshape(-1, K), dy.reshape(-1, N)
    check_output(y, h(x), h(w), b, backend)
    assert torch.equal(dx, (h(dy2) @ h(w)).reshape(x.shape))
    assert torch.equal(dw, h(dy2).t() @ h(x2))
    torch.testing.assert_close(db, dy2.sum(0), rtol=1e-5, atol=0)  # high precision; Inductor's own sum order
    assert not torch.equal(dx, (dy2 @ w).reshape(x.shape))  # the quantization did something


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_linear_mxfp8_equals_hand_formulas_with_block_axes(backend):
    fmt = "mxfp8"
    x, w, b, dy, y, dx, dw, db = compiled_step("linear_mxfp8", backend)
    x2, dy2 = x.reshape(-1, K), dy.reshape(-1, N)
    check_output(y, q(x, fmt, -1), q(w, fmt, 1), b, backend)  # fprop: X, W along K
    assert torch.equal(dx, (q(dy2, fmt, 1) @ q(w, fmt, 0)).reshape(x.shape))  # dgrad: dY, W along N
    assert torch.equal(dw, q(dy2, fmt, 0).t() @ q(x2, fmt, 0))  # wgrad: dY, X along M
    # every operand blocked along the other axis gives another answer
    for wrong in (F.linear(q(x2, fmt, 0), q(w, fmt, 1)), F.linear(q(x2, fmt, 1), q(w, fmt, 0))):
        assert not torch.allclose(y.reshape(-1, N), wrong + b, rtol=1e-6, atol=1e-6)
    assert not torch.equal(dx, (q(dy2, fmt, 0) @ q(w, fmt, 0)).reshape(x.shape))
    assert not torch.equal(dx, (q(dy2, fmt, 1) @ q(w, fmt, 1)).reshape(x.shape))
    assert not torch.equal(dw, q(dy2, fmt, 1).t() @ q(x2, fmt, 0))
    assert not torch.equal(dw, q(dy2, fmt, 0).t() @ q(x2, fmt, 1))
