"""On-disk layout of a capture set, and the only code that writes its files.

    ROOT/
      rank-00000/                     one directory per global rank (several ranks share one ROOT)
        run.json                      run id, scheme, spec text, rank coordinates (written at open)
        shards/shard-000001.safetensors   tensors, keys "t000000042" (never user-supplied names)
        manifest.jsonl                one JSON record per tensor, appended only after its shard is durable
        superseded.jsonl              records a resumed training run moved out of the manifest (iterations it redid)
        COMMITTED                     written at clean close: counts and the stop reason, if any
        LOCK                          flock'ed by the session writing the directory (its pid)
      rank-00001/ ...

Every shard, ``run.json`` and ``COMMITTED`` reaches its final name by rename from a ``.tmp`` file that was
fsync'ed first, and the directory is fsync'ed after the rename; the manifest is appended to in place, each
append fsync'ed (a session appending to an earlier one cuts off a torn last line first, and goes on after every
``seq`` and tensor key already there: ``resume_point``). A manifest line is written (and fsync'ed) only after its
shard is final, so a crashed run's manifest names only complete shards; a torn last line is ignored by the reader.
A crash between a shard's rename and its manifest lines leaves tensors no record names: ``verify`` lists them.
Shards are safetensors files written in a streaming fashion (header, then each tensor's bytes), read
back by the ``safetensors`` library; each tensor carries an XXH3-64 checksum of its stored bytes,
computed while it is written (4 MiB at a time, so the bytes are hashed and written while cached; XXH3 runs
at ~20 GB/s on one core where zlib's CRC-32 managed ~2 GB/s, the difference between the writer keeping up
with the disk or not). Capture sets written with ``crc32:`` checksums still verify.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import re
import zlib
from pathlib import Path

import torch
import xxhash

from fxquant._fileio import fsync_dir, write_atomic

log = logging.getLogger(__name__)

MANIFEST = "manifest.jsonl"
ERRORS = "errors.jsonl"  # one line per capture session that ended on an error (``append_error``)
SUPERSEDED = "superseded.jsonl"  # records of iterations a resumed run redid (``supersede_from``): not read as data
COMMITTED = "COMMITTED"
RUN_INFO = "run.json"
LOCK = "LOCK"  # held (flock) by the session writing the rank directory
SHARDS = "shards"
FORMAT_VERSION = 1

# torch dtype <-> safetensors dtype code
ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def rank_dir(root: Path, rank: int) -> Path:
    return Path(root) / f"rank-{int(rank):05d}"


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.safetensors"


def tensor_key(seq: int) -> str:
    return f"t{seq:09d}"


_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def sanitize(name: object, max_len: int = 120) -> str:
    """A single, safe path component from any string: no separators, no ``..``, bounded length.

    Characters outside ``[A-Za-z0-9._-]`` become ``_``; leading dots are stripped; an over-long name, or
    one left as a bare ``_``, is cut and ends in a short hash of the original. Other altered names may
    coincide (``FA/x`` and ``FA:x`` both give ``FA_x``): callers that need distinct names add their own
    counter (``capture export-pt`` does).
    """
    raw = str(name)
    s = _SAFE.sub("_", raw).lstrip(".")
    s = re.sub(r"\.{2,}", "_", s) or "_"
    if len(s) > max_len or s != raw:
        digest = hashlib.sha1(raw.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        if len(s) > max_len or s == "_":
            s = s[: max_len - 9] + "-" + digest
    return s


CHUNK = 4 << 20  # bytes hashed then written at a time (1 MiB writes measured slower on ext4 here)


def checksum(t: torch.Tensor) -> str:
    """XXH3-64 of the tensor's bytes as stored (contiguous, little-endian)."""
    return f"xxh3_64:{xxhash.xxh3_64_intdigest(tensor_bytes(t)):016x}"


def checksum_matches(t: torch.Tensor, expected: str | None) -> bool:
    """``t``'s bytes match the manifest's checksum (``xxh3_64:`` or, in older capture sets, ``crc32:``)."""
    algo, _, _ = str(expected).partition(":")
    if algo == "crc32":
        return f"crc32:{zlib.crc32(tensor_bytes(t)):08x}" == expected
    return checksum(t) == expected


def tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")



