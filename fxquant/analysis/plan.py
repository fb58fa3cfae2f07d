"""Planning an analysis: open capture sets, filter records, refuse what cannot be read, cut the work into tasks.

A *unit* is every record of one site at one moment (rank directory, rank, iteration, micro-batch, module,
role): the high-precision tensors and the quantized copies of them, so a worker can pair them (``sources``:
a site called several times per step has one high-precision record per call). Units are
sorted by shard file and key (sequential reads) and packed into *tasks* of about ``task_bytes`` of
stored tensors; each task goes to one worker. A directory of the predecessor's ``.pt`` files opens through
``fxquant.capture.pt_reader`` like a capture set. Records of a rank directory written by a newer capture
format (``run.json`` ``format_version`` above what this fxquant reads) are skipped, as is a
capture directory the reader refuses (corrupt manifest, not a capture set): each reason goes to
``Plan.problems``, which the caller reports (logged at INFO only, so a CLI prints it once). A directory
named twice (``caps/run`` and ``caps/run/``, or through a link) is read once, under its first spelling.

Selection (``where``) pairs before it filters: units are built from every record, then each keeps the records
that match and, for each matching quantized copy, the high-precision record it was quantized from (``sources``),
so ``where={"gemm": "dgrad"}`` analyses the dgrad operands against their sources; ``Plan.partners`` counts the
records kept only as such a source (``Item.partner``: read for the pairing, left out of the statistics).
"""
from __future__ import annotations

import logging
import math
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from fxquant.capture import layout
from fxquant.capture.reader import CaptureReadError, CaptureSet, open_capture

log = logging.getLogger(__name__)

SUPPORTED_VERSION = layout.FORMAT_VERSION
_ITEMSIZE = {str(d).replace("torch.", ""): torch.empty((), dtype=d).element_size() for d in layout.ST_DTYPES}


@dataclass(frozen=True)
class Item:
    index: int  # position in the plan
    root: str  # capture directory (as opened)
    rank_dir: str
    fields: dict
    nbytes: int
    seed: int
    partner: bool = False  # kept only as the source of a selected quantized copy: read, not summarised itself


@dataclass(frozen=True)
class Task:
    number: int
    units: tuple[tuple[Item, ...], ...]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for u in self.units for i in u)

    @property
    def records(self) -> int:
        return sum(len(u) for u in self.units)


@dataclass
class Plan:
    sets: dict[str, CaptureSet]
    tasks: list[Task]
    problems: list[str]
    records: int
    nbytes: int
    partners: int = 0  # records kept only as the source of a selected quantized copy (they do not match ``where``)


def stored_bytes(fields: dict) -> int:
    if fields.get("key") is None:
        return 0
    shape = fields.get("stored_shape") or fields.get("shape") or []
    return math.prod(shape) * _ITEMSIZE.get(str(fields.get("dtype")), 4)


def _version_of(meta: dict, fields: dict) -> int:
    v = fields.get("format_version", fields.get("schema_version"))
    if v is None:
        v = (meta.get("run") or {}).get("format_version", SUPPORTED_VERSION)
    try:
        return int(v)
    except (TypeError, ValueError):
        return SUPPORTED_VERSION + 1  # unreadable version: treat as unknown (newer)


def open_sets(dirs: list[str | Path], problems: list[str]) -> dict[str, CaptureSet]:
    out: dict[str, CaptureSet] = {}
    seen: dict[Path, str] = {}  # resolved path -> the spelling it is opened under
    for d in dirs:
        key = str(d)
        real = Path(d).resolve()
        if real in seen:
            if key != seen[real]:
                log.info("%s: the same directory as %s, read once", key, seen[real])
            continue
        seen[real] = key
        try:
            out[key] = open_capture(d, skip_bad_ranks=True)  # one unreadable rank: the others still count
        except (CaptureReadError, OSError, ValueError) as exc:
            msg = f"{d}: skipped, cannot be read as a capture set: {exc}"
            log.info(msg)  # in problems: the caller reports it (the CLIs print each once)
            problems.append(msg)
    return out


def sources(unit: tuple[Item, ...]) -> dict[int, Item | None]:
    """The high-precision source of each quantized record of ``unit`` (plan index -> Item, None without one).

    One capture call writes a tensor's high-precision record and its quantized copies with consecutive
    ``seq``, each (copy, GEMM, section) once; a site called several times in one step (shared weights,
    recompute, ``capture.save`` under one name) repeats the pattern. Walking the unit in ``seq`` order, a
    record whose (copy, GEMM, section) the current call already has opens the next call; each quantized
    record is paired with the high-precision record of its own call."""
    def seq(item: Item) -> int:
        v = item.fields.get("seq")
        return v if isinstance(v, int) else -1

    calls: list[list[Item]] = []
    seen: set[tuple] = set()
    for item in sorted(unit, key=seq):
        f = item.fields
        key = (f.get("copy", "hp"), f.get("gemm"), f.get("section"))
        if not calls or key in seen:
            calls.append([])
            seen = set()
        calls[-1].append(item)
        seen.add(key)
    out: dict[int, Item | None] = {}
    for call in calls:
        hp = [i for i in call if i.fields.get("copy", "hp") != "quantized"]
        stored = [i for i in hp if i.fields.get("key") is not None]
        for item in call:
            if item.fields.get("copy", "hp") == "quantized":
                out[item.index] = (stored or hp or [None])[0]
    return out


