"""Per-tensor summaries, computed in a worker process: everything the report needs from one stored tensor.

``summarize(record, tensor, config, partner)`` returns a ``RecordSummary``: moments, the signed,
binade and block-relative histograms (bins.py, sent sparse), the quantization error of a quantized GEMM
operand against its high-precision partner, the MX scaling-study sums and the NVFP4 sample counts.
A statistics-only record is summarised from the manifest (moments and the exponent histogram only). A
record with capture-time statistics takes its moments from them; when only sampled rows were stored
(``sample`` in the manifest) its exponent histogram comes from them too (the whole tensor), while the
signed and block-relative histograms, and the quantiles read from them, cover the stored rows only
(``RecordSummary.sampled``).
Only these summaries travel back to the parent; tensors never do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fxquant.analysis import bins, moments, mx_study
from fxquant.formats.tensor_quant import TensorQuant
from fxquant.kernels import host

# roles whose tensors are GEMM operands (the MX study and NVFP4 sample look at these only)
OPERAND_ROLES = frozenset({"input", "weight", "grad_output", "query", "key", "value", "probs", "grad_probs",
                           "grad_scores"})


@dataclass(frozen=True)
class AnalysisConfig:
    """What the workers compute; validated names (fxquant.formats) in canonical form."""

    formats: tuple[str, ...]  # over/underflow and distribution pages
    mx_formats: tuple[str, ...]  # MX scaling study
    offsets: tuple[int, ...] = (-2, -1, 0, 1, 2)
    sample_blocks: int = 128
    quantiles: tuple[float, ...] = (0.001, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 0.999)

    def __post_init__(self) -> None:
        from fxquant import formats

        object.__setattr__(self, "formats", tuple(dict.fromkeys(formats.canonical_name(f) for f in self.formats)))
        mx = tuple(dict.fromkeys(formats.canonical_name(f) for f in self.mx_formats))
        for f in mx:
            if formats.get(f).block_size != 32 or not hasattr(formats.get(f), "element") or f == "nvfp4":
                raise ValueError(f"mx_formats={f!r}: the MX study takes MX block formats only "
                                 f"({[n for n in formats.names() if n.startswith('mx')]})")
        object.__setattr__(self, "mx_formats", mx)
        if isinstance(self.sample_blocks, bool) or not isinstance(self.sample_blocks, int) or self.sample_blocks < 0:
            raise ValueError(f"sample_blocks={self.sample_blocks!r}: must be an int >= 0")
        if any(not 0 <= q <= 1 for q in self.quantiles):
            raise ValueError(f"quantiles={self.quantiles!r}: each must lie in [0, 1]")


def sparse(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    idx = np.flatnonzero(h).astype(np.int32)
    return idx, h[idx]


def dense(sp: tuple[np.ndarray, np.ndarray] | None, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.int64)
    if sp is not None:
        out[sp[0]] = sp[1]
    return out


@dataclass
class RecordSummary:
    index: int  # position in the analysis plan (the parent merges in this order)
    fields: dict  # the record's manifest fields used for grouping
    moments: moments.Moments
    signed: tuple | None = None  # sparse signed histogram
    binade: tuple | None = None  # sparse exponent-field histogram
    rel: tuple | None = None  # sparse block-relative histogram
    qerr: dict | None = None
    study: dict = field(default_factory=dict)
    nvfp4: np.ndarray | None = None
    problems: list[str] = field(default_factory=list)
    sampled: bool = False  # signed/block-relative histograms (and the study) are over the stored sampled rows only


def binade_from_exp_hist(exp_hist: dict, zeros: int) -> np.ndarray:
    """Exponent-field histogram from a manifest ``exp_hist`` ({exponent: count}); subnormals -> field 0."""
    h = np.zeros(bins.NBINADE, dtype=np.int64)
    for e, c in exp_hist.items():
        h[max(int(e) + 127, 0)] += int(c)
    h[0] += zeros
    return h


def block_dim(fields: dict, ndim: int) -> int:
    d = fields.get("blocked_dim")
    if isinstance(d, int) and ndim and -ndim <= d < ndim:
        return d % ndim
    return max(ndim - 1, 0)


def summarize(index: int, fields: dict, tensor: torch.Tensor | None, config: AnalysisConfig,
              partner: torch.Tensor | None = None, seed: int = 0,
              partner_summary: "RecordSummary | None" = None) -> RecordSummary:
    stats = fields.get("stats") or None
    numel = math.prod(fields.get("shape") or [0]) if tensor is None else tensor.numel()
    if tensor is None:
        m = moments.from_manifest(stats, numel) if stats else moments.Moments(n=numel, tensors=1)
        s = RecordSummary(index, fields, m)
        if stats and stats.get("exp_hist") is not None:
            s.binade = sparse(binade_from_exp_hist(stats["exp_hist"], m.zeros))
        if fields.get("copy", "hp") == "quantized":
            s.qerr = manifest_error(stats, numel)
        return s
    x = tensor if tensor.dtype in (torch.float32, torch.bfloat16) else tensor.float()
    d = block_dim(fields, x.dim())
    signed, binade, rel, m = tensor_counts(x, d)
    sampled = fields.get("sample") is not None  # only some rows stored; the capture-time stats saw them all
    if stats is not None:
        mm = moments.from_manifest(stats, math.prod(fields.get("shape") or [0]) if sampled else numel)
        if not sampled:
            mm.zeros = m.zeros  # the stored tensor's count is exact
        elif stats.get("exp_hist") is not None:
            binade = binade_from_exp_hist(stats["exp_hist"], mm.zeros)
        m = mm
    s = RecordSummary(index, fields, m, signed=sparse(signed), binade=sparse(binade), rel=sparse(rel),
                      sampled=sampled)
    copy = fields.get("copy", "hp")
    whole = manifest_error(stats, math.prod(fields.get("shape") or [0])) if copy == "quantized" and sampled else None
    if whole is not None:  # sampled rows stored: the capture-time statistics measured every row
        s.qerr = whole
    elif copy == "quantized" and partner is not None:
        s.qerr = operand_error(x, partner, fields, partner_summary)
        if sampled:
            s.qerr["source"] = "tensors (sampled rows)"
    elif copy == "quantized":
        s.qerr = manifest_error(stats, numel)
    if copy != "quantized" and fields.get("role") in OPERAND_ROLES and config.sample_blocks and x.numel():
        xb = mx_study.sample_blocks(x, d, config.sample_blocks, seed)
        s.study = mx_study.study(xb, config.mx_formats, config.offsets)
        if "nvfp4" in config.formats:
            s.nvfp4 = mx_study.nvfp4_sample(xb, m.amax if m.n_finite else math.nan)
    return s


def tensor_counts(x: torch.Tensor, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, moments.Moments]:
    """(signed, binade, block-relative histograms, moments) of a float32/bf16 tensor, in one pass over it
    (fxquant.kernels.host); MX blocks run along ``dim``."""
    if x.dim() > 1 and dim != x.dim() - 1:
        x = x.movedim(dim, -1)
    if x.dtype == torch.bfloat16:
        c = host.bf16_counts(x)
        signed, binade, m = bf16_patterns(c.patterns)
        return signed, binade, c.rel, m
    c = host.f32_counts(x)
    top = int(c.signed[bins.INF_BIN] + c.signed[bins.NMAG + bins.INF_BIN])
    if top > c.inf:  # finite values above 1.9375 * 2**127 share bin 4080 with Inf: counted in the last finite bin
        pos_inf = int(torch.isposinf(x).sum())
        bins.fold_top_finite(c.signed, int(c.signed[bins.INF_BIN]) - pos_inf,
                             int(c.signed[bins.NMAG + bins.INF_BIN]) - (c.inf - pos_inf))
    zeros = int(c.signed[0] + c.signed[bins.NMAG])
    m = moments.Moments(n=x.numel(), nan=c.nan, inf=c.inf, zeros=zeros, tensors=1)
    if c.n_finite:
        m = moments.Moments(n=x.numel(), nan=c.nan, inf=c.inf, zeros=zeros, n_finite=c.n_finite, min=c.min,
                            max=c.max, mean=c.sum / c.n_finite, m2=c.m2, amax=max(abs(c.min), abs(c.max)), tensors=1)
    return c.signed, c.binade, c.rel, m


_FIN = 0x7F80  # bf16 magnitude patterns below this are finite; 0x7F80 is Inf, above it NaN
_BF16_V = bins.bf16_magnitude_table()[0][:_FIN]  # value of each finite magnitude pattern
_BF16_V2 = _BF16_V * _BF16_V


def _fold(h: np.ndarray, width: int, first_alone: bool) -> np.ndarray:
    """Sum runs of ``width`` consecutive entries (after entry 0 when ``first_alone``)."""
    if not first_alone:
        return h.reshape(-1, width).sum(axis=1)
    rest = np.concatenate([h[1:], np.zeros(1, h.dtype)])  # 32767 patterns + 1 pad = 4096 runs of 8
    return np.concatenate([h[:1], rest.reshape(-1, width).sum(axis=1)])


def bf16_patterns(patterns: np.ndarray) -> tuple[np.ndarray, np.ndarray, moments.Moments]:
    """Signed histogram, binade histogram and exact moments of a bf16 tensor from the count of each of
    its 65536 bit patterns (index = the pattern as uint16; patterns from 0x8000 up are negative)."""
    hpos, hneg = patterns[: 1 << 15], patterns[1 << 15:]
    hm = hpos + hneg
    # magnitude bin of pattern p: 0 for p == 0, else ((p - 1) >> 3) + 1; exponent field: p >> 7
    signed = np.concatenate([_fold(hpos, 8, True), _fold(hneg, 8, True)])
    # the finite patterns 0x7F79..0x7F7F fold into bin 4080 beside Inf (0x7F80): counted in the last finite bin
    bins.fold_top_finite(signed, int(hpos[_FIN - 7:_FIN].sum()), int(hneg[_FIN - 7:_FIN].sum()))
    binade = _fold(hm, 128, False)
    nan, inf, zeros = int(hm[_FIN + 1:].sum()), int(hm[_FIN]), int(hm[0])
    hp, hn = hpos[:_FIN], hneg[:_FIN]
    nf = int(hp.sum() + hn.sum())
    n = int(hm.sum())
    if not nf:
        return signed, binade, moments.Moments(n=n, nan=nan, inf=inf, zeros=zeros, tensors=1)
    total = float(((hp - hn) * _BF16_V).sum())  # not np.dot: BLAS threads stall under load
    sumsq = float(((hp + hn) * _BF16_V2).sum())
    mean = total / nf
    pos_nz, neg_nz = np.flatnonzero(hp), np.flatnonzero(hn)
    lo = -_BF16_V[neg_nz[-1]] if neg_nz.size else _BF16_V[pos_nz[0]]
    hi = _BF16_V[pos_nz[-1]] if pos_nz.size else -_BF16_V[neg_nz[0]]
    return signed, binade, moments.Moments(n=n, nan=nan, inf=inf, zeros=zeros, n_finite=nf, min=float(lo),
                                           max=float(hi), mean=mean, m2=max(sumsq - total * mean, 0.0),
                                           amax=float(max(abs(lo), abs(hi))), tensors=1)


def manifest_error(stats: dict | None, numel: int = 0) -> dict | None:
    """Quantization error of a quantized operand from the capture-time statistics (no max error there), with
    the error and reference energies (sums of squares) they imply, for pooling across sites."""
    if not stats or stats.get("mse") is None and stats.get("sqnr_db") is None:
        return None
    out = {k: stats.get(k) for k in ("mse", "sqnr_db", "cosine", "saturated_pct", "flushed_pct")} | {
        "max_err": None, "source": "manifest"}
    return out | _manifest_energies(stats, numel)


def _manifest_energies(stats: dict, numel: int) -> dict:
    """{"err_sq", "ref_sq"} from a quantized copy's statistics: err_sq = mse x its finite elements; ref_sq from
    the SQNR, or, where the error is zero (q equals its source), the copy's own sum of squares."""
    mse, sqnr = stats.get("mse"), stats.get("sqnr_db")
    nf = numel - int(stats.get("nan_count") or 0) - int(stats.get("inf_count") or 0)
    if not isinstance(mse, (int, float)) or nf <= 0:
        return {}
    e2 = float(mse) * nf
    if sqnr is None:
        return {"err_sq": e2, "ref_sq": 0.0}
    if not isinstance(sqnr, (int, float)):
        return {}
    if math.isfinite(sqnr) and e2 > 0:
        return {"err_sq": e2, "ref_sq": e2 * 10.0 ** (sqnr / 10.0)}
    mean, std = stats.get("mean"), stats.get("std")
    if e2 == 0 and isinstance(mean, (int, float)) and isinstance(std, (int, float)):
        return {"err_sq": 0.0, "ref_sq": float(std) ** 2 * (nf - 1) + nf * float(mean) ** 2}
    return {}