def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]],
                      metadata: dict[str, str]) -> tuple[int, list[str]]:
    """Write ``tensors`` (CPU) to ``path.tmp``, fsync, rename to ``path``; return the bytes written and each
    tensor's checksum (as ``checksum`` computes it), hashed from the same bytes as they are written.

    On any error the temporary file is removed and the error propagates: nothing appears under the
    final name unless it is complete.
    """
    header: dict = {"__metadata__": metadata}
    offset = 0
    for key, t in tensors:
        if t.dtype not in ST_DTYPES:
            raise TypeError(f"cannot store dtype {t.dtype} in safetensors; allowed {list(ST_DTYPES)}")
        n = t.numel() * t.element_size()
        header[key] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * ((-len(hbytes)) % 8)  # align the data section to 8 bytes

    sums: list[str] = []

    def write(f) -> None:
        sums.clear()
        f.write(len(hbytes).to_bytes(8, "little"))
        f.write(hbytes)
        for _, t in tensors:
            data, h = tensor_bytes(t), xxhash.xxh3_64()
            for i in range(0, data.nbytes, CHUNK):
                chunk = data[i: i + CHUNK]
                h.update(chunk)
                f.write(chunk)
            sums.append(f"xxh3_64:{h.intdigest():016x}")

    write_atomic(path, write)
    _drop_cached(path)
    return 8 + len(hbytes) + offset, sums


def _drop_cached(path: Path) -> None:
    """Let the kernel reuse the page cache of a shard that is durable (clean after its fsync): a capture run
    writes many GB that training will not read again, and recycled pages are cheaper to write than new ones."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


def write_json_atomic(path: Path, obj: object) -> None:
    text = json.dumps(obj, indent=1, sort_keys=True, allow_nan=True)
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


class RankDirBusy(RuntimeError):
    """Another process's capture session is writing the rank directory."""


class RankDirLock:
    """The lock ``lock_rank_dir`` took: ``release()`` (or leaving its ``with`` block) gives it back."""

    def __init__(self, f) -> None:
        self._f = f

    def release(self) -> None:
        """Unlock, then close: unlocking first frees the lock even where a forked child (a DataLoader worker)
        still holds a copy of the file descriptor. Idempotent."""
        if self._f is None:
            return
        try:
            fcntl.flock(self._f.fileno(), fcntl.LOCK_UN)
        except OSError:
            pass
        self._f.close()
        self._f = None

    def __enter__(self) -> "RankDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_rank_dir(directory: Path) -> RankDirLock:
    """Take the rank directory's lock for one session (an exclusive ``flock`` on its ``LOCK`` file, held until
    ``release()`` or the process's exit). Two sessions writing one rank directory would pick the same shard
    names and tensor keys (``resume_point`` is read once), each renaming its shards over the other's: the second
    is refused instead. The file holds the owner's pid, for the message. On a filesystem without ``flock``
    (ENOLCK, EOPNOTSUPP: some NFS, Lustre and FUSE mounts) a WARNING says the directory is not locked and the
    session goes on."""
    path = Path(directory) / LOCK
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "unknown"
        f.close()
        raise RankDirBusy(f"{directory} is being written by another capture session (pid {owner}); give each run "
                          "its own capture root, or wait for that one to close") from None
    except OSError as exc:
        f.close()
        log.warning("capture: %s cannot be locked (%s): nothing stops another process writing it at the same time",
                    directory, exc.strerror or exc)
        return RankDirLock(None)
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return RankDirLock(f)


_SHARD_FILE = re.compile(r"^shard-(\d{6,})\.safetensors(?:\.tmp)?$")  # a partial (.tmp) shard's name is taken too
_TENSOR_KEY = re.compile(r"^t(\d{9,})$")


