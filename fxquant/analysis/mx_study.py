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

Blocks cut short by the end of a row are zero-padded to 32 elements, as MX pads them; the pads are marked
(``Blocks.valid``) and count in no statistic (element count, MSE, MAE, saturated %, RMSE, PSNR).

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


@dataclass(frozen=True)
class Blocks:
    """Sampled blocks of one tensor: ``values`` float32 ``[n, block]``, a short last block of a row zero-padded
    like a short MX block; ``valid`` bool ``[n, block]``, False at those pads (which are no elements of the
    tensor and count in no statistic)."""

    values: torch.Tensor
    valid: torch.Tensor

    @property
    def numel(self) -> int:
        """Elements of the tensor in the sample (pads excluded)."""
        return int(self.valid.sum())

    def finite_rows(self) -> "Blocks":
        """The blocks without NaN or Inf."""
        keep = torch.isfinite(self.values).all(dim=-1)
        return Blocks(self.values[keep], self.valid[keep])


def sample_blocks(x: torch.Tensor, dim: int, max_blocks: int, seed: int, block: int = 32) -> Blocks:
    """Up to ``max_blocks`` blocks of ``block`` elements along ``dim``, zero-padded like a short MX block (the
    pads marked invalid); when there are more, evenly spaced blocks from a seeded starting offset."""
    x = x.detach()
    x = x.reshape(1) if x.dim() == 0 else x
    x2 = x.movedim(dim, -1).reshape(-1, x.shape[dim])
    length = x2.shape[1]
    nper = -(-length // block)
    total = x2.shape[0] * nper
    if total > max_blocks:  # gather the chosen blocks before any conversion: never copy the whole tensor
        g = torch.Generator().manual_seed(seed)
        start = int(torch.randint(0, total // max_blocks, (1,), generator=g))
        idx = torch.arange(max_blocks) * (total // max_blocks) + start
        rows, cols = idx // nper, (idx % nper) * block
        offs = cols.unsqueeze(1) + torch.arange(block)
        valid = offs < length
        picked = x2[rows.unsqueeze(1), offs.clamp(max=length - 1)].float()
        return Blocks(torch.where(valid, picked, 0.0).contiguous(), valid)
    x2 = x2.float()
    pad = (-length) % block
    if pad:
        x2 = torch.nn.functional.pad(x2, (0, pad))
    valid = (torch.arange(nper * block) < length).expand(x2.shape[0], -1)
    return Blocks(x2.reshape(-1, block).contiguous(), valid.reshape(-1, block).contiguous())


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


def study(blocks: Blocks, mx_formats: tuple[str, ...], offsets: tuple[int, ...]) -> dict[tuple, np.ndarray]:
    """Sums per (format, scale_mode, offset) over the finite blocks of ``blocks``, pads excluded."""
    blocks = blocks.finite_rows()
    xb, valid = blocks.values, blocks.valid
    out: dict[tuple, np.ndarray] = {}
    if xb.numel() == 0:
        return out
    xd = xb.double()
    nonzero = (xb != 0) & valid
    n, ref_sq, n_nonzero = blocks.numel, float(xd.square().sum()), int(nonzero.sum())
    for name in mx_formats:
        fmt = formats.get(name)
        q, p = quantize_configs(xb, fmt, MODES, offsets)
        qd = q.double()
        err = torch.where(valid, qd - xd, 0.0)  # a pad is 0 and quantizes to 0: masked all the same
        dims = (-2, -1)
        rows = torch.stack([
            err.square().sum(dims), torch.where(valid, qd, 0.0).square().sum(dims), (qd * xd).sum(dims),
            err.abs().sum(dims), err.abs().amax(dims),
            ((p.abs() == fmt.element.max_normal) & (xb.abs() > q.abs()) & valid).sum(dims).double(),
            (nonzero & (q == 0)).sum(dims).double(),
        ], dim=-1).numpy()  # [M, K, 7]
        for i, mode in enumerate(MODES):
            for j, k in enumerate(offsets):
                e2, q2, dot, ae, me, sat, fl = rows[i, j].tolist()
                out[(fmt.name, mode.value, int(k))] = np.array(
                    [n, e2, ref_sq, q2, dot, ae, me, sat, fl, n_nonzero], dtype=np.float64)
    return out


def nvfp4_sample(blocks: Blocks, tensor_amax: float) -> np.ndarray | None:
    """[n, nonzero, flushed, saturated, in non-finite blocks] of NVFP4 on sampled blocks (pads excluded), with
    the whole tensor's scale. The elements of a 16-element NVFP4 block holding a NaN or an Inf (NaN after
    quantization) count in n and in the last entry only."""
    xb, valid = blocks.values, blocks.valid
    if xb.numel() == 0 or not math.isfinite(tensor_amax):
        return None
    fmt = formats.get("nvfp4")
    rows = xb.shape[0]
    bad = ~torch.isfinite(xb).reshape(rows, -1, fmt.block_size).all(dim=-1, keepdim=True)
    bad = bad.expand(rows, -1, fmt.block_size).reshape(xb.shape)
    extra = torch.zeros(1, xb.shape[1])
    extra[0, 0] = tensor_amax
    both = torch.cat([torch.where(bad, 0.0, xb), extra])
    q = fmt.quantize(both, -1)[:-1]
    p = fmt.element.decode(fmt.encode(both, -1).codes)[:-1]
    ok = valid & ~bad
    nonzero = (xb != 0) & ok
    sat = (p.abs() == fmt.element.max_normal) & (xb.abs() > q.abs()) & ok
    return np.array([blocks.numel, int(nonzero.sum()), int((nonzero & (q == 0)).sum()), int(sat.sum()),
                     int((valid & bad).sum())], dtype=np.int64)


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


MAX_FIELD = FIELDS.index("max_err")


def merge(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The study sums of two sets of tensors: every field added, ``max_err`` the larger of the two."""
    out = a + b
    out[MAX_FIELD] = max(a[MAX_FIELD], b[MAX_FIELD])
    return out


def metrics(fmt: str, mode: str, k: int, group: str, s: np.ndarray, peak: float) -> StudyRow:
    v = dict(zip(FIELDS, s.tolist()))
    n = int(v["n"])
    mse = v["err_sq"] / n if n else None
    sqnr = None
    if not math.isfinite(v["err_sq"]) and n:  # values scaled past float32's range (finite inputs near its max):
        sqnr = psnr = -math.inf                  # an unbounded error, as what-if reports it (log10 of 0 raised)
        cos = None
    else:
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
