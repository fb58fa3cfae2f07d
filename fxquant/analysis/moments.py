"""Mergeable moments of a set of tensors: counts, min, max, mean, variance (Chan's pairwise merge), amax.

One ``Moments`` per tensor is computed in a worker (from the tensor's one-pass counts, or from the capture manifest's
``stats`` for statistics-only records) and merged in the parent in a fixed order, so the report's numbers
do not depend on how many workers ran.
"""
from __future__ import annotations

import math
from dataclasses import dataclass



@dataclass
class Moments:
    n: int = 0  # elements, non-finite included
    nan: int = 0
    inf: int = 0
    zeros: int = 0
    n_finite: int = 0
    min: float = math.inf
    max: float = -math.inf
    mean: float = 0.0
    m2: float = 0.0  # sum of squared deviations from the mean (finite elements)
    amax: float = 0.0
    tensors: int = 0

    def merge(self, o: "Moments") -> None:
        n = self.n_finite + o.n_finite
        if n:
            d = o.mean - self.mean
            self.m2 = self.m2 + o.m2 + d * d * self.n_finite * o.n_finite / n
            self.mean = self.mean + d * o.n_finite / n
        self.n_finite = n
        self.n += o.n
        self.nan += o.nan
        self.inf += o.inf
        self.zeros += o.zeros
        self.min = min(self.min, o.min)
        self.max = max(self.max, o.max)
        self.amax = max(self.amax, o.amax)
        self.tensors += o.tensors

    def to_dict(self) -> dict:
        nf = self.n_finite
        return {
            "tensors": self.tensors, "numel": self.n, "finite": nf, "nan": self.nan, "inf": self.inf,
            "zero_fraction": self.zeros / self.n if self.n else None,
            "min": self.min if nf else None, "max": self.max if nf else None,
            "mean": self.mean if nf else None,
            "std": math.sqrt(max(self.m2, 0.0) / (nf - 1)) if nf > 1 else (0.0 if nf else None),
            "amax": self.amax if nf else None,
        }


def from_manifest(stats: dict, numel: int) -> Moments:
    """Moments from a capture manifest ``stats`` dict (fxquant.capture.stats.unpack)."""
    nan, inf = int(stats.get("nan_count") or 0), int(stats.get("inf_count") or 0)
    nf = numel - nan - inf
    std = stats.get("std")
    if nf <= 0 or stats.get("min") is None:
        return Moments(n=numel, nan=nan, inf=inf, zeros=round((stats.get("zero_fraction") or 0) * numel), tensors=1)
    return Moments(
        n=numel, nan=nan, inf=inf, zeros=round((stats.get("zero_fraction") or 0.0) * numel), n_finite=nf,
        min=float(stats["min"]), max=float(stats["max"]), mean=float(stats["mean"]),
        m2=float(std) ** 2 * (nf - 1) if std is not None else 0.0, amax=float(stats["amax"]), tensors=1,
    )
