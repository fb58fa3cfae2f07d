"""MX scaling study: every scale rule (floor / rceil / ceil / even) and shared-exponent offsets, per block.

For a sample of 32-element blocks of each high-precision GEMM operand (blocks along the operand's
blocked dim, default the last), each MX format and each (scale_mode, offset k) quantizes the block with
shared exponent ``s = s_mode + k`` (clamped to [-127, 127], as FORMATS.md clamps): elements
``P = round(x / 2**s)`` saturated, value ``P * 2**s``. ``k = 0`` is exactly ``fxquant.formats``'s MX
quantize with that scale mode (tested bit for bit). An offset cannot be emulated by scaling the *input*
by 2**k: MX quantization commutes with powers of two (``Q(2**k x) == 2**k Q(x)``, also tested), so the
offset is applied to the shared exponent itself. Sums (squared error, energy, dot product, |error|,
max error, saturated and flushed counts) are kept per configuration and merged across tensors; the
recommendation is the configuration with the highest SQNR (ties: floor, then the smallest |k|).

The NVFP4 over/underflow estimate also comes from this sample (NVFP4's block scales are not powers of
two, so no histogram can give it): the sample is quantized together with one block holding the
tensor's amax, so the per-tensor scale is the one the whole tensor would get.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fxquant import formats
from fxquant.formats.mx import MXFormat, mx_scale_exponent
from fxquant.formats.options import ScaleMode

# per configuration: n, err_sq, ref_sq, q_sq, dot, abs_err, max_err, saturated, flushed, nonzero
FIELDS = ("n", "err_sq", "ref_sq", "q_sq", "dot", "abs_err", "max_err", "saturated", "flushed", "nonzero")
MODES: tuple[ScaleMode, ...] = (ScaleMode.FLOOR, ScaleMode.RCEIL, ScaleMode.CEIL, ScaleMode.EVEN)


def sample_blocks(x: torch.Tensor, dim: int, max_blocks: int, seed: int, block: int = 32) -> torch.Tensor:
    """Up to ``max_blocks`` blocks of ``block`` elements along ``dim`` (float32 ``[n, block]``), zero-padded
    like a short MX block; when there are more, evenly spaced blocks from a seeded starting offset."""
    x = x.detach()
    x = x.reshape(1) if x.dim() == 0 else x
    x2 = x.movedim(dim, -1).reshape(-1, x.shape[dim])
    nper = -(-x2.shape[1] // block)
    total = x2.shape[0] * nper
    if total > max_blocks:  # gather the chosen blocks before any conversion: never copy the whole tensor
        g = torch.Generator().manual_seed(seed)
        start = int(torch.randint(0, total // max_blocks, (1,), generator=g))
        idx = torch.arange(max_blocks) * (total // max_blocks) + start
        rows, cols = idx // nper, (idx % nper) * block
        offs = cols.unsqueeze(1) + torch.arange(block)
        valid = offs < x2.shape[1]
        picked = x2[rows.unsqueeze(1), offs.clamp(max=x2.shape[1] - 1)].float()
        return torch.where(valid, picked, 0.0).contiguous()
    x2 = x2.float()
    pad = (-x2.shape[1]) % block
    if pad:
        x2 = torch.nn.functional.pad(x2, (0, pad))
    return x2.reshape(-1, block).contiguous()


def quantize_configs(xb: torch.Tensor, fmt: MXFormat, modes: tuple[ScaleMode, ...],
                     offsets: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, element values P), each ``[len(modes), len(offsets), n, 32]``, of blocks ``xb [n, 32]``
    quantized with shared exponent s_mode + k for every scale mode and offset k, in one quantize call."""
    elem = fmt.element
    amax = xb.abs().amax(dim=-1)
    s_mode = torch.stack([mx_scale_exponent(amax, elem, m) for m in modes])  # [M, n]
    k = torch.tensor(offsets, dtype=s_mode.dtype).view(1, -1, 1)
    s = torch.clamp(s_mode.unsqueeze(1) + k, -127, 127).double().unsqueeze(-1)  # [M, K, n, 1]
    inv = torch.exp2(-s).float()  # exact powers of two (2**-127 is a float32 subnormal)
    p = elem.quantize(xb * inv, "rne", True, None, finite=True)
    return p * torch.exp2(s).float(), p


