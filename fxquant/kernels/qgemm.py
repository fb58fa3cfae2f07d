"""A Triton GEMM that quantizes both operands as it loads them: ``C = q(A, along K) @ q(B, along K)``.

    >>> from fxquant.kernels.qgemm import qgemm
    >>> c = qgemm(a, b, TensorQuant("mxfp8_e4m3"), TensorQuant("mxfp8_e4m3"))   # a [M, K], b [K, N]

A [M, K] and B [K, N] are read through their strides, so a transposed view costs nothing: a linear's
fprop ``X @ W^T``, dgrad ``dY @ W`` and wgrad ``dY^T @ X`` are each one launch on the tensors as they are,
with no quantized copy and no transpose written to memory (issue 7, deliverable 3). Each K tile of A is
quantized along its columns and each K tile of B along its rows by ``flash_attention_tiles.quant_tile``,
the in-kernel quantizer of the flash-attention kernels, equal to ``TensorQuant.quantize`` of the same
tile bit for bit; ``BLOCK_K`` is a multiple of 32 and tiles start at k = 0, so the MX blocks are the
reference's blocks along K (a ragged K ends in the reference's zero-padded short block). Supported
operand formats: those of ``flash_attention_spec.operand_code`` (element formats without per-tensor
scaling, MX formats; rne/ta/rz); others raise ValueError (use quantize + matmul).

Accumulation is float32. On the GPU a GEMM whose two operands are bf16-exact (quantized to <= 7 mantissa
bits, or unquantized bf16) runs on bf16 tensor cores (exact products); otherwise an IEEE float32 dot, as
everywhere under Triton's interpreter (``TRITON_INTERPRET=1`` on CPU, set before Triton is first imported).
C has A's dtype. The cost of fusing: every A tile is quantized once per column tile of C (N / BLOCK_N
times), every B tile once per row tile; ``benchmarks/run_all.py`` (section ``fused``) measures whether that
beats one quantize pass per operand + cuBLAS.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from fxquant.formats.tensor_quant import TensorQuant
from fxquant.kernels import check_interpreter_loops
from fxquant.kernels._primitives import load_f32, store_from_f32
from fxquant.kernels.flash_attention_spec import QGEMM_KERNEL, bf16_exact, operand_code
from fxquant.kernels.flash_attention_tiles import mm, quant_tile

IO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _qgemm_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    A_CODE: tl.constexpr, B_CODE: tl.constexpr, BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * n_n  # grouped ordering (Triton tutorial 03): neighbouring programs share A tiles
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start_k in range(0, K, BLOCK_K):
        offs_k = start_k + offs_k0
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
        a = load_f32(a_ptrs, (offs_m[:, None] < M) & (offs_k[None, :] < K))
        b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
        b = load_f32(b_ptrs, (offs_k[:, None] < K) & (offs_n[None, :] < N))
        acc += mm(quant_tile(a, 1, A_CODE), quant_tile(b, 0, B_CODE), BF16)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
    store_from_f32(c_ptrs, acc, (offs_m[:, None] < M) & (offs_n[None, :] < N))


INTERPRETED = isinstance(_qgemm_kernel, InterpretedFunction)


def interpreted() -> bool:
    """Whether the kernel was defined under Triton's interpreter (CPU tensors) rather than for the GPU."""
    return INTERPRETED


def supported(tq: TensorQuant | None) -> str | None:
    """Why ``tq`` cannot be quantized on load (None: it can)."""
    try:
        operand_code(tq, "operand", QGEMM_KERNEL)
    except ValueError as exc:
        return str(exc)
    return None


def _bf16(tq: TensorQuant | None, dtype: torch.dtype) -> bool:
    return bf16_exact(tq) if tq is not None else dtype == torch.bfloat16


def _config(m: int, n: int) -> dict[str, int]:
    if INTERPRETED:  # the interpreter's cost grows with the number of programs: few, large tiles
        return dict(BLOCK_M=max(16, min(64, triton.next_power_of_2(m))), BLOCK_N=max(16, min(64, triton.next_power_of_2(n))),
                    BLOCK_K=64, GROUP_M=8)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def qgemm(a: torch.Tensor, b: torch.Tensor, a_tq: TensorQuant | None, b_tq: TensorQuant | None) -> torch.Tensor:
    """``quantize(a, dim=-1) @ quantize(b, dim=0)`` in one kernel; a [M, K], b [K, N], any strides; C [M, N]
    contiguous in a's dtype. ``None`` keeps that operand as it is."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"qgemm: {name} must be a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if t.dtype not in IO_DTYPES:
            raise ValueError(f"qgemm: {name} has dtype {t.dtype}; allowed {list(IO_DTYPES)}")
    if a.shape[1] != b.shape[0] or a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"qgemm: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} do not fit [M, K] @ [K, N]")
    ok = a.device.type == "cpu" if INTERPRETED else a.device.type == "cuda"
    if not ok:
        raise ValueError(f"qgemm: the kernel was built for {'the interpreter (CPU)' if INTERPRETED else 'CUDA'}; got {a.device}")
    if INTERPRETED:
        check_interpreter_loops()
    codes = [operand_code(tq, f"qgemm operand {n}", QGEMM_KERNEL) for n, tq in (("a", a_tq), ("b", b_tq))]
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    cfg = _config(m, n)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    bf16 = not INTERPRETED and _bf16(a_tq, a.dtype) and _bf16(b_tq, b.dtype)
    _qgemm_kernel[grid](
        a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        A_CODE=codes[0], B_CODE=codes[1], BF16=bf16, enable_fp_fusion=False, **cfg,
    )
    return c
