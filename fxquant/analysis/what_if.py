""""What if": the quantization error any captured high-precision tensor would have in any format.

``what_if(dirs, formats="all", ...)`` quantizes every selected high-precision record (fxquant capture sets and
the predecessor's ``.pt`` directories alike; ``where`` filters by manifest field) with each format through
``fxquant.formats`` (the reference), along ``dim`` (default: the last dim, a linear input's K), with optional
``rounding`` / ``scale_mode`` (MX formats) and ``block_size`` (block formats: MX and NVFP4 with that many
elements per scale instead of 32 / 16; element formats have no blocks). Per format and group (``by``: any
manifest fields) it sums over the tensors, in float64, over elements where both values are finite:

    sqnr_db = 10 log10(sum x^2 / sum e^2)     e = q - x
    rel_err = ||e|| / ||x||                   mean_rel_err = mean |e| / |x| over x != 0
    mse, rmse, mae, max_err, cosine(q, x), flushed_pct (non-zero x that became 0)

and counts the finite x that the format made NaN (``nan_pct``) or Inf (``inf_pct``: overflow of a format
without saturation, such as fp16), in % of all elements. Such an element's error is unbounded: when a group
has any, its error metrics say so (sqnr_db -inf; rel_err, mean_rel_err, mse, rmse, mae, max_err inf;
cosine None) instead of describing the other elements only.

Tensors are loaded one at a time and never held together; one that cannot be read (a truncated shard, a
refused ``.pt`` file) is named in ``problems`` and left out, and ``loaded`` counts those that were read.
``per_tensor=True`` also returns one row per (tensor, format).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from fxquant import formats as fx_formats
from fxquant.formats.base import Format
from fxquant.formats.options import did_you_mean

log = logging.getLogger(__name__)

_SUMS = ("n", "err_sq", "ref_sq", "q_sq", "dot", "abs_err", "rel_sum", "nonzero", "flushed", "new_nan", "new_inf",
         "lost_nonzero")


@dataclass(frozen=True)
class Quantizer:
    label: str  # format name, with "/b<N>" when the block size differs from the format's
    fmt: Format
    options: dict

    def __call__(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return self.fmt.quantize(x, dim, **self.options)


def quantizers(names: str | list[str] = "all", *, block_size: int | None = None, rounding: str | None = None,
               scale_mode: str | None = None) -> list[Quantizer]:
    """The formats to try: ``"all"`` (every name of ``fxquant.formats.names()``) or names/aliases."""
    if names == "all" or names == ["all"]:
        names = fx_formats.names()
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise ValueError("formats: give at least one format name, or 'all'")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size={block_size!r}: must be an integer >= 1")
    out = []
    for name in dict.fromkeys(fx_formats.canonical_name(n) for n in names):
        fmt = fx_formats.get(name)
        label = name
        if block_size is not None and fmt.block_size is not None and block_size != fmt.block_size:
            fmt, label = dataclasses.replace(fmt, block_size=block_size), f"{name}/b{block_size}"
        opts = {}
        if rounding is not None:
            opts["rounding"] = rounding
        if scale_mode is not None and fmt.block_size is not None and name.startswith("mx"):
            opts["scale_mode"] = scale_mode
        fmt.resolve(**opts)  # validate now, once, with the format's own message
        out.append(Quantizer(label, fmt, opts))
    return out


@dataclass
class Sums:
    tensors: int = 0
    numel: int = 0
    max_err: float = 0.0
    s: dict = field(default_factory=lambda: dict.fromkeys(_SUMS, 0.0))

    def add(self, other: "Sums") -> None:
        self.tensors += other.tensors
        self.numel += other.numel
        self.max_err = max(self.max_err, other.max_err)
        for k in _SUMS:
            self.s[k] += other.s[k]

    def metrics(self) -> dict:
        s, n = self.s, self.s["n"]
        e2, r2, q2 = s["err_sq"], s["ref_sq"], s["q_sq"]
        out = {
            "tensors": self.tensors, "numel": self.numel,
            "sqnr_db": (10 * math.log10(r2 / e2) if e2 > 0 else math.inf) if r2 > 0 else None,
            "rel_err": math.sqrt(e2 / r2) if r2 > 0 else None,
            "mean_rel_err": s["rel_sum"] / s["nonzero"] if s["nonzero"] else None,
            "mse": e2 / n if n else None, "rmse": math.sqrt(e2 / n) if n else None,
            "mae": s["abs_err"] / n if n else None, "max_err": self.max_err if n else None,
            "cosine": s["dot"] / math.sqrt(r2 * q2) if r2 > 0 and q2 > 0 else None,
            "flushed_pct": 100.0 * s["flushed"] / s["nonzero"] if s["nonzero"] else None,
            "nan_pct": 100.0 * s["new_nan"] / self.numel if self.numel else None,
            "inf_pct": 100.0 * s["new_inf"] / self.numel if self.numel else None,
        }
        if s["new_nan"] or s["new_inf"]:  # finite values made NaN/Inf: an unbounded error, not a lossless one
            out.update(sqnr_db=-math.inf, rel_err=math.inf, mse=math.inf, rmse=math.inf, mae=math.inf,
                       max_err=math.inf, cosine=None)
            out["mean_rel_err"] = math.inf if s["lost_nonzero"] else out["mean_rel_err"]
        return out


def tensor_sums(q: torch.Tensor, x: torch.Tensor) -> Sums:
    """The sums of one quantized tensor ``q`` against its source ``x`` (float64)."""
    qd, xd = q.reshape(-1).double(), x.reshape(-1).double()
    xfin, qfin = torch.isfinite(xd), torch.isfinite(qd)
    ok = xfin & qfin
    nonzero = ok & (xd != 0)
    e = torch.where(ok, qd - xd, 0.0)
    xo, qo = torch.where(ok, xd, 0.0), torch.where(ok, qd, 0.0)
    ae = e.abs()
    out = Sums(1, xd.numel(), float(ae.max()) if ae.numel() else 0.0)
    out.s.update(n=float(ok.sum()), err_sq=float(e.square().sum()), ref_sq=float(xo.square().sum()),
                 q_sq=float(qo.square().sum()), dot=float((qo * xo).sum()), abs_err=float(ae.sum()),
                 rel_sum=float((ae[nonzero] / xd[nonzero].abs()).sum()), nonzero=float(nonzero.sum()),
                 flushed=float((nonzero & (qd == 0)).sum()), new_nan=float((xfin & torch.isnan(qd)).sum()),
                 new_inf=float((xfin & torch.isinf(qd)).sum()), lost_nonzero=float((xfin & ~qfin & (xd != 0)).sum()))
    return out


@dataclass
class WhatIfResult:
    rows: list[dict]  # per (group, format)
    tensors: list[dict]  # per (tensor, format) when asked
    records: int  # high-precision records with a stored tensor that were selected
    problems: list[str]
    loaded: int = 0  # of those, the tensors that were read and quantized (the others are named in problems)


def what_if(dirs: list[str | Path] | str | Path, formats: str | list[str] = "all", *, where: dict | None = None,
            dim: int = -1, block_size: int | None = None, rounding: str | None = None, scale_mode: str | None = None,
            by: tuple[str, ...] = ("role",), per_tensor: bool = False, progress: bool = False) -> WhatIfResult:
    """Quantization error of every selected high-precision tensor in every format (module docstring)."""
    from fxquant.analysis.plan import open_sets

    qs = quantizers(formats, block_size=block_size, rounding=rounding, scale_mode=scale_mode)
    dirs = [dirs] if isinstance(dirs, (str, Path)) else list(dirs)
    problems: list[str] = []
    sets = open_sets(dirs, problems)
    selected = []
    for root, cs in sets.items():
        sel = cs.query(**where) if where else cs
        selected += [(cs, r) for r in sel if r.has_tensor and r.fields.get("copy", "hp") != "quantized"]
        problems += [f"{root}: skipped: {p}" for p in getattr(cs, "problems", ())]
    fields = {k for _, rec in selected for k in rec.fields}
    unknown = [b for b in by if selected and b not in fields]
    if unknown:
        raise ValueError(f"by={unknown[0]!r}: unknown record field; fields: {sorted(fields)}"
                         f"{did_you_mean(unknown[0], sorted(fields))}")
    groups: dict[tuple, Sums] = {}
    per: list[dict] = []
    loaded = 0
    for cs, rec in tqdm(selected, desc="what-if", unit="tensor", disable=not progress):
        try:
            x = cs.load(rec)
        except (ValueError, OSError) as exc:  # CaptureReadError is a ValueError
            problems.append(f"{rec.rank_dir}: record seq={rec.fields.get('seq')}: unreadable, left out: {exc}")
            continue
        loaded += 1
        # float32 (exact for bf16 / fp16 values): the format's own values, not rounded back to the stored dtype
        # (bf16 of an fp16 65504 is 65536, which fp16 storage made Inf), as report and quant-error compute them
        x = x.float()
        key = tuple(rec.fields.get(b) for b in by)
        d = dim if x.dim() else 0
        if x.dim() and not -x.dim() <= d < x.dim():
            raise ValueError(f"dim={dim} is out of range for {rec.fields.get('module')} {rec.fields.get('role')} "
                             f"of shape {list(x.shape)}")
        for qz in qs:
            s = tensor_sums(qz(x, d), x)
            groups.setdefault((key, qz.label), Sums()).add(s)
            if per_tensor:
                per.append({**{k: rec.fields.get(k) for k in ("scheme", "module", "layer", "role", "direction",
                                                                 "rank", "iteration", "micro_batch", "seq")},
                            "format": qz.label, **s.metrics()})
        del x
    order = {q.label: i for i, q in enumerate(qs)}
    rows = [{**dict(zip(by, key)), "format": label, **groups[(key, label)].metrics()}
            for key, label in sorted(groups, key=lambda k: (tuple(str(v) for v in k[0]), order[k[1]]))]
    for cs in sets.values():
        cs.close()
    if len(selected) > loaded:
        log.info("what-if: %d of %d selected high-precision tensors could not be read", len(selected) - loaded,
                 len(selected))
    return WhatIfResult(rows, per, len(selected), problems, loaded)
