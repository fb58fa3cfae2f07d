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

import collections
import json
import logging
import threading
import time
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


def is_capture_set(path: Path) -> bool:
    """Whether ``path`` is a directory holding ``rank-*`` directories: what ``CaptureSet`` opens."""
    path = Path(path)
    return path.is_dir() and any(c.is_dir() and c.name.startswith("rank-") for c in path.iterdir())


def manifest_records(path: Path) -> list[dict]:
    """The records of one rank's manifest file, in file order (a torn last line and lines that are no record
    skipped, as the reader does)."""
    return _read_manifest(Path(path))[0]


def _read_manifest(path: Path) -> tuple[list[dict], list[int], list[str], int]:
    """Records of a manifest, the line numbers of a torn last line (a crash mid-append; skipped), one problem per
    line that is JSON but no record (not an object) or a record failing its crc (both skipped, wherever they are),
    and the number of the latter. A line before the last that is not JSON is corruption: ``CaptureReadError`` naming
    the file and line."""
    records: list[dict] = []
    torn: list[int] = []
    bad: list[str] = []
    corrupt = 0
    if not path.is_file():
        return records, torn, bad, corrupt
    lines = path.read_bytes().split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        record = layout.manifest_record(line)
        if record is None:
            if i == last:  # only the last line may be torn
                torn.append(i + 1)
                continue
            raise CaptureReadError(f"{path}:{i + 1}: corrupt manifest line (not JSON)") from None
        if record is False:
            kind = type(json.loads(line)).__name__
            bad.append(f"{path.parent.name}/{path.name}:{i + 1}: not a manifest record (JSON {kind}, not an object); "
                       "line skipped")
            continue
        if isinstance(record, layout.CorruptRecord):
            bad.append(f"{path.parent.name}/{path.name}:{i + 1}: record seq={record.get('seq')} fails its crc (line "
                       "changed after it was written); line skipped")
            corrupt += 1
            continue
        records.append(record)
    return records, torn, bad, corrupt


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


def _read_rank(d: Path) -> tuple[list[dict], dict, dict, dict | None]:
    """(manifest records, skipped lines: {"torn": line numbers, "bad": problems}, run.json, COMMITTED or None) of
    one rank directory."""
    recs, torn, bad, corrupt = _read_manifest(d / layout.MANIFEST)
    out = []
    for name in (layout.RUN_INFO, layout.COMMITTED):
        path = d / name
        try:
            value = json.loads(path.read_text()) if path.is_file() else None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CaptureReadError(f"{path}: not JSON ({exc})") from None
        if value is not None and not isinstance(value, dict):
            raise CaptureReadError(f"{path}: not a JSON object (a {type(value).__name__})")
        out.append(value)
    return recs, {"torn": torn, "bad": bad, "corrupt": corrupt}, out[0] or {}, out[1]


class _Handles:
    """Open shard handles (``safe_open``, each a memory map), the ``max_open`` most recently used: a set of
    thousands of shards read one after the other keeps a few mapped, not all. Shared by a set and its ``query()``
    results; ``drop`` closes one (its tensors already loaded stay valid)."""

    def __init__(self, max_open: int = 8):
        self.max_open = max_open
        self._open: collections.OrderedDict[Path, object] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: Path, opener) -> object:
        with self._lock:
            h = self._open.get(path)
            if h is not None:
                self._open.move_to_end(path)
                return h
        h = opener(path)
        with self._lock:
            self._open[path] = h
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)
        return h

    def drop(self, path: Path) -> None:
        with self._lock:
            self._open.pop(path, None)

    def clear(self) -> None:
        with self._lock:
            self._open.clear()

    def __len__(self) -> int:
        return len(self._open)