def _select(unit: list[tuple[tuple, dict, str, str, bool]]) -> list[tuple[tuple, dict, str, str, bool]]:
    """The entries of one unit (sorted, each ending in whether it matched ``where``) that the plan keeps: the
    matching ones and the high-precision source of each matching quantized copy."""
    if all(e[4] for e in unit):
        return unit
    matches = [i for i, e in enumerate(unit) if e[4]]
    if not matches:
        return []
    keep = set(matches)
    probe = tuple(Item(i, e[2], e[3], e[1], 0, 0) for i, e in enumerate(unit))
    for i, src in sources(probe).items():
        if i in keep and src is not None:
            keep.add(src.index)
    return [e for i, e in enumerate(unit) if i in keep]


def build(dirs: list[str | Path], where: dict | None = None, workers: int = 1,
          task_bytes: int = 64 << 20, max_task_records: int = 512) -> Plan:
    """Open ``dirs``, keep records matching ``where`` (CaptureSet.query conditions) with the high-precision
    sources of the matching quantized copies (module docstring), and plan the tasks."""
    problems: list[str] = []
    sets = open_sets(dirs, problems)
    units: dict[tuple, list[tuple[tuple, dict, str, str, bool]]] = defaultdict(list)
    skipped_dirs: set[tuple[str, str]] = set()
    for root, cs in sets.items():
        matched = {id(rec) for rec in cs.query(**where)} if where else None  # query checks the field names
        for rec in cs:
            f = rec.fields
            rdir = str(rec.rank_dir)
            meta = cs.meta.get(Path(rdir).name, {})
            if _version_of(meta, f) > SUPPORTED_VERSION:
                if (root, rdir) not in skipped_dirs and (matched is None or id(rec) in matched):
                    skipped_dirs.add((root, rdir))
                    msg = (f"{rdir}: written by a newer capture format (version {_version_of(meta, f)}, this fxquant "
                           f"reads up to {SUPPORTED_VERSION}); its records are skipped")
                    log.info(msg)  # in problems, as above
                    problems.append(msg)
                continue
            # rank: a .pt directory holds every rank's files in one directory
            site = (root, rdir, f.get("rank"), f.get("iteration"), f.get("micro_batch"), f.get("module"), f.get("role"))
            seq = f.get("seq")
            order = (str(f.get("file") or ""), str(f.get("key") or ""), seq if isinstance(seq, int) else -1)
            units[site].append((order, f, root, rdir, matched is None or id(rec) in matched))
    for root, cs in sets.items():  # unreadable rank directories, torn lines; .pt files refused (pt_reader)
        problems.extend(f"{root}: skipped: {p}" for p in getattr(cs, "problems", ()))
    selected = [u for u in (_select(sorted(u, key=lambda x: x[0])) for u in units.values()) if u]
    ordered = sorted(selected, key=lambda u: (u[0][2], u[0][3], min(x[0] for x in u)))  # (root, rdir, order)
    items_units: list[tuple[Item, ...]] = []
    index = partners = 0
    for u in ordered:
        row = []
        for _, f, root, rdir, match in u:
            seed = zlib.crc32(f"{f.get('run_id')}:{f.get('rank')}:{f.get('seq')}".encode())
            row.append(Item(index, root, rdir, f, stored_bytes(f), seed, partner=not match))
            index += 1
            partners += not match
        items_units.append(tuple(row))
    if partners:
        log.info("%d high-precision record(s) kept as the source of a selected quantized copy", partners)
    total = sum(i.nbytes for u in items_units for i in u)
    if workers > 1 and items_units:  # enough tasks to keep every worker busy
        task_bytes = max(1, min(task_bytes, total // (4 * workers) or 1))
        max_task_records = max(1, min(max_task_records, -(-index // (2 * workers))))
    tasks: list[Task] = []
    cur: list[tuple[Item, ...]] = []
    cur_bytes = cur_n = 0
    for u in items_units:
        ub = sum(i.nbytes for i in u)
        if cur and (cur_bytes + ub > task_bytes or cur_n + len(u) > max_task_records):
            tasks.append(Task(len(tasks), tuple(cur)))
            cur, cur_bytes, cur_n = [], 0, 0
        cur.append(u)
        cur_bytes += ub
        cur_n += len(u)
    if cur:
        tasks.append(Task(len(tasks), tuple(cur)))
    return Plan(sets, tasks, problems, index, total, partners)
