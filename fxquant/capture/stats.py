"""Per-tensor statistics, computed on the tensor's device and moved to the host in one transfer.

``tensor_stats(x)`` gives min, max, mean, std, amax over the finite elements, the zero fraction, the NaN
and Inf counts and a histogram of binary exponents (floor(log2|x|) of finite non-zero elements, float32
range -149..127). ``quantized_stats(q, x, tq, dim)`` adds, for a GEMM operand ``q`` quantized from
``x`` with TensorQuant ``tq`` along ``dim``: the saturated and flushed-to-zero percentages after the
format's block/tensor scaling, MSE, SQNR (dB) and cosine similarity of ``q`` against ``x``.
Everything is packed into one float64 vector on the device (``pack_*``) and unpacked on the host by
the writer (``unpack``), so the capture path never waits for the device.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from fxquant.formats import E2M1
from fxquant.formats.tensor_quant import TensorQuant
from fxquant.kernels import host
from fxquant.kernels.host import EXP_MAX, EXP_MIN, N_EXP  # noqa: F401  (float32 exponents -149..127: 277 bins)

_BASE = ("numel", "nan", "inf", "zeros", "min", "max", "sum", "sumsq", "amax")
_QUANT = ("nonzero_ref", "flushed", "saturated", "err_sq", "ref_sq", "q_sq", "dot")


def pack_tensor_stats(x: torch.Tensor) -> torch.Tensor:
    """float64 vector on x's device: the _BASE sums, then the exponent histogram. On the CPU one fused
    pass (fxquant.kernels.host) when numba is there; the torch ops below define the numbers."""
    fused = host.tensor_stats(x) if x.device.type == "cpu" else None
    if fused is not None:
        return torch.from_numpy(fused)
    return pack_tensor_stats_torch(x)


def pack_tensor_stats_torch(x: torch.Tensor) -> torch.Tensor:
    xf = x.detach().reshape(-1).float()
    finite = torch.isfinite(xf)
    xz = torch.where(finite, xf, 0.0)
    n_finite = finite.sum()
    total = xz.sum(dtype=torch.float64)
    base = torch.stack([
        torch.full((), float(xf.numel()), dtype=torch.float64, device=xf.device),  # no host-to-device copy
        torch.isnan(xf).sum().double(),
        torch.isinf(xf).sum().double(),
        (xf == 0).sum().double(),
        torch.where(finite, xf, math.inf).amin().double() if xf.numel() else torch.zeros((), dtype=torch.float64, device=xf.device),
        torch.where(finite, xf, -math.inf).amax().double() if xf.numel() else torch.zeros((), dtype=torch.float64, device=xf.device),
        total,
        (xz.double() - total / n_finite.clamp(min=1)).square().mul(finite).sum(),  # centred: stable std
        xz.abs().amax().double() if xf.numel() else torch.zeros((), dtype=torch.float64, device=xf.device),
    ])
    _, e = torch.frexp(xz)
    nz = finite & (xz != 0)
    idx = torch.where(nz, (e - 1 - EXP_MIN).clamp(0, N_EXP - 1), N_EXP).long()
    hist = torch.bincount(idx, minlength=N_EXP + 1)[:N_EXP].double()
    return torch.cat([base, hist])


def _saturated(x: torch.Tensor, tq: TensorQuant, dim: int) -> torch.Tensor:
    """Count of elements beyond the element format's range after the format's own scaling."""
    fmt = tq.fmt
    elem = getattr(fmt, "element", None) or E2M1  # NVFP4Format has no .element; its elements are E2M1
    xf = x.detach().float()
    if elem.bits > 8:  # bf16/fp16 casts: no scaling
        return (torch.isfinite(xf) & (xf.abs() > elem.max_normal)).sum().double()
    # Scales do not depend on rounding: encode with RNE (never draws random numbers, never touches RNG).
    rne = dataclasses.replace(tq, rounding="rne")
    enc = fmt.encode(xf, dim, **rne._kwargs())
    p = elem.decode(enc.codes)  # element values (after scaling), before the scale is applied back
    q = fmt.decode(enc).float()
    over = torch.isfinite(xf) & ((p.abs() == elem.max_normal) & (xf.abs() > q.abs()) | torch.isinf(p))
    return over.sum().double()


def pack_quantized_stats(q: torch.Tensor, x: torch.Tensor, tq: TensorQuant, dim: int) -> torch.Tensor:
    if q.device.type == "cpu" and x.device.type == "cpu" and host.backend() == "numba":
        p = host.pair_sums(q, x)  # one fused pass for everything but the saturation count
        return torch.tensor([p.nonzero_ref, p.flushed, float(_saturated(x, tq, dim)), p.err_sq, p.ref_sq, p.q_sq,
                             p.dot], dtype=torch.float64)
    return pack_quantized_stats_torch(q, x, tq, dim)


def pack_quantized_stats_torch(q: torch.Tensor, x: torch.Tensor, tq: TensorQuant, dim: int) -> torch.Tensor:
    qf, xf = q.detach().float().reshape(-1), x.detach().float().reshape(-1)
    ok = torch.isfinite(qf) & torch.isfinite(xf)
    qz, xz = torch.where(ok, qf, 0.0).double(), torch.where(ok, xf, 0.0).double()
    nonzero = (xf != 0) & torch.isfinite(xf)
    return torch.stack([
        nonzero.sum().double(),
        (nonzero & (qf == 0)).sum().double(),
        _saturated(x, tq, dim),
        (qz - xz).square().sum(),
        xz.square().sum(),
        qz.square().sum(),
        (qz * xz).sum(),
    ])


def unpack(vec: list[float], quantized: bool) -> dict:
    """Host-side: the packed vector -> the manifest's ``stats`` dict (JSON-ready)."""
    b = dict(zip(_BASE, vec[: len(_BASE)]))
    hist = vec[len(_BASE): len(_BASE) + N_EXP]
    n = b["numel"]
    n_finite = n - b["nan"] - b["inf"]
    out = {
        "min": b["min"] if n_finite else None,
        "max": b["max"] if n_finite else None,
        "mean": b["sum"] / n_finite if n_finite else None,
        "std": math.sqrt(b["sumsq"] / (n_finite - 1)) if n_finite > 1 else (0.0 if n_finite else None),
        "amax": b["amax"] if n_finite else None,
        "zero_fraction": b["zeros"] / n if n else 0.0,
        "nan_count": int(b["nan"]),
        "inf_count": int(b["inf"]),
        "exp_hist": {str(EXP_MIN + i): int(c) for i, c in enumerate(hist) if c},
    }
    if quantized:
        qv = dict(zip(_QUANT, vec[len(_BASE) + N_EXP:]))
        nz, count = qv["nonzero_ref"], n_finite
        out.update({
            "flushed_pct": 100.0 * qv["flushed"] / nz if nz else 0.0,
            "saturated_pct": 100.0 * qv["saturated"] / n if n else 0.0,
            "mse": qv["err_sq"] / count if count else None,
            "sqnr_db": (10.0 * math.log10(qv["ref_sq"] / qv["err_sq"]) if qv["err_sq"] > 0 else math.inf)
            if qv["ref_sq"] > 0 else None,
            "cosine": qv["dot"] / math.sqrt(qv["ref_sq"] * qv["q_sq"]) if qv["ref_sq"] > 0 and qv["q_sq"] > 0 else None,
        })
    return out


def compute(x: torch.Tensor, ref: torch.Tensor | None = None, tq: TensorQuant | None = None, dim: int = -1) -> dict:
    """Synchronous convenience (tests, analysis): the stats dict of ``x`` (a quantized copy if ``ref``)."""
    vec = pack_tensor_stats(x)
    if ref is not None:
        vec = torch.cat([vec, pack_quantized_stats(x, ref, tq, dim)])
    return unpack(vec.cpu().tolist(), ref is not None)
