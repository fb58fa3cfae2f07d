"""Checked launches of the quantized flash-attention kernels (``flash_attention_kernels``).

``forward`` returns (O, LSE); ``backward`` computes D = rowsum(dO * O) in float32 (torch), then launches
the dK/dV kernel (one program per key tile and key/value head) and the dQ kernel (one per query tile and
query head). Inputs are contiguous ``[B, H, L, d]`` of one dtype (float32, bfloat16, float16).
Under ``TRITON_INTERPRET=1`` (fixed when the kernels were first imported) the kernels run on CPU tensors,
every GEMM as an IEEE float32 dot; compiled for the GPU, a GEMM whose operands are bf16-exact runs on
bf16 tensor cores (``gemm_bf16``), the others as IEEE float32 dots.
"""
from __future__ import annotations

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from fxquant.kernels.flash_attention import IO_CODES, gemm_bf16
from fxquant.kernels.flash_attention_kernels import _flash_bwd_dkdv_kernel, _flash_bwd_dq_kernel, _flash_fwd_kernel
from fxquant.kernels.flash_attention_spec import FlashBlocks, FlashQuant, Operand

_INTERPRETED = isinstance(_flash_fwd_kernel, InterpretedFunction)


def interpreted() -> bool:
    """Whether the kernels were defined under Triton's interpreter (CPU tensors) rather than for the GPU."""
    return _INTERPRETED


def _pow2(n: int) -> int:
    return max(32, triton.next_power_of_2(n))


def _common(q: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, group: int) -> dict[str, object]:
    b, h, lq, d = q.shape
    return dict(
        sm_scale=scale, n_heads=h, len_q=lq, len_k=v.shape[2], head_d=d, head_dv=v.shape[3],
        GROUP=group, CAUSAL=causal, IO=IO_CODES[q.dtype], BLOCK_D=_pow2(d), BLOCK_DV=_pow2(v.shape[3]),
    )


def _bf16(fq: FlashQuant, a: Operand, b: Operand, dtype: torch.dtype) -> bool:
    return not _INTERPRETED and gemm_bf16(fq, a, b, dtype)


def _opts(block_m: int, block_n: int, d: int) -> dict[str, object]:
    warps = 4 if block_m * block_n <= 64 * 64 and d <= 64 else 8
    return dict(num_warps=warps, num_stages=2, enable_fp_fusion=False)


def _check_device(q: torch.Tensor) -> None:
    ok = q.device.type == "cpu" if _INTERPRETED else q.device.type == "cuda"
    if not ok:
        raise ValueError(
            f"the flash-attention kernels were built for {'the interpreter (CPU)' if _INTERPRETED else 'CUDA'}; "
            f"got tensors on {q.device}"
        )


def forward(q, k, v, causal: bool, scale: float, group: int, fq: FlashQuant, blocks: FlashBlocks):
    """(O [B, Hq, Lq, dv] in q's dtype, LSE [B, Hq, Lq] float32)."""
    _check_device(q)
    b, h, lq, d = q.shape
    o = torch.empty(b, h, lq, v.shape[3], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    bm, bn = blocks.block_m, blocks.block_n
    _flash_fwd_kernel[(triton.cdiv(lq, bm), b * h)](
        q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=o, lse_ptr=lse, **_common(q, v, causal, scale, group),
        BLOCK_M=bm, BLOCK_N=bn,
        QK_Q=fq.code(Operand.QK_Q), QK_K=fq.code(Operand.QK_K), PV_P=fq.code(Operand.PV_P), PV_V=fq.code(Operand.PV_V),
        QK_BF16=_bf16(fq, Operand.QK_Q, Operand.QK_K, q.dtype), PV_BF16=_bf16(fq, Operand.PV_P, Operand.PV_V, q.dtype),
        **_opts(bm, bn, d),
    )
    return o, lse


def backward(q, k, v, o, lse, do, causal: bool, scale: float, group: int, fq: FlashQuant, blocks: FlashBlocks):
    """(dQ, dK, dV) in the input dtype; dK and dV summed over the query heads of each key/value head."""
    _check_device(q)
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    delta = (do.float() * o.float()).sum(-1).contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    bm, bn = blocks.bwd_m, blocks.bwd_n
    common = _common(q, v, causal, scale, group)
    codes = dict(
        QK_Q=fq.code(Operand.QK_Q), QK_K=fq.code(Operand.QK_K), DP_DO=fq.code(Operand.DP_DO), DP_V=fq.code(Operand.DP_V),
        QK_BF16=_bf16(fq, Operand.QK_Q, Operand.QK_K, q.dtype), DP_BF16=_bf16(fq, Operand.DP_DO, Operand.DP_V, q.dtype),
    )
    _flash_bwd_dkdv_kernel[(triton.cdiv(lk, bn), b * hk)](
        q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=do, lse_ptr=lse, delta_ptr=delta, dk_ptr=dk, dv_ptr=dv, **common,
        BLOCK_M=bm, BLOCK_N=bn, **codes,
        DV_P=fq.code(Operand.DV_P), DV_DO=fq.code(Operand.DV_DO), DK_Q=fq.code(Operand.DK_Q), DK_DS=fq.code(Operand.DK_DS),
        DV_BF16=_bf16(fq, Operand.DV_P, Operand.DV_DO, q.dtype), DK_BF16=_bf16(fq, Operand.DK_DS, Operand.DK_Q, q.dtype),
        **_opts(bm, bn, d),
    )
    _flash_bwd_dq_kernel[(triton.cdiv(lq, bm), b * h)](
        q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=do, lse_ptr=lse, delta_ptr=delta, dq_ptr=dq, **common,
        BLOCK_M=bm, BLOCK_N=bn, **codes,
        DQ_DS=fq.code(Operand.DQ_DS), DQ_K=fq.code(Operand.DQ_K),
        DQ_BF16=_bf16(fq, Operand.DQ_DS, Operand.DQ_K, q.dtype),
        **_opts(bm, bn, d),
    )
    return dq, dk, dv
