"""The quantized flash-attention kernels: forward, backward dK/dV, backward dQ (FlashAttention-2 structure).

Tensors are contiguous ``[B, H, L, d]``; query head ``h`` reads key/value head ``h // GROUP`` (GQA, as
``repeat_interleave``). The operands that are input tensors (Q, K, V, dO) arrive quantized: the launch
(``flash_attention_launch``) quantizes each once per role along the axis FORMATS.md names, which gives the
bits a per-tile quantization would (MX blocks never straddle a tile), and passes one tensor per role where
two roles differ. The computed operands, P and dS, are quantized here per tile and operand code
(``flash_attention_spec``). docs/flash_attention.md states the semantics:

forward, per query tile and per BLOCK_N key tile j in order (online softmax, natural exp):
    S = q(Q) q(K_j)^T * scale  (masked: -inf)          m' = max(m, rowmax S)
    P~ = exp(S - m')  (unnormalised)                   l = l * exp(m - m') + rowsum P~   (unquantized P~)
    acc = acc * exp(m - m') + q(P~, along Lk in the tile) q(V_j, along Lk)
    O = acc / l,  LSE = m + log l
backward, P = exp(S - LSE) (normalised), D = rowsum(dO * O) given by the caller:
    dP = q(dO) q(V)^T (along dv)      dS = scale * P * (dP - D)
    dV = q(P, Lq)^T q(dO, Lq)         dK = q(dS, Lq)^T q(Q, Lq)         dQ = q(dS, Lk) q(K, Lk)
dK/dV programs own one key tile and loop over the query heads of their group and the query tiles (no
atomics); dQ programs own one query tile. Unquantized P and dS are rounded to the I/O dtype before their
GEMM, as ``p.to(q.dtype)`` in SDPA's math.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fxquant.kernels._primitives import load_f32, store_from_f32
from fxquant.kernels.flash_attention_tiles import mm, operand


@triton.jit
def _tile_ptrs(base, offs_l, offs_c, n_l, n_c, stride_l):
    """Pointers and mask of rows ``offs_l`` (< n_l) and columns ``offs_c`` (< n_c) of one [L, C] head."""
    ptrs = base + offs_l[:, None].to(tl.int64) * stride_l + offs_c[None, :]
    mask = (offs_l[:, None] < n_l) & (offs_c[None, :] < n_c)
    return ptrs, mask


@triton.jit
def _second_role(x, ptr2, offs_l, offs_c, n_l, n_c, stride_l, SAME: tl.constexpr):
    """The tile of a tensor's second role (``ptr2``, the same head and place as ``x``), or ``x`` itself when one
    tensor serves both roles (``SAME``: loaded once)."""
    if SAME:
        y = x
    else:
        ptrs, mask = _tile_ptrs(ptr2, offs_l, offs_c, n_l, n_c, stride_l)
        y = load_f32(ptrs, mask)
    return y


@triton.jit
def _key_stop(len_k, pid_m, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """End of the key range query tile ``pid_m`` visits: under the causal mask, its last row + 1."""
    hi = len_k
    if CAUSAL:
        hi = tl.minimum(len_k, (pid_m + 1) * BLOCK_M)
    return hi


@triton.jit
def _flash_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    sm_scale, n_heads, len_q, len_k, head_d, head_dv,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, IO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PV_P: tl.constexpr, QK_BF16: tl.constexpr, PV_BF16: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    bk = (bh // n_heads) * (n_heads // GROUP) + (bh % n_heads) // GROUP  # the key/value head
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base = q_ptr + bh * len_q * head_d
    k_base = k_ptr + bk * len_k * head_d
    v_base = v_ptr + bk * len_k * head_dv

    ptrs, mask = _tile_ptrs(q_base, offs_m, offs_d, len_q, head_d, head_d)
    qq = load_f32(ptrs, mask)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start_n in range(0, _key_stop(len_k, pid_m, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = start_n + offs_n0
        k_ptrs, k_mask = _tile_ptrs(k_base, offs_n, offs_d, len_k, head_d, head_d)
        kq = load_f32(k_ptrs, k_mask)
        s = mm(qq, tl.trans(kq), QK_BF16) * sm_scale
        valid = offs_n[None, :] < len_k
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs, v_mask = _tile_ptrs(v_base, offs_n, offs_dv, len_k, head_dv, head_dv)
        acc = acc * alpha[:, None] + mm(operand(p, 1, PV_P, IO), load_f32(v_ptrs, v_mask), PV_BF16)
        m_i = m_new
    o = tl.math.div_rn(acc, l_i[:, None])
    ptrs, mask = _tile_ptrs(o_ptr + bh * len_q * head_dv, offs_m, offs_dv, len_q, head_dv, head_dv)
    store_from_f32(ptrs, o, mask)
    tl.store(lse_ptr + bh * len_q + offs_m, m_i + tl.log(l_i), mask=offs_m < len_q)


@triton.jit
def _probs(qq, kq, lse, offs_m, offs_n, sm_scale, len_q, len_k, QK_BF16: tl.constexpr, CAUSAL: tl.constexpr):
    """The normalised probabilities of one [BLOCK_M, BLOCK_N] tile, 0 outside the valid (causal) region."""
    s = mm(qq, tl.trans(kq), QK_BF16) * sm_scale
    valid = (offs_m[:, None] < len_q) & (offs_n[None, :] < len_k)
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None])
    return tl.where(valid, tl.exp(s - lse[:, None]), 0.0)


@triton.jit
def _flash_bwd_dkdv_kernel(
    q_ptr, q2_ptr, k_ptr, v_ptr, do_ptr, do2_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    sm_scale, n_heads, len_q, len_k, head_d, head_dv,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, IO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DV_P: tl.constexpr, DK_DS: tl.constexpr, SAME_Q: tl.constexpr, SAME_DO: tl.constexpr,
    QK_BF16: tl.constexpr, DP_BF16: tl.constexpr, DV_BF16: tl.constexpr, DK_BF16: tl.constexpr,
):
    """q: Q as S = Q K^T reads it, q2: as dK = dS^T Q reads it; do: dO as dP = dO V^T reads it, do2: as
    dV = P^T dO reads it. ``SAME_Q`` / ``SAME_DO``: one tensor serves both roles (loaded once)."""
    pid_n = tl.program_id(0)
    bk = tl.program_id(1).to(tl.int64)  # b * n_kv_heads + kv head
    n_kv = n_heads // GROUP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    ptrs, mask = _tile_ptrs(k_ptr + bk * len_k * head_d, offs_n, offs_d, len_k, head_d, head_d)
    kq = load_f32(ptrs, mask)
    ptrs, mask = _tile_ptrs(v_ptr + bk * len_k * head_dv, offs_n, offs_dv, len_k, head_dv, head_dv)
    vq = load_f32(ptrs, mask)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # the first query tile with a row >= this key tile
    for g in range(GROUP):
        bh = (bk // n_kv) * n_heads + (bk % n_kv) * GROUP + g
        for start_m in range(lo, len_q, BLOCK_M):
            offs_m = start_m + offs_m0
            q_ptrs, q_mask = _tile_ptrs(q_ptr + bh * len_q * head_d, offs_m, offs_d, len_q, head_d, head_d)
            q = load_f32(q_ptrs, q_mask)
            q2 = _second_role(q, q2_ptr + bh * len_q * head_d, offs_m, offs_d, len_q, head_d, head_d, SAME_Q)
            do_ptrs, do_mask = _tile_ptrs(do_ptr + bh * len_q * head_dv, offs_m, offs_dv, len_q, head_dv, head_dv)
            do = load_f32(do_ptrs, do_mask)
            do2 = _second_role(do, do2_ptr + bh * len_q * head_dv, offs_m, offs_dv, len_q, head_dv, head_dv, SAME_DO)
            lse = tl.load(lse_ptr + bh * len_q + offs_m, mask=offs_m < len_q, other=0.0)
            delta = tl.load(delta_ptr + bh * len_q + offs_m, mask=offs_m < len_q, other=0.0)
            p = _probs(q, kq, lse, offs_m, offs_n, sm_scale, len_q, len_k, QK_BF16, CAUSAL)
            dv += mm(tl.trans(operand(p, 0, DV_P, IO)), do2, DV_BF16)
            dp = mm(do, tl.trans(vq), DP_BF16)
            ds = sm_scale * (p * (dp - delta[:, None]))
            dk += mm(tl.trans(operand(ds, 0, DK_DS, IO)), q2, DK_BF16)
    ptrs, mask = _tile_ptrs(dk_ptr + bk * len_k * head_d, offs_n, offs_d, len_k, head_d, head_d)
    store_from_f32(ptrs, dk, mask)
    ptrs, mask = _tile_ptrs(dv_ptr + bk * len_k * head_dv, offs_n, offs_dv, len_k, head_dv, head_dv)
    store_from_f32(ptrs, dv, mask)


@triton.jit
def _flash_bwd_dq_kernel(
    q_ptr, k_ptr, k2_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    sm_scale, n_heads, len_q, len_k, head_d, head_dv,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, IO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DQ_DS: tl.constexpr, SAME_K: tl.constexpr,
    QK_BF16: tl.constexpr, DP_BF16: tl.constexpr, DQ_BF16: tl.constexpr,
):
    """k: K as S = Q K^T reads it, k2: as dQ = dS K reads it (``SAME_K``: one tensor, loaded once)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    bk = (bh // n_heads) * (n_heads // GROUP) + (bh % n_heads) // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_base = k_ptr + bk * len_k * head_d
    v_base = v_ptr + bk * len_k * head_dv

    ptrs, mask = _tile_ptrs(q_ptr + bh * len_q * head_d, offs_m, offs_d, len_q, head_d, head_d)
    qq = load_f32(ptrs, mask)
    ptrs, mask = _tile_ptrs(do_ptr + bh * len_q * head_dv, offs_m, offs_dv, len_q, head_dv, head_dv)
    doq = load_f32(ptrs, mask)
    lse = tl.load(lse_ptr + bh * len_q + offs_m, mask=offs_m < len_q, other=0.0)
    delta = tl.load(delta_ptr + bh * len_q + offs_m, mask=offs_m < len_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, _key_stop(len_k, pid_m, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = start_n + offs_n0
        k_ptrs, k_mask = _tile_ptrs(k_base, offs_n, offs_d, len_k, head_d, head_d)
        k = load_f32(k_ptrs, k_mask)
        k2 = _second_role(k, k2_ptr + bk * len_k * head_d, offs_n, offs_d, len_k, head_d, head_d, SAME_K)
        v_ptrs, v_mask = _tile_ptrs(v_base, offs_n, offs_dv, len_k, head_dv, head_dv)
        p = _probs(qq, k, lse, offs_m, offs_n, sm_scale, len_q, len_k, QK_BF16, CAUSAL)
        dp = mm(doq, tl.trans(load_f32(v_ptrs, v_mask)), DP_BF16)
        ds = sm_scale * (p * (dp - delta[:, None]))
        dq += mm(operand(ds, 1, DQ_DS, IO), k2, DQ_BF16)
    ptrs, mask = _tile_ptrs(dq_ptr + bh * len_q * head_d, offs_m, offs_d, len_q, head_d, head_d)
    store_from_f32(ptrs, dq, mask)