class CaptureSet:
    """Every record of a capture directory (all ranks), filterable; tensors load lazily."""

    def __init__(self, root: str | Path, records: list[Record] | None = None, _meta: dict | None = None,
                 _handles: _Handles | None = None, *, skip_bad_ranks: bool = False):
        """Read every rank's manifest. A rank directory that cannot be read (a corrupt manifest line before its
        last, an unreadable ``run.json``) raises ``CaptureReadError``; with ``skip_bad_ranks`` (the analysis) it
        is left out instead (``unreadable``: rank directory -> why) and listed in ``problems`` and ``verify()``.
        ``problems`` also lists the manifest lines that were skipped (a torn last line, a line that is no record),
        each with its file and line number."""
        self.root = Path(root)
        self._handles = _Handles() if _handles is None else _handles  # shared by query() results
        self.unreadable: dict[str, str] = {}
        self.problems: list[str] = []  # rank directories left out and manifest lines skipped, one line each
        if records is not None:
            self._records, self.meta = records, _meta or {}
            return
        if not self.root.is_dir():
            what = "is a file, not a directory" if self.root.exists() else "does not exist"
            raise CaptureReadError(f"capture directory {self.root} {what}")
        dirs = sorted(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("rank-"))
        if not dirs:
            raise CaptureReadError(f"{self.root} holds no rank-NNNNN directories: not an fxquant capture set")
        self._records, self.meta = [], {}
        for d in dirs:
            try:
                recs, skipped, info, committed = _read_rank(d)
            except CaptureReadError as exc:
                if not skip_bad_ranks:
                    raise
                self.unreadable[d.name] = str(exc)
                continue
            version = info.get("format_version", layout.FORMAT_VERSION)
            if isinstance(version, int) and version > layout.FORMAT_VERSION:
                log.warning("%s was written in capture format %d; this fxquant reads format %d and may misread it",
                            d, version, layout.FORMAT_VERSION)
            seqs = collections.Counter(r.get("seq") for r in recs)
            self.meta[d.name] = {"run": info, "committed": committed, "torn_lines": len(skipped["torn"]),
                                 "torn_at": skipped["torn"], "bad_lines": skipped["bad"],
                                 "records": len(recs) + skipped["corrupt"],
                                 "repeated_seqs": sorted((q, n) for q, n in seqs.items() if n > 1 and q is not None),
                                 "errors": layout.session_errors(d)}
            self._records.extend(Record(r, d) for r in recs)
        self.problems = [f"{name} (all its records): {why}" for name, why in self.unreadable.items()]
        for name, m in self.meta.items():
            self.problems += [*_torn_problems(name, m), *m["bad_lines"]]

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
        """Records whose fields match: ``role="input"``, ``layer=[0, 1]``, ``iteration=lambda i: i < 5``. A value
        matches a stored one that equals it or, for numbers and strings, reads the same (``run_id=4711`` matches a
        run id stored as the string ``"4711"``); a collection matches when any of its values does."""
        def ok(rec: Record) -> bool:
            for key, want in conditions.items():
                if key not in rec.fields:
                    raise ValueError(f"unknown record field {key!r}; fields: {sorted(rec.fields)}")
                have = rec.fields[key]
                if callable(want):
                    if not want(have):
                        return False
                elif isinstance(want, (list, tuple, set, frozenset)):
                    if not any(_same(have, w) for w in want):
                        return False
                elif not _same(have, want):
                    return False
            return True

        out = CaptureSet(self.root, [r for r in self._records if ok(r)], self.meta, self._handles)
        out.unreadable, out.problems = self.unreadable, self.problems
        return out

    def values(self, field_name: str) -> list:
        """Distinct values of one field, sorted where possible."""
        vals = {json.dumps(r.fields.get(field_name), sort_keys=True) for r in self._records}
        return sorted((json.loads(v) for v in vals), key=lambda v: (v is None, str(type(v)), v if v is not None else 0))

    # -- tensors ---------------------------------------------------------------------------------------
    def _handle(self, path: Path):
        return self._handles.get(path, _open_shard)

    def load(self, record: Record, *, check: bool = False) -> torch.Tensor:
        """The stored tensor of ``record`` (memory-mapped read); ``check=True`` verifies its checksum."""
        if not record.has_tensor:
            raise ValueError(f"record seq={record.fields.get('seq')} holds statistics only (what: stats)")
        path = record.path
        try:
            t = self._handle(path).get_tensor(record.key)
        except SafetensorError as exc:
            raise CaptureReadError(f"{path}: cannot read tensor {record.key}: {exc}") from None
        if check:
            problem = _tensor_problem(record, t)
            if problem is not None:
                raise CaptureReadError(f"{path}: tensor {record.key}: {problem}")
        return t

    def tensors(self) -> Iterator[tuple[Record, torch.Tensor]]:
        """Every stored tensor, in record order; a shard's handle is closed once the records after it are elsewhere."""
        current = None
        try:
            for rec in self._records:
                if not rec.has_tensor:
                    continue
                path = rec.path
                if current is not None and path != current:
                    self._handles.drop(current)
                current = path
                yield rec, self.load(rec)
        finally:
            if current is not None:
                self._handles.drop(current)

    def verify(self) -> list[str]:
        """Every problem found: checksums, missing/corrupt/partial/unreferenced shards, tensors of a shard that no
        record names, uncommitted ranks, skipped manifest lines. Each shard's handle is closed after its records."""
        problems: list[str] = [f"{name}: unreadable, its records left out: {why}"
                               for name, why in self.unreadable.items()]
        for name, meta in self.meta.items():
            if meta["committed"] is None:
                problems.append(f"{name}: no {layout.COMMITTED} marker (run crashed or still running); "
                                "only its committed part is readable")
            problems += [*_torn_problems(name, meta), *meta.get("bad_lines", []), *_commit_problems(name, meta)]
            shard_dir = self.root / name / layout.SHARDS
            for tmp in sorted(shard_dir.glob("*.tmp")) if shard_dir.is_dir() else []:
                problems.append(f"{name}/{layout.SHARDS}/{tmp.name}: partial shard (never committed)")
        # keys of records a resumed run moved out of the manifest (``layout.supersede_from``): their tensors may share a
        # shard with current ones and are accounted for
        superseded = {name: {r.get("key") for r in layout.superseded_records(self.root / name)} for name in self.meta}
        by_shard: dict[Path, list[Record]] = {}
        for rec in self._records:
            if not rec.has_tensor:
                continue
            try:
                by_shard.setdefault(rec.path, []).append(rec)  # refused for a file outside its rank directory
            except CaptureReadError as exc:
                problems.append(str(exc))
        for path, recs in by_shard.items():
            try:
                for rec in recs:
                    try:
                        problem = _tensor_problem(rec, self.load(rec))
                        if problem is not None:
                            problems.append(f"{path.relative_to(self.root)}: {rec.key}: {problem}")
                    except CaptureReadError as exc:
                        problems.append(str(exc))
                named = {r.key for r in recs} | superseded.get(path.relative_to(self.root).parts[0], set())
                problems += _unindexed(path, named, self.root)
            finally:
                self._handles.drop(path)
        for name in self.meta:
            shard_dir = self.root / name / layout.SHARDS
            for shard in sorted(shard_dir.glob("*.safetensors")) if shard_dir.is_dir() else []:
                if shard not in by_shard:
                    problems.append(f"{name}/{layout.SHARDS}/{shard.name}: not referenced by the manifest "
                                    "(written just before a crash?)")
        return sorted(set(problems), key=problems.index)


