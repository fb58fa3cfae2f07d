"""Tensor-value heatmaps and attention maps of captured tensors (SVG, fxquant.analysis.svg) with an index.html.

``plot_tensors(dirs, out, where=...)`` draws, for each selected record with a stored tensor (fxquant capture sets
or the predecessor's ``.pt`` directories, at most ``max_tensors``):

* a **value heatmap**: the tensor as a 2-D matrix (its last two dims; leading dims at index 0; a 1-D tensor is
  one row), cut into at most ``cells`` x ``cells`` cells, each showing the value of largest magnitude inside it
  (outliers stay visible), on a diverging colour map symmetric around 0 (NaN cells grey);
* for attention ``scores`` and ``probs`` records, an **attention map**: the first ``heads`` heads of the first
  sequence ([b, h, Lq, Lk] from SDPA sites, [b*h, Lq, Lk] from Megatron's unfused attention), query rows x key
  columns, each cell the largest value inside it (probabilities on 0..max, scores on a diverging map).

File names come from the record (module, role, copy, GEMM, rank, iteration, micro-batch, seq); ``heatmaps.json``
lists the files, and the figures an earlier run into the same directory listed but this one does not draw are
removed (``Outputs.remove_stale``).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from fxquant.analysis import html, svg
from fxquant.analysis.outputs import Outputs, slug

ATTENTION_ROLES = ("scores", "probs")


def peak_cells(m: torch.Tensor, cells: int) -> tuple[np.ndarray, int, int]:
    """``m`` [R, C] -> at most ``cells`` x ``cells``: per cell the signed value of largest |value| (a NaN wins,
    then an Inf); also the rows and columns each cell spans."""
    r, c = m.shape
    fr, fc = max(1, math.ceil(r / cells)), max(1, math.ceil(c / cells))
    pr, pc = (-r) % fr, (-c) % fc
    x = torch.nn.functional.pad(m.float(), (0, pc, 0, pr))  # zero padding never beats a real value's magnitude
    x = x.reshape(x.shape[0] // fr, fr, x.shape[1] // fc, fc).permute(0, 2, 1, 3).reshape(x.shape[0] // fr,
                                                                                          x.shape[1] // fc, fr * fc)
    finite = torch.where(torch.isfinite(x), x.abs(), -1.0).argmax(dim=-1, keepdim=True)
    nan, inf = torch.isnan(x), torch.isinf(x)  # a NaN in the cell wins, then an Inf, then the largest |finite|
    idx = torch.where(nan.any(-1, keepdim=True), nan.float().argmax(-1, keepdim=True),
                      torch.where(inf.any(-1, keepdim=True), inf.float().argmax(-1, keepdim=True), finite))
    return x.gather(-1, idx).squeeze(-1).numpy(), fr, fc


def matrix_view(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The 2-D matrix a heatmap shows, and how it was taken from ``t``."""
    if t.dim() == 0:
        return t.reshape(1, 1), "scalar"
    if t.dim() == 1:
        return t.reshape(1, -1), "1-D tensor as one row"
    lead = t.shape[:-2]
    m = t[(0,) * len(lead)] if lead else t
    where = f"[{', '.join(['0'] * len(lead))}, :, :] of {list(t.shape)}" if lead else f"{list(t.shape)}"
    return m, where


def _symmetric(data: np.ndarray) -> float:
    finite = np.abs(data[np.isfinite(data)])
    return float(finite.max()) if finite.size and finite.max() > 0 else 1.0


def _labels(n: int, step: int) -> list[str]:
    return [str(i * step) for i in range(n)]


def _title(f: dict) -> str:
    copy = f.get("copy", "hp")
    extra = f" {f.get('format')}/{f.get('gemm')}" if copy == "quantized" else ""
    return (f"{f.get('module')} {f.get('role')} ({copy}{extra}), rank {f.get('rank')}, iteration {f.get('iteration')}, "
            f"micro-batch {f.get('micro_batch')}")


def value_heatmap(t: torch.Tensor, fields: dict, cells: int = 64) -> svg.Figure:
    m, where = matrix_view(t)
    data, fr, fc = peak_cells(m, cells)
    v = _symmetric(data)
    fig, ax = svg.subplots(panel=(min(720, 12 * data.shape[1] + 120), min(560, 10 * data.shape[0] + 60)))
    ax.heatmap(data, _labels(data.shape[0], fr), _labels(data.shape[1], fc), label="value (largest |x| per cell)",
               cmap="RdBu_r", vmin=-v, vmax=v)
    ax.set_title(_title(fields))
    ax.set_xlabel(f"column ({fc} per cell); {where}")
    ax.set_ylabel(f"row ({fr} per cell)")
    return fig


