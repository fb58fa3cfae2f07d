"""Checked launches of the quantized flash-attention kernels (``flash_attention_kernels``).

``forward`` returns (O, LSE); ``backward`` computes D = rowsum(dO * O) in float32 (torch), then launches
the dK/dV kernel (one program per key tile and key/value head) and the dQ kernel (one per query tile and
query head). Inputs are contiguous ``[B, H, L, d]`` of one dtype (float32, bfloat16, float16).

The operands that are input tensors (Q, K, V, dO: eight roles) are quantized here, once per role, with the
quantize kernels (``fxquant.kernels.quantize``, the reference's bits) along the role's axis; the kernels
quantize only P and dS, per tile. Quantizing a whole tensor gives the bits the per-tile quantization of the
reference (``flash_reference``) gives: a tile spans the whole head dimension, and along Lq / Lk the tiles
are multiples of 32 (``FlashBlocks.check``), so no MX block straddles a tile, and a partial last block is
zero-padded either way. Roles quantized alike share one tensor. A quantized role is float32 (every value
exact), or bf16 where its GEMM feeds bf16 tensor cores (``gemm_bf16``: the values are bf16 values).
Under ``TRITON_INTERPRET=1`` (fixed when the kernels were first imported) the kernels run on CPU tensors,
every GEMM as an IEEE float32 dot; compiled for the GPU, a GEMM whose operands are bf16-exact runs on
bf16 tensor cores (``gemm_bf16``), the others as IEEE float32 dots.
"""
from __future__ import annotations

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from fxquant.kernels import check_interpreter_loops
from fxquant.kernels.flash_attention import IO_CODES, gemm_bf16
from fxquant.kernels.flash_attention_kernels import _flash_bwd_dkdv_kernel, _flash_bwd_dq_kernel, _flash_fwd_kernel
from fxquant.kernels.flash_attention_spec import Axis, FlashBlocks, FlashQuant, Kind, Operand

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


def _opts(blocks: FlashBlocks, backward: bool) -> dict[str, object]:
    return dict(**blocks.launch(backward), enable_fp_fusion=False)


def _check_device(q: torch.Tensor) -> None:
    ok = q.device.type == "cpu" if _INTERPRETED else q.device.type == "cuda"
    if not ok:
        raise ValueError(
            f"the flash-attention kernels were built for {'the interpreter (CPU)' if _INTERPRETED else 'CUDA'}; "
            f"got tensors on {q.device}"
        )
    if _INTERPRETED:
        check_interpreter_loops()


class _Roles:
    """The input-tensor operands of one launch, quantized once per (tensor, TensorQuant, axis, dtype)."""

    def __init__(self, fq: FlashQuant) -> None:
        self.fq = fq
        self._made: dict[tuple[int, str, int, torch.dtype], torch.Tensor] = {}

    def get(self, x: torch.Tensor, op: Operand, bf16: bool) -> torch.Tensor:
        """``x`` as operand ``op`` reads it: quantized along ``op``'s axis (bf16 when ``bf16``), or ``x``."""
        tq = self.fq.tq(op)
        if tq is None:
            return x
        dim = -1 if op.axis is Axis.D else -2
        dtype = torch.bfloat16 if bf16 else torch.float32
        key = (id(x), tq.spec(), dim if self.fq.kind(op) is Kind.MX else 0, dtype)  # element-wise: any dim
        if key not in self._made:
            from fxquant import kernels

            if bf16 and x.dtype == torch.bfloat16:  # quantize(x) is quantize(x.float()).to(x.dtype)
                y = kernels.quantize(x, tq, dim)
            else:
                y = kernels.quantize(x.float(), tq, dim).to(dtype)
            self._made[key] = y
        return self._made[key]


def forward(q, k, v, causal: bool, scale: float, group: int, fq: FlashQuant, blocks: FlashBlocks):
    """(O [B, Hq, Lq, dv] in q's dtype, LSE [B, Hq, Lq] float32)."""
    _check_device(q)
    b, h, lq, d = q.shape
    o = torch.empty(b, h, lq, v.shape[3], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    bm, bn = blocks.block_m, blocks.block_n
    qk_bf16 = _bf16(fq, Operand.QK_Q, Operand.QK_K, q.dtype)
    pv_bf16 = _bf16(fq, Operand.PV_P, Operand.PV_V, q.dtype)
    roles = _Roles(fq)
    _flash_fwd_kernel[(triton.cdiv(lq, bm), b * h)](
        q_ptr=roles.get(q, Operand.QK_Q, qk_bf16), k_ptr=roles.get(k, Operand.QK_K, qk_bf16),
        v_ptr=roles.get(v, Operand.PV_V, pv_bf16), o_ptr=o, lse_ptr=lse, **_common(q, v, causal, scale, group),
        BLOCK_M=bm, BLOCK_N=bn, PV_P=fq.code(Operand.PV_P), QK_BF16=qk_bf16, PV_BF16=pv_bf16,
        **_opts(blocks, False),
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
    flags = dict(
        QK_BF16=_bf16(fq, Operand.QK_Q, Operand.QK_K, q.dtype), DP_BF16=_bf16(fq, Operand.DP_DO, Operand.DP_V, q.dtype),
    )
    dv_bf16, dk_bf16 = _bf16(fq, Operand.DV_P, Operand.DV_DO, q.dtype), _bf16(fq, Operand.DK_DS, Operand.DK_Q, q.dtype)
    dq_bf16 = _bf16(fq, Operand.DQ_DS, Operand.DQ_K, q.dtype)
    roles = _Roles(fq)
    q_qk, k_qk = roles.get(q, Operand.QK_Q, flags["QK_BF16"]), roles.get(k, Operand.QK_K, flags["QK_BF16"])
    do_dp, v_dp = roles.get(do, Operand.DP_DO, flags["DP_BF16"]), roles.get(v, Operand.DP_V, flags["DP_BF16"])
    q_dk, do_dv = roles.get(q, Operand.DK_Q, dk_bf16), roles.get(do, Operand.DV_DO, dv_bf16)
    k_dq = roles.get(k, Operand.DQ_K, dq_bf16)
    _flash_bwd_dkdv_kernel[(triton.cdiv(lk, bn), b * hk)](
        q_ptr=q_qk, q2_ptr=q_dk, k_ptr=k_qk, v_ptr=v_dp, do_ptr=do_dp, do2_ptr=do_dv, lse_ptr=lse, delta_ptr=delta,
        dk_ptr=dk, dv_ptr=dv, **common, BLOCK_M=bm, BLOCK_N=bn, **flags,
        DV_P=fq.code(Operand.DV_P), DK_DS=fq.code(Operand.DK_DS), SAME_Q=q_dk is q_qk, SAME_DO=do_dv is do_dp,
        DV_BF16=dv_bf16, DK_BF16=dk_bf16, **_opts(blocks, True),
    )
    _flash_bwd_dq_kernel[(triton.cdiv(lq, bm), b * h)](
        q_ptr=q_qk, k_ptr=k_qk, k2_ptr=k_dq, v_ptr=v_dp, do_ptr=do_dp, lse_ptr=lse, delta_ptr=delta, dq_ptr=dq,
        **common, BLOCK_M=bm, BLOCK_N=bn, **flags, DQ_DS=fq.code(Operand.DQ_DS), SAME_K=k_dq is k_qk,
        DQ_BF16=dq_bf16, **_opts(blocks, True),
    )
    return dq, dk, dv