def _commit_problems(name: str, meta: dict) -> list[str]:
    """What a rank's manifest, ``errors.jsonl`` and COMMITTED marker say is missing or wrong: every capture that
    ended on an error (records dropped), a manifest holding another number of records than the marker counted at
    close (lines lost or added since; markers of earlier versions hold no count), a ``seq`` on several records."""
    out = []
    committed = meta.get("committed") or {}
    errors = meta.get("errors") or []
    for e in errors:  # every session of the directory that ended on an error, this one's included
        closed = e.get("closed")
        when = (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(closed)) if isinstance(closed, (int, float))
                else "at an unknown time")
        out.append(f"{name}: the capture of run {e.get('run_id')} that closed {when} ended on an error "
                   f"({e.get('dropped', 0)} queued record(s) not written, nothing captured after it): {e.get('error')}")
    if committed.get("clean") is False and not errors:  # a set written before errors.jsonl
        out.append(f"{name}: its capture session ended on an error ({committed.get('dropped', 0)} queued record(s) "
                   f"not written, nothing captured after it): {committed.get('error') or committed.get('stop_reason')}")
    counted, have = committed.get("manifest_records"), meta.get("records")
    if isinstance(counted, int) and isinstance(have, int) and counted != have:
        out.append(f"{name}/{layout.MANIFEST}: {have} record(s), {counted} when its session committed (lines "
                   f"{'lost' if have < counted else 'added'} since)")
    for seq, n in meta.get("repeated_seqs", []):
        out.append(f"{name}/{layout.MANIFEST}: seq {seq} on {n} records (a duplicated line?)")
    return out


