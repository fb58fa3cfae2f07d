"""The parent's side of the reduction: record summaries merged into fixed groupings, in plan order.

Memory is bounded by the number of distinct group values (layers, ranks, roles...), never by the number
of tensors: per group one ``Moments`` and dense histograms (bins.py, ~65 KB each), per fine site key a few
counters per format, and one small row per quantized operand for the per-site error table.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from fxquant import formats
from fxquant.analysis import bins, mx_study
from fxquant.analysis.moments import Moments
from fxquant.analysis.summary import AnalysisConfig, RecordSummary, dense
from fxquant.formats.mx import MXFormat

# groupings of the global statistics (each with quantiles from the signed histogram)
STAT_GROUPINGS: tuple[tuple[str, ...], ...] = (
    (), ("scheme",), ("format",), ("layer",), ("rank",), ("component",), ("kind",), ("role",), ("direction",),
    ("phase",), ("copy",),
)
# The distribution, moment and per-layer groupings lead with the scheme: the pages built from them are drawn per
# scheme, never pooling one scheme's tensors with another's. DIST_GROUPINGS also keep block-relative histograms.
DIST_GROUPINGS = (("scheme", "copy"), ("scheme", "copy", "layer"), ("scheme", "copy", "rank"))
COMPARE_GROUPING = ("scheme", "copy", "component", "role")
MOMENT_GROUPINGS = (("scheme", "copy", "layer", "rank"), ("scheme", "copy", "direction", "role"),
                    ("scheme", "copy", "layer", "direction"))
# the per-layer / per-rank / per-tensor-type pages (layer_pages.py): moments and exponent histograms only
LAYER_PAGE_GROUPING = ("scheme", "layer", "rank", "component", "direction", "role", "copy", "format")
FLOW_KEY = ("scheme", "copy", "component", "layer", "rank", "direction", "role")
FLOW_FIELDS = ("numel", "nonzero", "flushed", "saturated", "nonfinite_blocks")


def key_of(fields: dict, names: tuple[str, ...]) -> tuple:
    return tuple(_hashable(fields.get(n) if n != "copy" else fields.get("copy", "hp")) for n in names)


def _hashable(v: object) -> object:
    """Group keys from manifest values; a malformed (list/dict) value becomes its JSON text."""
    return v if v is None or isinstance(v, (str, int, float, bool)) else json.dumps(v, sort_keys=True, default=str)


@dataclass
class Group:
    moments: Moments = field(default_factory=Moments)
    signed: np.ndarray | None = None
    binade: np.ndarray | None = None
    rel: np.ndarray | None = None
    sampled: int = 0  # records whose signed/block-relative histograms hold only their stored sampled rows


def format_thresholds(name: str) -> tuple[float, float, int | None]:
    """(saturation threshold, flush threshold, MX emax or None) of a format, from fxquant.formats."""
    fmt = formats.get(name)
    e = fmt.element
    return e.max_normal, e.min_subnormal / 2, (e.emax if isinstance(fmt, MXFormat) else None)


def counts_exact(name: str) -> tuple[bool, bool]:
    """(saturated count exact?, flushed count exact?) of format ``name`` read off the histograms: exact when its
    threshold is a bin edge, else an upper bound (bins.count_above / count_at_most); NVFP4 comes from samples."""
    sat_t, flush_t, _ = format_thresholds(name)
    return bins.edge_index(sat_t) is not None, bins.edge_index(flush_t) is not None


def clamp_threshold(emax: int) -> float:
    """2**(emax - 127): an MX block whose amax is below it has its E8M0 scale clamped at 2**-127 (FORMATS.md), a
    larger scale than the floor rule's 2**(floor(log2 amax) - emax), which the block-relative bins assume."""
    return math.ldexp(1.0, emax - 127)


