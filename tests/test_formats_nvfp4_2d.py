"""NVFP4 with ``block_2d=True`` (FORMATS.md "NVFP4": NVIDIA's recipe's 2D 16x16 weight blocks): one E4M3 scale per
16x16 tile of a 2-D tensor, from the tile's amax; the per-tensor scale and the elements as in the 1-D recipe.

Checked against the recipe written out tile by tile in plain float32 torch ops (not the format's block code),
along either dim (the same tiles, so the same values: W and W^T quantize alike), with partial tiles at both
edges, in float32/bf16/fp16; compiled by Inductor (CPU) bit for bit; slabs of rows (the eager CPU path) whole
tiles; encode/decode; the option's errors; the Triton kernels and the op's route through them (tests/test_kernels.py
compares them with the reference at length); a scheme that puts 2-D blocks on the weight only."""
from __future__ import annotations

import pytest
import torch

import fxquant
import fxquant.ops  # noqa: F401  (defines the op)
from fxquant import kernels, lowering
from fxquant.formats.element import E2M1, E4M3
from fxquant.formats.tensor_quant import TensorQuant
from tests.bitwise import assert_bitwise_equal, assert_lowered, generated_code

TQ = TensorQuant("nvfp4", block_2d=True)
SHAPES = [(32, 64), (37, 50), (5, 7), (16, 16), (1, 100), (100, 1), (33, 16), (17, 17)]


def tiles_recipe(w: torch.Tensor) -> torch.Tensor:
    """FORMATS.md's NVFP4 recipe, one 16x16 tile at a time, float32 (round to nearest even)."""
    x = w.to(torch.float32)
    amax_t = x.abs().amax()
    g = amax_t / 2688.0
    inv_g = 1.0 / g
    out = torch.empty_like(x)
    for r in range(0, x.shape[0], 16):
        for c in range(0, x.shape[1], 16):
            t = x[r:r + 16, c:c + 16]
            q = torch.clamp(t.abs().amax() / 6.0 / g, 2.0**-9, 448.0)
            b = E4M3.quantize_arith(q.reshape(1), "rne", True, None).reshape(())
            p = E2M1.quantize_arith(t * (inv_g / b), "rne", True, None)
            out[r:r + 16, c:c + 16] = p * (g * b)
    return out.to(w.dtype)


