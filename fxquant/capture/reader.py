"""Reading a capture set: ``fxquant.capture.open(dir)`` (issue 4, deliverable 5).

``CaptureSet`` holds every manifest record of every rank directory (a committed run, or the committed
part of a crashed one). ``query(**fields)`` filters by any record field (a value, a collection of
values, or a predicate); iteration yields ``Record``s; ``load(record)`` reads one tensor lazily through
``safetensors.safe_open`` (memory-mapped). ``verify()`` re-reads every tensor and checks its checksum,
and lists missing, partial (``.tmp``) and unreferenced shards.

Only safetensors shards and JSON are ever read: a shard that is not a valid safetensors file (a pickle,
a truncated file) raises ``CaptureReadError``; nothing is unpickled, ever.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from fxquant.capture import layout

log = logging.getLogger(__name__)

_PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")  # pickle protocol 2+, zip (torch.save)


class CaptureReadError(ValueError):
    """A capture set or one of its shards is missing, corrupt, or not what fxquant writes."""


@dataclass(frozen=True)
class Record:
    """One manifest record; ``fields`` holds everything, the common ones are attributes too."""

    fields: dict
    rank_dir: Path

    def __getattr__(self, name: str):
        try:
            return self.__dict__["fields"][name]
        except KeyError:
            raise AttributeError(f"record has no field {name!r}; fields: {sorted(self.__dict__['fields'])}") from None

    def __getitem__(self, name: str):
        return self.fields[name]

    @property
    def has_tensor(self) -> bool:
        return self.fields.get("key") is not None

    @property
    def path(self) -> Path | None:
        """The shard holding this record's tensor; a ``file`` that escapes the rank directory is refused."""
        name = self.fields.get("file")
        if name is None:
            return None
        path = self.rank_dir / name
        if not path.resolve().is_relative_to(self.rank_dir.resolve()):
            raise CaptureReadError(
                f"record seq={self.fields.get('seq')}: file {name!r} lies outside its rank directory {self.rank_dir}; refused"
            )
        return path


def _read_manifest(path: Path) -> tuple[list[dict], int]:
    """Records of a manifest; a torn last line (a crash mid-append) is skipped and counted."""
    records, torn = [], 0
    if not path.is_file():
        return records, torn
    lines = path.read_bytes().split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i >= len(lines) - 2:  # only the last line may be torn
                torn += 1
                continue
            raise CaptureReadError(f"{path}:{i + 1}: corrupt manifest line (not JSON)") from None
    return records, torn


def _check_shard(path: Path) -> None:
    """Refuse anything that is not a safetensors file before the library sees it."""
    if not path.is_file():
        raise CaptureReadError(f"shard {path} is missing")
    with open(path, "rb") as f:
        head = f.read(9)
    # safetensors: an 8-byte little-endian header length, then a JSON header opening with '{'. Checked first:
    # a valid header length may itself begin with the byte 0x80 (the pickle protocol marker).
    header_len = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
    if len(head) == 9 and head[8:9] == b"{" and 0 < header_len <= path.stat().st_size - 8:
        return
    if any(head.startswith(m) for m in _PICKLE_MAGIC):
        raise CaptureReadError(f"{path} is a pickle/torch.save file, not safetensors; fxquant never loads pickles")
    raise CaptureReadError(f"{path} is not a valid safetensors file (truncated or corrupt header)")


def _read_rank(d: Path) -> tuple[list[dict], int, dict, dict | None]:
    """(manifest records, torn lines, run.json, COMMITTED or None) of one rank directory."""
    recs, torn = _read_manifest(d / layout.MANIFEST)
    out = []
    for name in (layout.RUN_INFO, layout.COMMITTED):
        path = d / name
        try:
            out.append(json.loads(path.read_text()) if path.is_file() else None)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CaptureReadError(f"{path}: not JSON ({exc})") from None
    return recs, torn, out[0] or {}, out[1]