def flow_counts(s: RecordSummary, name: str) -> np.ndarray | None:
    """[numel, nonzero, flushed, saturated, nonfinite_blocks, below_clamp] of one record for one format (floor
    scale for MX); flushed and saturated are upper bounds where ``counts_exact`` says so. For block formats, the
    elements of blocks holding a NaN or an Inf (NaN after quantization) count in numel and nonfinite_blocks
    only; element formats have no blocks (0). below_clamp (MX): the non-zero elements under ``clamp_threshold``,
    the only ones a block with a clamped scale can hold; such elements flush where the counts assume they do not,
    so the true flushed count lies in [flushed, flushed + below_clamp] (exact when below_clamp is 0). NVFP4's
    sampled counts have the first five fields."""
    if name == "nvfp4":
        return None if s.nvfp4 is None else s.nvfp4.astype(np.int64)
    if s.signed is None:
        return None
    sat_t, flush_t, emax = format_thresholds(name)
    signed = dense(s.signed, bins.NSIGNED)
    mag = bins.magnitude(signed)
    nonfinite_blocks = 0
    if emax is not None:
        rel = dense(s.rel, bins.NREL)
        mag = bins.element_domain(rel, emax)
        nonfinite_blocks = int(rel[bins.REL_NONFINITE])
    below = 0
    if emax is not None:  # |x| < 2**(emax - 127): magnitude bins up to the one below that edge
        below = int(bins.magnitude(signed)[1:bins.edge_index(clamp_threshold(emax))].sum())
    numel = int(mag.sum())
    nonzero = numel - int(mag[0]) - int(mag[bins.NAN_FIRST:].sum())
    sat, _ = bins.count_above(mag, sat_t)
    fl, _ = bins.count_at_most(mag, flush_t)
    return np.array([numel + nonfinite_blocks, nonzero, fl, sat, nonfinite_blocks, below], dtype=np.int64)


class Aggregator:
    def __init__(self, config: AnalysisConfig):
        self.config = config
        self.groups: dict[tuple, dict[tuple, Group]] = {g: {} for g in
                                                         (*STAT_GROUPINGS, *DIST_GROUPINGS, COMPARE_GROUPING,
                                                          *MOMENT_GROUPINGS, LAYER_PAGE_GROUPING)}
        self.flows: dict[tuple, dict[str, np.ndarray]] = defaultdict(dict)
        self.sites: list[dict] = []
        self.study: dict[tuple, np.ndarray] = {}
        self.study_peak: dict[tuple, float] = defaultdict(float)
        self.problems: list[str] = []
        self.pids: set[int] = set()
        self.records = 0
        self.tensors = 0
        self.formats_seen: set[str] = set()

    def several_schemes(self) -> bool:
        """Whether the merged records come from more than one scheme: the pages drawn per scheme then name it."""
        return len(self.groups[("scheme",)]) > 1

    def merge_result(self, res) -> None:
        self.pids.add(res.pid)
        self.problems.extend(res.problems)
        for s in sorted(res.summaries, key=lambda s: s.index):
            self.add(s)

    def add(self, s: RecordSummary) -> None:
        self.records += 1
        f = s.fields
        if f.get("format"):
            self.formats_seen.add(str(f["format"]))
        signed = None if s.signed is None else dense(s.signed, bins.NSIGNED)
        binade = None if s.binade is None else dense(s.binade, bins.NBINADE)
        rel = None if s.rel is None else dense(s.rel, bins.NREL)
        if signed is not None:
            self.tensors += 1
        hist_groupings = (*STAT_GROUPINGS, *DIST_GROUPINGS, COMPARE_GROUPING)
        for grouping, table in self.groups.items():
            g = table.get(key_of(f, grouping))
            if g is None:
                g = table[key_of(f, grouping)] = Group()
            g.moments.merge(s.moments)
            if grouping is LAYER_PAGE_GROUPING and binade is not None:
                g.binade = binade.copy() if g.binade is None else g.binade + binade
            if grouping not in hist_groupings:
                continue
            if signed is not None:
                g.signed = signed.copy() if g.signed is None else g.signed + signed
                g.sampled += s.sampled
            if binade is not None:
                g.binade = binade.copy() if g.binade is None else g.binade + binade
            if rel is not None and grouping in DIST_GROUPINGS:
                g.rel = rel.copy() if g.rel is None else g.rel + rel
        flow_key = key_of(f, FLOW_KEY)
        for name in self.config.formats:
            c = flow_counts(s, name)
            if c is not None:
                cur = self.flows[flow_key].get(name)
                self.flows[flow_key][name] = c if cur is None else cur + c
        if s.qerr is not None:
            self.sites.append(site_row(f, s.qerr))
        group_names = ("all", f"role={f.get('role')}", f"direction={f.get('direction')}")
        for (fmt, mode, k), sums in s.study.items():
            for grp in group_names:
                key = (fmt, mode, k, grp)
                self.study[key] = sums.copy() if key not in self.study else mx_study.merge(self.study[key], sums)
                if s.moments.n_finite:
                    self.study_peak[(fmt, grp)] = max(self.study_peak[(fmt, grp)], s.moments.amax)


def site_row(f: dict, q: dict) -> dict:
    row = {k: f.get(k) for k in ("scheme", "format", "qspec", "component", "module", "kind", "layer", "role", "gemm",
                                 "direction", "rank", "iteration", "micro_batch", "seq")}
    row.update({k: q.get(k) for k in ("sqnr_db", "mse", "cosine", "max_err", "saturated_pct", "flushed_pct",
                                      "source", "problem", "err_sq", "ref_sq")})
    return row