def attention_map(t: torch.Tensor, fields: dict, heads: int = 8, cells: int = 48) -> svg.Figure:
    """The first ``heads`` heads of the first sequence (module docstring)."""
    if t.dim() < 2:
        raise ValueError(f"attention map of {fields.get('role')}: expected [.., Lq, Lk], got shape {list(t.shape)}")
    if t.dim() >= 4:  # [b, h, Lq, Lk] (leading dims flattened): the first sequence's heads
        maps = t.reshape(-1, *t.shape[-3:])[0][:heads]
    elif t.dim() == 3:  # Megatron's [b * h, Lq, Lk]: the first entries are the first sequence's heads
        maps = t[:heads]
    else:
        maps = t.reshape(1, *t.shape)
    probs = fields.get("role") == "probs"
    n = maps.shape[0]
    ncols = min(4, n)
    nrows = math.ceil(n / ncols)
    fig, axes = svg.subplots(nrows, ncols, panel=(220, 220), title=_title(fields))
    grid = np.array(axes, dtype=object).reshape(nrows, ncols)
    cellsets = [peak_cells(maps[h], cells) for h in range(n)]
    v = max(_symmetric(d) for d, _, _ in cellsets)
    for h in range(nrows * ncols):
        ax = grid[h // ncols, h % ncols]
        if h >= n:
            ax.heatmap(np.full((1, 1), np.nan), [""], [""], label="", cmap="viridis")
            continue
        data, fr, fc = cellsets[h]
        label = "probability" if probs else "score (scale QK^T, before the mask)"
        ax.heatmap(data, _labels(data.shape[0], fr), _labels(data.shape[1], fc), label=label,
                   cmap="viridis" if probs else "RdBu_r", vmin=0.0 if probs else -v, vmax=v)
        ax.set_title(f"head {h}")
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    return fig


MANIFEST = "heatmaps.json"  # the files of one plot_tensors run, as report.json lists a report's


def plot_tensors(dirs, out: str | Path, *, where: dict | None = None, max_tensors: int = 50, cells: int = 64,
                 heads: int = 8) -> tuple[Path, list[str], int]:
    """Draw the heatmaps (and attention maps) of the selected records; returns (index.html, problems, tensors)."""
    from fxquant.analysis.plan import open_sets

    for name, v, lo in (("max_tensors", max_tensors, 1), ("cells", cells, 2), ("heads", heads, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}={v!r}: must be an integer >= {lo}")
    dirs = [dirs] if isinstance(dirs, (str, Path)) else list(dirs)
    problems: list[str] = []
    outputs = Outputs(Path(out))
    previous = outputs.listed(MANIFEST)  # an earlier plot-tensors run there: its figures this one does not draw go
    done = 0
    sets = open_sets(dirs, problems)
    for k, (root, cs) in enumerate(sets.items()):
        # several DIRs share module/role/iteration/seq: each DIR's figures get a prefix of their own
        prefix = f"{k}-{slug(Path(root).name)}_" if len(sets) > 1 else ""
        sel = [r for r in (cs.query(**where) if where else cs) if r.has_tensor]
        problems += [f"{root}: skipped: {p}" for p in getattr(cs, "problems", ())]
        for rec in sel:
            if done >= max_tensors:
                if not any(p.startswith("--max-tensors") for p in problems):
                    problems.append(f"--max-tensors {max_tensors} reached: the remaining records were not drawn")
                break
            f = rec.fields
            try:
                t = cs.load(rec)
            except (ValueError, OSError) as exc:
                problems.append(f"{rec.rank_dir}: record seq={f.get('seq')}: {exc}")
                continue
            name = prefix + slug("_".join(str(f.get(key)) for key in ("module", "role", "copy", "gemm", "rank",
                                                                       "iteration", "micro_batch", "seq")
                                          if f.get(key) is not None))
            section = f"{Path(root).name}: {f.get('component')} {f.get('role')}"
            outputs.figure(f"heatmaps/{name}.svg", value_heatmap(t, f, cells), section, f"{f.get('module')} values")
            if f.get("component") == "attention" and f.get("role") in ATTENTION_ROLES:
                outputs.figure(f"attention/{name}.svg", attention_map(t, f, heads, min(cells, 48)), section,
                               f"{f.get('module')} attention map")
            done += 1
        cs.close()
    facts = [("capture directories", ", ".join(map(str, dirs))), ("filters", repr(where) if where else "none"),
             ("tensors drawn", str(done)), ("cells", f"at most {cells} x {cells}, largest |value| per cell")]
    outputs.json(MANIFEST, {"facts": dict(facts), "problems": problems, "tensors": done,
                            "files": [e.path for e in outputs.entries]}, "About these figures", "Metadata (JSON)")
    index = html.write(outputs.root, outputs.entries, "fxquant tensor heatmaps", facts, problems)
    outputs.remove_stale(previous, keep=[index.name])
    return index, problems, done