def _tensor(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.pow(10.0, torch.empty(*shape).uniform_(-3, 3, generator=g))
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_equals_the_recipe_tile_by_tile_along_either_dim(shape, dtype):
    w = _tensor(shape, dtype)
    want = tiles_recipe(w)
    assert_bitwise_equal(TQ.quantize(w, -1), want, f"dim=-1 {shape}:")
    assert_bitwise_equal(TQ.quantize(w, 0), want, f"dim=0 {shape}:")
    assert_bitwise_equal(TQ.quantize(w.t().contiguous(), -1).t(), want, f"transposed {shape}:")


def test_differs_from_one_dimensional_blocks_and_shares_one_scale_per_tile():
    w = _tensor((32, 32), torch.float32, seed=3)
    w[0, 0] = 1000.0  # one large element: its whole tile (not only its 16-element row block) scales to it
    two_d, one_d = TQ.quantize(w, -1), TensorQuant("nvfp4").quantize(w, -1)
    assert not torch.equal(two_d, one_d)
    enc = TQ.fmt.encode(w, -1, block_2d=True)
    assert enc.scales.shape == (32, 2)  # one code per 16-element block, equal within each tile's 16 rows
    assert (enc.scales.view(2, 16, 2) == enc.scales.view(2, 16, 2)[:, :1]).all()
    assert_bitwise_equal(TQ.fmt.decode(enc), two_d, "decode(encode):")


@pytest.mark.parametrize("rounding", ["rne", "sr"])
@pytest.mark.parametrize("dim", [-1, 0])
def test_compiled_equals_the_reference(rounding, dim):
    tq = TensorQuant("nvfp4", rounding=rounding, block_2d=True)
    for shape in SHAPES:
        torch._dynamo.reset()
        w = _tensor(shape, torch.float32, seed=1)
        fn = torch.compile(lambda t: torch.relu(torch.ops.fxquant.quantize(t, tq.spec(), dim, 5)) + 1,
                           backend=lowering.inductor_backend)
        with generated_code() as codes:
            got = fn(w)
        assert_bitwise_equal(got, torch.relu(tq.quantize(w, dim, seed=5)) + 1, f"{rounding} dim={dim} {shape}:")
        assert_lowered(codes, [tq.spec()], "cpu", f"{rounding} dim={dim} {shape}:")  # the op's kernel is the reference


def test_slabs_of_rows_hold_whole_tiles():
    """The eager CPU path quantizes slabs of rows (``CHUNK_ELEMENTS``); with 2-D blocks each slab is whole tiles."""
    w = _tensor((70, 48), torch.float32, seed=2)
    x2 = w.clone()
    one = TQ.fmt._quantize_rows(x2, TQ.options, 0, torch.float32, chunk_elements=1 << 30)
    for chunk in (1, 48, 50, 800, 16 * 48 + 1):
        assert_bitwise_equal(TQ.fmt._quantize_rows(x2, TQ.options, 0, torch.float32, chunk_elements=chunk), one,
                             f"chunk {chunk}:")
    assert_bitwise_equal(one, tiles_recipe(w), "whole:")


def test_errors_and_spec():
    assert TQ.spec() == "nvfp4:rounding=rne,saturate=1,block_2d=1"
    assert TensorQuant.from_spec(TQ.spec()) == TQ and TensorQuant("nvfp4", block_2d=False) == TensorQuant("nvfp4")
    assert TensorQuant("nvfp4").spec() == "nvfp4:rounding=rne,saturate=1"  # unchanged without the option
    with pytest.raises(ValueError, match="2-D tensors"):
        TQ.quantize(torch.randn(2, 16, 16))
    with pytest.raises(ValueError, match="2-D tensors"):
        TQ.quantize(torch.randn(16))
    with pytest.raises(ValueError, match="block_2d=True does not apply to format 'mxfp8_e4m3'"):
        TensorQuant("mxfp8", block_2d=True)
    with pytest.raises(ValueError, match="block_2d='yes'"):
        TensorQuant("nvfp4", block_2d="yes")


@pytest.mark.triton
def test_the_kernels_implement_it():
    """The Triton kernels implement the tiles (``kernels.takes``), called directly and through the op's kernel route,
    along either dim; on CUDA, or without a GPU in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1)."""
    assert kernels.takes(TQ) and kernels.takes(TensorQuant("nvfp4"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w = _tensor((20, 40), torch.float32)
    want = tiles_recipe(w)
    for dim in (-1, 0):
        x = w.to(device)
        assert_bitwise_equal(kernels.quantize(x, TQ, dim).cpu(), want, f"kernels dim={dim}:")
        assert_bitwise_equal(kernels._quantize_op_impl(x, TQ.spec(), dim, None).cpu(), want, f"op dim={dim}:")
    with pytest.raises(ValueError, match="2-D tensors"):
        kernels.quantize(torch.randn(2, 16, 16, device=device), TQ)


def test_a_scheme_puts_tiles_on_the_weight_only():
    scheme = fxquant.schemes.Scheme.from_yaml_text("""
name: nvfp4_w2d
rules:
  - linear:
      format: nvfp4
      fprop: {w: {block_2d: true}}
      dgrad: {w: {block_2d: true}}
""", "nvfp4_w2d.yaml")
    lq = scheme.linear_for(fxquant.schemes.model.Site.from_path("fc"))
    assert lq.fprop.b == TQ and lq.dgrad.b == TQ and lq.fprop.a == TensorQuant("nvfp4")
    torch.manual_seed(0)
    model = torch.nn.Linear(48, 40)
    x = torch.randn(3, 48, requires_grad=True)
    out = fxquant.compile(model, scheme, backend="aot_eager", strict=True)(x)
    want = TensorQuant("nvfp4").quantize(x.detach()) @ tiles_recipe(model.weight.detach()).t() + model.bias.detach()
    torch.testing.assert_close(out.detach(), want, rtol=1e-6, atol=1e-6)  # the GEMM's own summation order aside


@pytest.mark.gpu
def test_cuda_op_equals_the_cpu_recipe():
    """On CUDA the op (compiled by Inductor: NVFP4 stays the op there) runs the Triton kernel for the tiles; its
    values equal the recipe computed on the CPU."""
    for shape in SHAPES:
        torch._dynamo.reset()
        w = _tensor(shape, torch.float32, seed=4)
        fn = torch.compile(lambda t: torch.ops.fxquant.quantize(t, TQ.spec(), 0, None), backend=lowering.inductor_backend)
        assert_bitwise_equal(fn(w.cuda()).cpu(), tiles_recipe(w), f"cuda {shape}:")