def quantize_with_offset(xb: torch.Tensor, fmt: MXFormat, mode: ScaleMode, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, element values P) of blocks ``xb [n, 32]`` with shared exponent s_mode + k (finite input)."""
    q, p = quantize_configs(xb, fmt, (mode,), (k,))
    return q[0, 0], p[0, 0]


def study(xb: torch.Tensor, mx_formats: tuple[str, ...], offsets: tuple[int, ...]) -> dict[tuple, np.ndarray]:
    """Sums per (format, scale_mode, offset) over the finite blocks of ``xb``."""
    xb = xb[torch.isfinite(xb).all(dim=-1)]
    out: dict[tuple, np.ndarray] = {}
    if xb.numel() == 0:
        return out
    xd = xb.double()
    nonzero = xb != 0
    ref_sq, n_nonzero = float(xd.square().sum()), int(nonzero.sum())
    for name in mx_formats:
        fmt = formats.get(name)
        q, p = quantize_configs(xb, fmt, MODES, offsets)
        qd = q.double()
        err = qd - xd
        dims = (-2, -1)
        rows = torch.stack([
            err.square().sum(dims), qd.square().sum(dims), (qd * xd).sum(dims), err.abs().sum(dims),
            err.abs().amax(dims),
            ((p.abs() == fmt.element.max_normal) & (xb.abs() > q.abs())).sum(dims).double(),
            (nonzero & (q == 0)).sum(dims).double(),
        ], dim=-1).numpy()  # [M, K, 7]
        for i, mode in enumerate(MODES):
            for j, k in enumerate(offsets):
                e2, q2, dot, ae, me, sat, fl = rows[i, j].tolist()
                out[(fmt.name, mode.value, int(k))] = np.array(
                    [xb.numel(), e2, ref_sq, q2, dot, ae, me, sat, fl, n_nonzero], dtype=np.float64)
    return out


def nvfp4_sample(xb: torch.Tensor, tensor_amax: float) -> np.ndarray | None:
    """[n, nonzero, flushed, saturated] of NVFP4 on sampled blocks, with the whole tensor's scale."""
    xb = xb[torch.isfinite(xb).all(dim=-1)]
    if xb.numel() == 0 or not math.isfinite(tensor_amax):
        return None
    fmt = formats.get("nvfp4")
    extra = torch.zeros(1, xb.shape[1])
    extra[0, 0] = tensor_amax
    both = torch.cat([xb, extra])
    q = fmt.quantize(both, -1)[:-1]
    p = fmt.element.decode(fmt.encode(both, -1).codes)[:-1]
    nonzero = xb != 0
    sat = (p.abs() == fmt.element.max_normal) & (xb.abs() > q.abs())
    return np.array([xb.numel(), int(nonzero.sum()), int((nonzero & (q == 0)).sum()), int(sat.sum())], dtype=np.int64)


@dataclass(frozen=True)
class StudyRow:
    format: str
    scale_mode: str
    offset: int
    group: str
    n: int
    mse: float | None
    rmse: float | None
    sqnr_db: float | None
    psnr_db: float | None
    cosine: float | None
    mae: float | None
    max_err: float
    rel_err: float | None
    saturated_pct: float
    flushed_pct: float


def metrics(fmt: str, mode: str, k: int, group: str, s: np.ndarray, peak: float) -> StudyRow:
    v = dict(zip(FIELDS, s.tolist()))
    n = int(v["n"])
    mse = v["err_sq"] / n if n else None
    sqnr = None
    if v["ref_sq"] > 0:
        sqnr = 10 * math.log10(v["ref_sq"] / v["err_sq"]) if v["err_sq"] > 0 else math.inf
    psnr = 10 * math.log10(peak * peak / mse) if mse and peak > 0 else (math.inf if mse == 0 else None)
    cos = v["dot"] / math.sqrt(v["ref_sq"] * v["q_sq"]) if v["ref_sq"] > 0 and v["q_sq"] > 0 else None
    return StudyRow(fmt, mode, k, group, n, mse, None if mse is None else math.sqrt(mse), sqnr, psnr, cos,
                    v["abs_err"] / n if n else None, v["max_err"],
                    math.sqrt(v["err_sq"] / v["ref_sq"]) if v["ref_sq"] > 0 else None,
                    100 * v["saturated"] / n if n else 0.0, 100 * v["flushed"] / v["nonzero"] if v["nonzero"] else 0.0)


def recommend(rows: list[StudyRow]) -> dict[tuple[str, str], StudyRow]:
    """Best (scale_mode, offset) per (format, group): highest SQNR; ties to floor, then the smallest |k|."""
    order = {m.value: i for i, m in enumerate(MODES)}
    best: dict[tuple[str, str], StudyRow] = {}
    for r in rows:
        key = (r.format, r.group)
        score = (-(r.sqnr_db if r.sqnr_db is not None else -math.inf), order[r.scale_mode], abs(r.offset), r.offset)
        cur = best.get(key)
        if cur is None or score < (-(cur.sqnr_db if cur.sqnr_db is not None else -math.inf),
                                   order[cur.scale_mode], abs(cur.offset), cur.offset):
            best[key] = r
    return best