def shard_keys(path: Path) -> list[str]:
    """The tensor keys a safetensors shard holds, read from its header alone (no tensor is read). ValueError when
    the file has no readable header (truncated, not safetensors)."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= size - 8:
            raise ValueError(f"{path}: no safetensors header (truncated or not safetensors)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path}: its safetensors header is not JSON (truncated or corrupt)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: its safetensors header is not a JSON object")
    return [k for k in header if k != "__metadata__"]


class CorruptRecord(dict):
    """A manifest line that parses as a record but fails its ``crc`` (a changed byte): ``manifest_record`` returns
    it (a dict, so that ``resume_point`` still skips its seq and ``supersede_from`` still moves it), the reader skips
    and reports it."""


NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def strict_json(obj: object) -> object:
    """``obj`` with every non-finite float written as the string "inf", "-inf" or "nan" (strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def _record_text(record: dict) -> str:
    return json.dumps(record, separators=(",", ":"), sort_keys=True, allow_nan=False)


def record_line(record: dict) -> str:
    """A record's manifest line: strict JSON (non-finite statistics as strings), with ``crc``, the CRC-32 of the same
    line without it, so that a changed byte in a line that still parses is found."""
    body = strict_json({k: v for k, v in record.items() if k != "crc"})
    return _record_text({**body, "crc": zlib.crc32(_record_text(body).encode())}) + "\n"


def manifest_record(line: bytes) -> dict | None | bool:
    """One manifest line: its record (a JSON object; its ``crc`` checked and removed, the strings "inf", "-inf",
    "nan" of its ``stats`` read back as floats), a ``CorruptRecord`` when the crc does not match (lines written
    without one, by earlier versions, are not checked), False for valid JSON that is not an object (not a record,
    such as a stray line another tool appended), None for a line that is not JSON (torn by a crash mid-append, or
    corrupt)."""
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(value, dict):
        return False
    crc = value.pop("crc", None)
    try:
        intact = crc is None or crc == zlib.crc32(_record_text(value).encode())
    except ValueError:  # a non-finite number in a line with a crc: not written by record_line
        intact = False
    stats = value.get("stats")
    if isinstance(stats, dict):
        value["stats"] = {k: NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in stats.items()}
    return value if intact else CorruptRecord(value)


def resume_point(directory: Path) -> tuple[int, int]:
    """Where a new session in an existing rank directory goes on: (the highest shard index there, partial ``.tmp``
    shards included, and one past the highest ``seq`` its manifest records or tensor key its shards hold), so that
    it reuses neither a shard name nor a tensor key, even where a crash lost manifest lines of tensors that reached
    their shard. A last manifest line without its newline is completed when it parses (the crash came between
    the record and its newline) and cut off when it does not (a crash mid-append): appended lines must start on a
    line of their own. Lines that are JSON but no record are skipped, as the reader skips them."""
    directory = Path(directory)
    shards, top = [], -1
    for f in (directory / SHARDS).glob("shard-*"):
        m = _SHARD_FILE.match(f.name)
        if m is None:
            continue
        shards.append(int(m.group(1)))
        try:
            keys = shard_keys(f)
        except (OSError, ValueError) as exc:
            log.warning("capture: %s: %s; its tensor keys are unknown, so one may be used again", f, exc)
            continue
        top = max([top, *(int(k.group(1)) for k in map(_TENSOR_KEY.match, keys) if k)])
    for record in superseded_records(directory):  # their shards may be gone: neither name nor key is used again
        top = max(top, _int(record.get("seq"), -1))
        m = _SHARD_FILE.match(Path(str(record.get("file"))).name)
        shards.append(int(m.group(1)) if m else 0)
    path = directory / MANIFEST
    if not path.is_file():
        return max(shards, default=0), top + 1
    data = mend_tail(path)
    seq = -1
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        record = manifest_record(line)
        if record is None:
            raise ValueError(f"{path}:{i + 1}: corrupt manifest line (not JSON); a session cannot append to this "
                             "capture set")
        if record is False:
            log.warning("capture: %s:%d: not a manifest record (JSON, but not an object); skipped", path, i + 1)
            continue
        value = record.get("seq")
        seq = max(seq, value) if isinstance(value, int) and not isinstance(value, bool) else seq
    return max(shards, default=0), max(seq, top) + 1


def append_error(directory: Path, entry: dict) -> None:
    """Record that a capture session in the rank directory ended on an error (``ERRORS``, one JSON line each,
    fsync'ed before the session's ``COMMITTED`` marker): it stays there through later sessions appending to the
    directory, crashed ones included, for ``verify`` to report."""
    append_lines(Path(directory) / ERRORS, [entry])


def session_errors(directory: Path) -> list[dict]:
    """The entries ``append_error`` wrote in the rank directory, in order (lines that are no record skipped)."""
    return _json_lines(Path(directory) / ERRORS)


def _json_lines(path: Path) -> list[dict]:
    """The records of an append-only JSON-lines file of the rank directory (torn or non-record lines skipped; []
    for no file)."""
    if not path.is_file():
        return []
    records = (manifest_record(line) for line in path.read_bytes().split(b"\n") if line.strip())
    return [r for r in records if isinstance(r, dict)]


def count_records(path: Path) -> int:
    """The records of a manifest file (lines that parse as records; 0 for no file): what ``COMMITTED`` records as
    ``manifest_records`` at close, for ``verify`` to compare with later."""
    return len(_json_lines(Path(path)))


def mend_tail(path: Path) -> bytes:
    """Make an append-only JSON-lines file (the manifest, ``superseded.jsonl``) end on a line boundary, and return
    its bytes: a last line without its newline is completed when it parses (the crash came between the record and its
    newline: the record is kept) and cut off when it does not (a crash mid-append)."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        if data[cut:].strip() and manifest_record(data[cut:]) is not None:
            log.warning("capture: %s ends in a complete record without its newline (a crash before it was written); "
                        "the newline is added before appending", path)
            with open(path, "ab") as f:
                f.write(b"\n")
                os.fsync(f.fileno())
            data += b"\n"
        else:
            log.warning("capture: %s ends in a torn line (%d bytes, a crash mid-append); cut off before appending",
                        path, len(data) - cut)
            with open(path, "r+b") as f:
                f.truncate(cut)
                os.fsync(f.fileno())
            data = data[:cut]
    return data


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def superseded_records(directory: Path) -> list[dict]:
    """The records ``supersede_from`` moved out of the rank directory's manifest (torn or non-record lines skipped)."""
    return _json_lines(Path(directory) / SUPERSEDED)


def _recount(directory: Path) -> None:
    """Bring the ``manifest_records`` of the rank directory's ``COMMITTED`` marker, if it has one, up to the manifest
    that ``supersede_from`` rewrote (a crash before this leaves a count that ``verify`` reports)."""
    marker = directory / COMMITTED
    try:
        committed = json.loads(marker.read_text())
    except (OSError, ValueError):
        return
    if isinstance(committed, dict) and isinstance(committed.get("manifest_records"), int):
        committed["manifest_records"] = count_records(directory / MANIFEST)
        write_json_atomic(marker, committed)


def supersede_from(directory: Path, iteration: int) -> int:
    """Move the records of iterations ``>= iteration`` out of the rank directory's manifest into ``superseded.jsonl``
    and remove the shards that then hold no record's tensor: a training run resumed from a checkpoint at
    ``iteration`` trains those iterations again and captures them again, as its metrics are cut back to the
    checkpoint. Records without an integer iteration (captured outside the iteration loop) stay. The caller holds
    the directory's lock (``lock_rank_dir``). Returns the number of records moved.

    Crash safety: both files' tails are mended first (``mend_tail``), the moved records are appended to
    ``superseded.jsonl`` (fsync'ed) before the manifest is replaced (atomically), and shards are removed last; a
    crash in between leaves records in both files (the manifest's stay data; moving them again appends them again)
    or a shard that only moved records name, which the next call removes."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        return 0
    kept, moved = [], []
    for line in mend_tail(path).split(b"\n")[:-1]:
        record = manifest_record(line) if line.strip() else False
        if isinstance(record, dict) and _int(record.get("iteration"), -1) >= iteration:
            moved.append(record)
        else:
            kept.append(line)
    if moved:
        if (directory / SUPERSEDED).is_file():
            mend_tail(directory / SUPERSEDED)
        append_lines(directory / SUPERSEDED, moved)
        write_atomic(path, lambda f: f.write(b"".join(line + b"\n" for line in kept)))
        _recount(directory)
    still = set()
    for line in kept:
        record = manifest_record(line) if line.strip() else None
        if isinstance(record, dict) and record.get("file"):
            still.add(str(record["file"]))
    removed = 0
    for name in sorted({str(r["file"]) for r in superseded_records(directory) if r.get("file")} - still):
        shard = directory / name
        if shard.parent == directory / SHARDS and shard.is_file():
            shard.unlink()
            removed += 1
    if removed:
        fsync_dir(directory / SHARDS)
    return len(moved)


def append_lines(path: Path, records: list[dict]) -> None:
    """Append one JSON line per record and fsync (a crash can leave at most one torn last line)."""
    if not records:
        return
    data = "".join(record_line(r) for r in records).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
