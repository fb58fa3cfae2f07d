"""``fxquant capture export-pt``: a capture set as the predecessor's ``.pt`` files (PREDECESSOR.md).

File names: ``{dir}/{quant_type}/{timestamp}_{counter}_iter{it}_{layer_type}_L{layer}_{op}_{phase}_
{component}_{quant_type}_rank{r}_{name}.pt`` with ``component`` = FA | linear, ``op`` = forward |
backward; every field is sanitised (layout.sanitize), the counter has 6 digits and the timestamp
microseconds. Payload: ``{"tensor", "tensor_info", "metadata"}`` of plain tensors, numbers, strings,
lists and dicts only, so ``torch.load(path, weights_only=True)`` loads it (``load_pt`` does exactly
that and nothing else). Overflow counts are measured against the record's format, when it has one.
``metadata.extras`` carries the record's ``section``, ``sample`` (a sampled record's tensor holds rows of
``tensor_info.shape``) and capture-time ``stats``; pt_reader reads them back. Statistics-only records have no
tensor and no file.
"""
from __future__ import annotations

import datetime as _dt
import logging
from pathlib import Path

import torch

from fxquant._fileio import fsync_dir, write_atomic
from fxquant.capture.layout import sanitize
from fxquant.capture.reader import CaptureSet, Record

log = logging.getLogger(__name__)


def pt_name(rec: Record, counter: int, quant_type: str) -> str:
    f = rec.fields
    ts = _dt.datetime.fromtimestamp(f.get("time", 0.0)).strftime("%Y%m%d_%H%M%S_%f")
    component = "FA" if f["component"] == "attention" else "linear"
    layer = "X" if f.get("layer") is None else str(f["layer"])
    name = f["role"] if f.get("copy", "hp") == "hp" else f"{f['role']}_quantized_{f.get('gemm') or ''}"
    parts = [ts, f"{counter:06d}", f"iter{f['iteration']}", f.get("kind") or f["component"], f"L{layer}",
             f["direction"], f["phase"], component, quant_type, f"rank{f['rank']}", name]
    return sanitize("_".join(sanitize(str(p), 60) for p in parts), 240) + ".pt"


def payload(rec: Record, t: torch.Tensor) -> dict:
    f = rec.fields
    s = f.get("stats") or {}
    info = {
        "shape": list(f["shape"]), "stored_shape": list(t.shape), "dtype": f"torch.{f['dtype']}",
        "device": "cpu", "requires_grad": False, "is_leaf": True,
        "min": s.get("min"), "max": s.get("max"), "mean": s.get("mean"), "std": s.get("std"),
        "overflow_count": s.get("inf_count"), "nan_count": s.get("nan_count"),
        "saturated_pct": s.get("saturated_pct"), "flushed_pct": s.get("flushed_pct"),
    }
    meta = {
        "layer_type": f.get("kind") or f["component"], "operation": f["direction"], "quant_type": f["scheme"],
        "tensor_name": f["role"], "layer_idx": f.get("layer"), "phase": f["phase"],
        "component": "FA" if f["component"] == "attention" else "linear", "rank": f["rank"],
        "iteration": f["iteration"], "micro_batch": f["micro_batch"],
        "save_time": _dt.datetime.fromtimestamp(f.get("time", 0.0)).strftime("%Y-%m-%d %H:%M:%S.%f"),
        # sample: a sampled record's rows (its tensor holds those of tensor_info.shape); stats: the capture-time
        # statistics, over the whole tensor; both read back by pt_reader
        "extras": {k: f.get(k) for k in ("module", "copy", "gemm", "format", "qspec", "blocked_dim", "tp_rank",
                                         "tp_size", "pp_rank", "pp_size", "dp_rank", "dp_size", "shard_dim", "run_id",
                                         "section", "sample", "stats")},
    }
    return {"tensor": t.clone(), "tensor_info": info, "metadata": meta}


def export_pt(cs: CaptureSet, out_dir: str | Path, quant_type: str | None = None, *,
              skipped: int | None = None, replace: bool = False) -> list[Path]:
    """Write one ``.pt`` per stored tensor of ``cs``; returns the paths (atomic per file). Statistics-only records
    (``what: stats``) have no tensor to write: they are skipped, and counted at INFO (``skipped``: their count where
    the caller has it, else ``statistics_only``). A quant-type directory ``out_dir/<quant_type>/`` that already
    holds ``.pt`` files (an earlier export: the same records again under other counters would be read twice) is
    refused with FileExistsError, or with ``replace`` its ``.pt`` files are deleted first."""
    out = Path(out_dir)
    written = []
    skipped = statistics_only(cs) if skipped is None else skipped
    if skipped:
        log.info("export-pt: %d statistics-only record(s) skipped (what: stats: no tensor stored)", skipped)
    def name(rec: Record) -> str:
        return sanitize(quant_type or rec.fields.get("scheme") or "unknown", 60)

    for d in sorted({out / name(r) for r in cs if r.has_tensor}):
        earlier = sorted(d.glob("*.pt")) if d.is_dir() else []
        if earlier and not replace:
            raise FileExistsError(f"{d} already holds {len(earlier)} .pt file(s) of an earlier export: exporting "
                                  f"again would add the records a second time; choose another OUT or --replace "
                                  f"(deletes them first)")
        for f in earlier:
            f.unlink()
        if earlier:
            log.info("export-pt: %d earlier .pt file(s) deleted from %s (replace)", len(earlier), d)
    for counter, rec in enumerate(r for r in cs if r.has_tensor):
        qt = name(rec)
        d = out / qt
        d.mkdir(parents=True, exist_ok=True)
        path = d / pt_name(rec, counter, qt)
        data = payload(rec, cs.load(rec))
        write_atomic(path, lambda fh: torch.save(data, fh), fsync_parent=False)  # directories fsynced below
        written.append(path)
    for d in {p.parent for p in written}:
        fsync_dir(d)
    return written


def statistics_only(cs: CaptureSet) -> int:
    """How many records of ``cs`` hold statistics only (no tensor: ``export_pt`` skips them)."""
    return sum(1 for r in cs if not r.has_tensor)


def load_pt(path: str | Path) -> dict:
    """Load an exported (or predecessor) ``.pt`` safely: ``weights_only=True``; a pickle carrying code is refused."""
    return torch.load(Path(path), map_location="cpu", weights_only=True)