def operand_error(q: torch.Tensor, x: torch.Tensor, fields: dict, partner_summary: "RecordSummary | None" = None) -> dict:
    """SQNR, MSE, cosine, max |error| of quantized operand ``q`` against its high-precision source ``x``,
    plus saturated % and flushed % after the format's scaling (from the manifest, or recomputed)."""
    if q.numel() != x.numel():
        return {"problem": f"quantized copy has {q.numel()} elements but its high-precision partner {x.numel()}"}
    p = host.pair_sums(q, x)
    n, e2, r2, q2 = p.n, p.err_sq, p.ref_sq, p.q_sq
    out = {
        "n": n, "mse": e2 / n if n else None, "max_err": p.max_err if n else None,
        "sqnr_db": (10 * math.log10(r2 / e2) if e2 > 0 else math.inf) if r2 > 0 else None,
        "cosine": p.dot / math.sqrt(r2 * q2) if r2 > 0 and q2 > 0 else None,
        "err_sq": e2, "ref_sq": r2, "source": "tensors",
    }
    st = fields.get("stats") or {}
    if st.get("saturated_pct") is not None:
        out["saturated_pct"], out["flushed_pct"] = st["saturated_pct"], st.get("flushed_pct")
    elif fields.get("qspec"):
        out.update(_clip_stats(q, x, fields, partner_summary))
    return out


