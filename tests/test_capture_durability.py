"""The durability order fxquant/capture/layout.py promises, observed through os.fsync and os.replace: every shard,
run.json and COMMITTED is fsync'ed whole under its .tmp name before the rename and its directory is fsync'ed after
it; a manifest line is appended only after its shard is final, and fsync'ed after that."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fxquant import capture
from fxquant.capture import layout

from tests.capture_helpers import emit, spec_text

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(),
                                reason="names the file behind each fsync'ed descriptor through /proc/self/fd (Linux)")


def _record_fsyncs_and_renames(monkeypatch, manifest: Path) -> list[tuple]:
    """Wrap os.fsync and os.replace: each call is logged, in order, as ("fsync", path, bytes in the file) or
    ("replace", src, dst), with the manifest's size at that moment; then the real call runs."""
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def manifest_size() -> int:
        return manifest.stat().st_size if manifest.exists() else 0

    def fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        events.append(("fsync", path, os.fstat(fd).st_size, manifest_size()))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", Path(src).resolve(), Path(dst).resolve(), manifest_size()))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def _index(events: list[tuple], start: int, match, what: str) -> int:
    """The position of the first event at or after ``start`` that ``match`` accepts; fails naming ``what`` when none
    does."""
    for i in range(start, len(events)):
        if match(events[i]):
            return i
    pytest.fail(f"{what}: no such call after call #{start} of {[e[:2] for e in events]}")


def test_each_file_is_fsynced_whole_before_its_rename_and_its_directory_after(tmp_path, monkeypatch):
    """Shards, run.json and COMMITTED: the .tmp file is fsync'ed holding all its bytes (flushed first) before
    os.replace gives it its name, and its directory is fsync'ed after the rename."""
    rank = (tmp_path / "rank-00000").resolve()
    events = _record_fsyncs_and_renames(monkeypatch, rank / layout.MANIFEST)
    with capture.start(spec_text(), tmp_path, shard_bytes=1):  # one shard per capture
        emit(3)
    renames = [(i, e) for i, e in enumerate(events) if e[0] == "replace"]
    finals = sorted(e[2].relative_to(rank).as_posix() for _, e in renames)
    shards = [f"{layout.SHARDS}/{layout.shard_name(k)}" for k in (1, 2, 3)]
    assert finals == [layout.COMMITTED, layout.RUN_INFO, *shards]
    for i, (_, src, dst, _) in renames:
        assert src == dst.with_name(dst.name + ".tmp")
        synced = [j for j, e in enumerate(events[:i]) if e[0] == "fsync" and e[1] == src]
        assert synced, f"{dst.name}: renamed without an fsync of {src.name}"
        assert events[synced[-1]][2] == dst.stat().st_size, f"{dst.name}: fsync'ed before all its bytes were written"
        _index(events, i + 1, lambda e: e[0] == "fsync" and e[1] == dst.parent, f"fsync of the directory of {dst.name}")


def test_a_manifest_line_is_appended_after_its_shard_is_final_and_fsynced_after_that(tmp_path, monkeypatch):
    """For every shard: rename, then the fsync of shards/, then the manifest fsync'ed holding the lines that name it;
    none of those lines was in the manifest when the shard got its name."""
    rank = (tmp_path / "rank-00000").resolve()
    manifest = rank / layout.MANIFEST
    events = _record_fsyncs_and_renames(monkeypatch, manifest)
    with capture.start(spec_text(), tmp_path, shard_bytes=1):
        emit(3)
    ends, offset = {}, 0
    for line in manifest.read_bytes().splitlines(keepends=True):
        start, offset = offset, offset + len(line)
        name = json.loads(line)["file"]
        ends[name] = (min(ends.get(name, (start, 0))[0], start), offset)  # (first line's start, last line's end)
    assert len(ends) == 3
    for name, (first, last) in ends.items():
        shard = rank / name
        i = _index(events, 0, lambda e: e[0] == "replace" and e[2] == shard, f"rename to {name}")
        assert events[i][3] <= first, f"{name}: its manifest line was written before the shard was renamed"
        d = _index(events, i + 1, lambda e: e[0] == "fsync" and e[1] == shard.parent, f"fsync of shards/ after {name}")
        assert events[d][3] <= first, f"{name}: its manifest line was written before its directory was fsync'ed"
        _index(events, d + 1, lambda e: e[0] == "fsync" and e[1] == manifest and e[2] >= last,
               f"fsync of {layout.MANIFEST} holding the lines of {name}")