def _tensor_problem(record: Record, t: torch.Tensor) -> str | None:
    """What is wrong with the tensor a shard holds for ``record`` (None: nothing): a dtype or shape other than the
    record's (a changed shard header), or a checksum mismatch (changed bytes)."""
    dtype = str(t.dtype).replace("torch.", "")
    want_dtype, want_shape = record.fields.get("dtype"), record.fields.get("stored_shape")
    if want_dtype is not None and dtype != want_dtype:
        return f"is {dtype}, its record says {want_dtype} (shard header corrupted)"
    if want_shape is not None and list(t.shape) != list(want_shape):
        return f"has shape {list(t.shape)}, its record says {list(want_shape)} (shard header corrupted)"
    if not layout.checksum_matches(t, record.checksum):
        return "checksum mismatch (file corrupted)"
    return None


def _same(have: object, want: object) -> bool:
    """A stored field value matches a wanted one: equal, or (numbers and strings, not booleans) the same text."""
    want = getattr(want, "value", want)  # an enum member: its value
    if have == want:
        return True
    scalar = (str, int, float)
    return (isinstance(have, scalar) and isinstance(want, scalar) and not isinstance(have, bool)
            and not isinstance(want, bool) and str(have) == str(want))


def _torn_problems(name: str, meta: dict) -> list[str]:
    lines = meta.get("torn_at") or []
    if not meta["torn_lines"]:
        return []
    where = f", skipped: {name}/{layout.MANIFEST}:{lines[0]}" if lines else ""
    return [f"{name}: {meta['torn_lines']} torn manifest line(s) (a crash mid-append){where}"]


def _unindexed(path: Path, named: set, root: Path) -> list[str]:
    """The problem, if any, of tensors in shard ``path`` that no record names (their manifest lines were lost)."""
    try:
        keys = layout.shard_keys(path)
    except (OSError, ValueError):
        return []  # the shard itself is reported (missing, truncated, not safetensors) by load
    extra = sorted(k for k in keys if k not in named)
    if not extra:
        return []
    shown = ", ".join(extra[:3]) + (f", ... {extra[-1]}" if len(extra) > 3 else "")
    return [f"{path.relative_to(root)}: {len(extra)} tensor(s) that no record names ({shown}): their manifest lines "
            "were lost (a crash while they were appended?)"]


def _open_shard(path: Path):
    """A ``safe_open`` handle on a shard, after checking it is a safetensors file (never a pickle)."""
    _check_shard(path)
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CaptureReadError(f"{path}: cannot open as safetensors: {exc}") from None


def open_capture(root: str | Path, *, skip_bad_ranks: bool = False) -> CaptureSet:
    """An fxquant capture set, or a directory of the predecessor's ``.pt`` files (pt_reader.PtCaptureSet);
    ``skip_bad_ranks``: see ``CaptureSet``."""
    root = Path(root)
    if root.is_dir() and not any(p.is_dir() and p.name.startswith("rank-") for p in root.iterdir()):
        from fxquant.capture import pt_reader

        if pt_reader.has_pt_files(root):
            return pt_reader.PtCaptureSet(root)
    return CaptureSet(root, skip_bad_ranks=skip_bad_ranks)

