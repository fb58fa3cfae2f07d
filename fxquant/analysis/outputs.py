"""Writing report files: deterministic names, strict JSON, CSV, tabulate text, and SVG figures
(fxquant.analysis.svg).

Every file goes through ``Outputs``, which records its section and title for index.html. JSON is strict
(no NaN/Infinity tokens): NaN becomes null and ±Inf the strings "inf" / "-inf".

A report reusing a directory removes what the previous report there wrote and this one does not
(``Outputs.listed`` + ``Outputs.remove_stale``): only files that report's own manifest lists, never others.
"""
from __future__ import annotations

import concurrent.futures as cf
import csv
import hashlib
import json
import logging
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fxquant.analysis import svg

log = logging.getLogger(__name__)


SLUG_MAX = 80  # characters of a file-name part


def slug(value: object) -> str:
    """A deterministic, safe file-name part of at most ``SLUG_MAX`` characters. A longer one keeps its first
    characters and ends in ``-`` and 10 hex digits of the SHA-256 of ``str(value)``, so values that differ only
    past the cut (a long module name's iteration or seq) keep distinct names."""
    text = str(value)
    s = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")
    if len(s) > SLUG_MAX:
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:10]
        s = f"{s[:SLUG_MAX - 11]}-{digest}"
    return s or "none"


def scheme_label(scheme: object) -> str:
    """A record's scheme as pages print it (``-`` where the records name none)."""
    return "-" if scheme is None else str(scheme)


def clean(obj: object) -> object:
    """JSON-ready copy: numpy scalars to Python, NaN to None, ±Inf to strings, tuple keys joined."""
    if isinstance(obj, dict):
        return {(k if isinstance(k, str) else "/".join(map(str, k)) if isinstance(k, tuple) else str(k)): clean(v)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, np.ndarray):
        return clean(obj.tolist())
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
    return obj


def strict_dumps(obj: object, **kwargs) -> str:
    """``json.dumps`` of ``clean(obj)`` refusing NaN/Inf: strict JSON, as every JSON file the project writes."""
    return json.dumps(clean(obj), allow_nan=False, **kwargs)


def fmt_num(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.4g}"
        return f"{v:.4f}".rstrip("0").rstrip(".") if not v.is_integer() else str(int(v))
    return str(v)


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the report root
    section: str
    title: str
    kind: str  # "figure" | "table" | "data"


class Outputs:
    """The report directory: every file written, with its section and title, in order (``entries``)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.entries: list[Entry] = []

    def listed(self, manifest: str, key: str = "files") -> list[str]:
        """The files a previous report in this directory listed in its JSON ``manifest`` (under ``key``); none
        where there is no such file, and none, with a warning, where it cannot be read as one."""
        path = self.root / manifest
        if not path.is_file():
            return []
        try:
            files = json.loads(path.read_text()).get(key)
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
            log.warning("%s: not a report manifest (%s): the files of the previous report there are left as they are",
                        path, exc)
            return []
        return [f for f in files if isinstance(f, str)] if isinstance(files, list) else []

    def remove_stale(self, previous: Iterable[str], keep: Iterable[str] = ()) -> list[str]:
        """Remove the files of ``previous`` (``listed``) that this report did not write (``entries``, ``keep``),
        and the directories that leaves empty; returns the removed files. A listed path that is absolute, leaves
        the directory, or is no regular file (a symlink, a directory) is left alone."""
        written = {e.path for e in self.entries} | set(keep)
        root = self.root.resolve()
        removed = []
        for rel in dict.fromkeys(previous):
            p = self.root / rel
            if rel in written or Path(rel).is_absolute() or ".." in Path(rel).parts:
                continue
            if p.is_symlink() or not p.is_file() or not p.resolve().is_relative_to(root):
                continue
            p.unlink()
            removed.append(rel)
            for d in p.parents:
                if d.resolve() == root or not d.is_dir() or any(d.iterdir()):
                    break
                d.rmdir()
        if removed:
            log.info("%s: removed %d file(s) of the previous report there that this one does not write",
                     self.root, len(removed))
        return removed

    def _path(self, rel: str) -> Path:
        """Where ``rel`` goes; a second file under one name in one report is a defect (it would replace the first,
        which the index still lists): refused."""
        if any(e.path == rel for e in self.entries):
            raise ValueError(f"report file {rel!r} written twice: the second would replace the first")
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def json(self, rel: str, obj: object, section: str, title: str) -> Path:
        p = self._path(rel)
        p.write_text(json.dumps(clean(obj), indent=1, sort_keys=True, allow_nan=False) + "\n")
        self.entries.append(Entry(rel, section, title, "data"))
        return p

    def text(self, rel: str, text: str, section: str, title: str) -> Path:
        p = self._path(rel)
        p.write_text(text if text.endswith("\n") else text + "\n")
        self.entries.append(Entry(rel, section, title, "table"))
        return p

    def csv(self, rel: str, header: list[str], rows: list[list], section: str, title: str) -> Path:
        p = self._path(rel)
        with open(p, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            for r in rows:
                w.writerow(["" if v is None else clean(v) for v in r])
        self.entries.append(Entry(rel, section, title, "data"))
        return p

    def figure(self, rel: str, fig: svg.Figure, section: str, title: str) -> Path:
        """Write ``fig`` (fxquant.analysis.svg) as SVG at ``rel``: same bytes for the same data."""
        if not rel.endswith(".svg"):
            raise ValueError(f"figure {rel!r}: figures are SVG files (.svg)")
        p = self._path(rel)
        fig.save(p)
        self.entries.append(Entry(rel, section, title, "figure"))
        return p


@dataclass(frozen=True)
class Job:
    """One part of the report: ``func(*args, out=Outputs, **kwargs)`` writes its files and returns its results
    (a module-level function, so that a pool worker can run it)."""

    name: str
    func: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def _run_job(job: Job, root: Path) -> tuple[object, list[Entry]]:
    out = Outputs(root)
    return job.func(*job.args, out=out, **job.kwargs), out.entries


def run_jobs(jobs: list[Job], out: Outputs, pool: cf.ProcessPoolExecutor | None = None) -> list:
    """Run ``jobs`` (in ``pool``'s workers when given, each drawing its own figures), appending their files to
    ``out.entries`` in job order (deterministic index.html); returns their results in job order."""
    if pool is None:
        done = [_run_job(j, out.root) for j in jobs]
    else:
        futures = [pool.submit(_run_job, j, out.root) for j in jobs]
        done = [f.result() for f in futures]
    for _, entries in done:
        out.entries.extend(entries)
    return [r for r, _ in done]


def sort_key(v: object) -> tuple:
    return (v is None, str(type(v)), v if v is not None else 0)