class CaptureSet:
    """Every record of a capture directory (all ranks), filterable; tensors load lazily."""

    def __init__(self, root: str | Path, records: list[Record] | None = None, _meta: dict | None = None,
                 _handles: dict | None = None, *, skip_bad_ranks: bool = False):
        """Read every rank's manifest. A rank directory that cannot be read (a corrupt manifest line before its
        last, an unreadable ``run.json``) raises ``CaptureReadError``; with ``skip_bad_ranks`` (the analysis) it
        is left out instead (``unreadable``: rank directory -> why) and listed in ``problems`` and ``verify()``.
        ``problems`` also lists torn last lines that were skipped."""
        self.root = Path(root)
        self._handles: dict[Path, object] = {} if _handles is None else _handles  # shared by query() results
        self.unreadable: dict[str, str] = {}
        self.problems: list[str] = []  # rank directories left out and torn lines skipped, one line each
        if records is not None:
            self._records, self.meta = records, _meta or {}
            return
        if not self.root.is_dir():
            raise CaptureReadError(f"capture directory {self.root} does not exist")
        dirs = sorted(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("rank-"))
        if not dirs:
            raise CaptureReadError(f"{self.root} holds no rank-NNNNN directories: not an fxquant capture set")
        self._records, self.meta = [], {}
        for d in dirs:
            try:
                recs, torn, info, committed = _read_rank(d)
            except CaptureReadError as exc:
                if not skip_bad_ranks:
                    raise
                self.unreadable[d.name] = str(exc)
                continue
            version = info.get("format_version", layout.FORMAT_VERSION)
            if isinstance(version, int) and version > layout.FORMAT_VERSION:
                log.warning("%s was written in capture format %d; this fxquant reads format %d and may misread it",
                            d, version, layout.FORMAT_VERSION)
            self.meta[d.name] = {"run": info, "committed": committed, "torn_lines": torn}
            self._records.extend(Record(r, d) for r in recs)
        self.problems = [f"{name} (all its records): {why}" for name, why in self.unreadable.items()] + [
            f"{name}: {m['torn_lines']} torn manifest line(s) (a crash mid-append)"
            for name, m in self.meta.items() if m["torn_lines"]]

    def close(self) -> None:
        """Drop the open shard handles (their memory maps)."""
        self._handles.clear()

    def __enter__(self) -> "CaptureSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- records -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self._records)

    def __getitem__(self, i: int) -> Record:
        return self._records[i]

    @property
    def committed(self) -> bool:
        """Every rank closed cleanly (its COMMITTED marker exists)."""
        return all(m["committed"] is not None for m in self.meta.values())

    def query(self, **conditions) -> "CaptureSet":
        """Records whose fields match: ``role="input"``, ``layer=[0, 1]``, ``iteration=lambda i: i < 5``."""
        def ok(rec: Record) -> bool:
            for key, want in conditions.items():
                if key not in rec.fields:
                    raise ValueError(f"unknown record field {key!r}; fields: {sorted(rec.fields)}")
                have = rec.fields[key]
                if callable(want):
                    if not want(have):
                        return False
                elif isinstance(want, (list, tuple, set, frozenset)):
                    if have not in want:
                        return False
                elif have != getattr(want, "value", want):
                    return False
            return True

        out = CaptureSet(self.root, [r for r in self._records if ok(r)], self.meta, self._handles)
        out._handles = self._handles
        out.unreadable, out.problems = self.unreadable, self.problems
        return out

    def values(self, field_name: str) -> list:
        """Distinct values of one field, sorted where possible."""
        vals = {json.dumps(r.fields.get(field_name), sort_keys=True) for r in self._records}
        return sorted((json.loads(v) for v in vals), key=lambda v: (v is None, str(type(v)), v if v is not None else 0))

    # -- tensors ---------------------------------------------------------------------------------------
    def _handle(self, path: Path):
        h = self._handles.get(path)
        if h is None:
            _check_shard(path)
            try:
                h = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as exc:
                raise CaptureReadError(f"{path}: cannot open as safetensors: {exc}") from None
            self._handles[path] = h
        return h

    def load(self, record: Record, *, check: bool = False) -> torch.Tensor:
        """The stored tensor of ``record`` (memory-mapped read); ``check=True`` verifies its checksum."""
        if not record.has_tensor:
            raise ValueError(f"record seq={record.fields.get('seq')} holds statistics only (what: stats)")
        path = record.path
        try:
            t = self._handle(path).get_tensor(record.key)
        except SafetensorError as exc:
            raise CaptureReadError(f"{path}: cannot read tensor {record.key}: {exc}") from None
        if check and not layout.checksum_matches(t, record.checksum):
            raise CaptureReadError(f"{path}: tensor {record.key} fails its checksum (file corrupted)")
        return t

    def tensors(self) -> Iterator[tuple[Record, torch.Tensor]]:
        for rec in self._records:
            if rec.has_tensor:
                yield rec, self.load(rec)

    def verify(self) -> list[str]:
        """Every problem found: checksums, missing/corrupt/partial/unreferenced shards, uncommitted ranks."""
        problems: list[str] = [f"{name}: unreadable, its records left out: {why}"
                               for name, why in self.unreadable.items()]
        referenced: set[Path] = set()
        for name, meta in self.meta.items():
            if meta["committed"] is None:
                problems.append(f"{name}: no {layout.COMMITTED} marker (run crashed or still running); "
                                "only its committed part is readable")
            if meta["torn_lines"]:
                problems.append(f"{name}: {meta['torn_lines']} torn manifest line(s) skipped")
            shard_dir = self.root / name / layout.SHARDS
            for tmp in sorted(shard_dir.glob("*.tmp")) if shard_dir.is_dir() else []:
                problems.append(f"{name}/{layout.SHARDS}/{tmp.name}: partial shard (never committed)")
        for rec in self._records:
            if not rec.has_tensor:
                continue
            try:
                referenced.add(rec.path)  # refused (CaptureReadError) for a file outside its rank directory
                t = self.load(rec)
                if not layout.checksum_matches(t, rec.checksum):
                    problems.append(f"{rec.path.relative_to(self.root)}: {rec.key}: checksum mismatch")
            except CaptureReadError as exc:
                problems.append(str(exc))
        for name in self.meta:
            shard_dir = self.root / name / layout.SHARDS
            for shard in sorted(shard_dir.glob("*.safetensors")) if shard_dir.is_dir() else []:
                if shard not in referenced:
                    problems.append(f"{name}/{layout.SHARDS}/{shard.name}: not referenced by the manifest "
                                    "(written just before a crash?)")
        return sorted(set(problems), key=problems.index)


def open_capture(root: str | Path, *, skip_bad_ranks: bool = False) -> CaptureSet:
    """An fxquant capture set, or a directory of the predecessor's ``.pt`` files (pt_reader.PtCaptureSet);
    ``skip_bad_ranks``: see ``CaptureSet``."""
    root = Path(root)
    if root.is_dir() and not any(p.is_dir() and p.name.startswith("rank-") for p in root.iterdir()):
        from fxquant.capture import pt_reader

        if pt_reader.has_pt_files(root):
            return pt_reader.PtCaptureSet(root)
    return CaptureSet(root, skip_bad_ranks=skip_bad_ranks)