def _clip_stats(q: torch.Tensor, x: torch.Tensor, fields: dict, hp: "RecordSummary | None") -> dict:
    """Saturated % and flushed % of a quantized copy: exact from its partner's histograms where the format
    allows (MX with the floor rule blocked along the partner's last dim, unscaled element formats, thresholds
    on bin edges), else
    from the reference on sampled blocks (``clip_source: sampled``)."""
    from fxquant.analysis.aggregate import counts_exact, flow_counts
    from fxquant.formats.mx import MXFormat
    from fxquant.formats.options import ScaleMode, Scaling

    tq = TensorQuant.from_spec(fields["qspec"])
    o = tq.options
    d = block_dim(fields, q.dim())
    is_mx = isinstance(tq.fmt, MXFormat)
    exact = tq.format != "nvfp4" and o.scaling is Scaling.NONE and all(counts_exact(tq.format)) and (
        not is_mx or (o.scale_mode is ScaleMode.FLOOR and d == q.dim() - 1 and x.shape[-1] == q.shape[-1]))
    if exact and hp is not None:
        c = flow_counts(hp, tq.format)
        if c is not None and (len(c) < 6 or c[5] == 0):  # else blocks may have clamped scales: the reference below
            return {"saturated_pct": 100.0 * c[3] / c[0] if c[0] else 0.0,
                    "flushed_pct": 100.0 * c[2] / c[1] if c[1] else 0.0, "clip_source": "histogram"}
    from fxquant.capture import stats as capture_stats

    ref = x.detach().reshape(q.shape).float()
    n = ref.numel()
    if is_mx:  # whole blocks along the blocked dim, the same ones from both tensors
        blocks = mx_study.sample_blocks(ref, d, 2048, 0)
        ref, n = blocks.values, blocks.numel
        qq = mx_study.sample_blocks(q.float(), d, 2048, 0).values
        d = -1
    else:
        qq = q.float()
    cs = capture_stats.compute(qq, ref, tq, d)
    # pads (zero in both) are never saturated nor non-zero: only the saturated share's denominator changes
    return {"saturated_pct": cs["saturated_pct"] * ref.numel() / n if n else 0.0, "flushed_pct": cs["flushed_pct"],
            "clip_source": "sampled" if is_mx and n < q.numel() else "reference"}
