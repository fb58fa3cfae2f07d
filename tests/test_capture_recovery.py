"""Capture sets after a crash or a signal: what a second session on the same root keeps and where it goes on, what
``verify`` reports, manifest lines that are no records, and SIGTERM closing the session."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fxquant import capture
from fxquant.capture import layout
from fxquant.cli import main
from tests.capture_helpers import emit, spec_text, tap

REPO = Path(__file__).resolve().parents[1]


def _manifest(root: Path) -> Path:
    return root / "rank-00000" / layout.MANIFEST


def test_a_session_after_lost_manifest_lines_reuses_no_tensor_key_and_verify_names_the_unindexed(tmp_path):
    """A crash mid-append can lose the manifest lines of tensors that reached their shard: the next session goes on
    after the highest key in the shards (not the manifest's highest seq), and verify lists those tensors."""
    with capture.start(spec_text(), tmp_path, run_id="first"):
        emit(6)  # one shard, 6 records appended in one write
    manifest = _manifest(tmp_path)
    data = manifest.read_bytes()
    cut = [i for i, b in enumerate(data) if b == 10][1] + 1
    manifest.write_bytes(data[:cut + 40])  # lines 1-2 reached the disk, line 3 is torn, 4-6 are lost
    problems = capture.open(tmp_path).verify()
    assert any("shard-000001.safetensors: 4 tensor(s) that no record names" in p and "t000000002" in p
               and "t000000005" in p for p in problems), problems
    assert any("torn manifest line(s)" in p and "manifest.jsonl:3" in p for p in problems), problems
    assert main(["capture", "verify", str(tmp_path)]) == 1
    with capture.start(spec_text(), tmp_path, run_id="second"):
        second = emit(2, seed=1)
    cs = capture.open(tmp_path)
    new = cs.query(run_id="second")
    assert [r.seq for r in new] == [6, 7] and [r.key for r in new] == ["t000000006", "t000000007"]
    with safe_open(str(tmp_path / "rank-00000/shards/shard-000001.safetensors"), "pt") as f:
        old_keys = set(f.keys())
    assert old_keys.isdisjoint(r.key for r in new)
    for rec, want in zip(new, second):
        assert torch.equal(cs.load(rec, check=True), want)
    still = cs.verify()  # the lost lines stay lost: the first shard's 4 tensors are still named by no record
    assert len(still) == 1 and "4 tensor(s) that no record names" in still[0]


def test_superseding_iterations_moves_their_records_removes_their_own_shards_and_reuses_no_name(tmp_path):
    """A resumed training run redoes the iterations after its checkpoint (``layout.supersede_from``): their records
    move to superseded.jsonl, a shard holding only theirs goes, one shared with kept records stays (verify counts
    the moved tensors in it as accounted for), and the next session reuses neither a shard name nor a tensor key."""
    for i in range(2):  # two sessions, two shards: iterations 0-3 in shard 1, 4-5 in shard 2
        with capture.start(spec_text(), tmp_path, run_id=f"s{i}"):
            s = capture.active_session()
            for it in (range(4) if i == 0 else range(4, 6)):
                s.set_iteration(it)
                torch.ops.fxquant.capture(torch.full((4, 8), float(it)), tap())
    rank = tmp_path / "rank-00000"
    shards = sorted((rank / layout.SHARDS).glob("*.safetensors"))
    assert [p.name for p in shards] == ["shard-000001.safetensors", "shard-000002.safetensors"]
    with layout.lock_rank_dir(rank):
        assert layout.supersede_from(rank, 3) == 3
        assert layout.supersede_from(rank, 3) == 0  # nothing left to move
    moved = layout.superseded_records(rank)
    assert [r["iteration"] for r in moved] == [3, 4, 5] and [r["key"] for r in moved] == [
        "t000000003", "t000000004", "t000000005"]
    assert shards[0].exists() and not shards[1].exists()  # shard 2 held iterations 4 and 5 alone
    cs = capture.open(tmp_path)
    assert sorted(cs.values("iteration")) == [0, 1, 2] and cs.verify() == []
    assert main(["capture", "verify", str(tmp_path)]) == 0
    with capture.start(spec_text(), tmp_path, run_id="resumed"):
        s = capture.active_session()
        s.set_iteration(3)
        torch.ops.fxquant.capture(torch.full((4, 8), 30.0), tap())
    cs = capture.open(tmp_path)
    (new,) = cs.query(run_id="resumed")
    assert new.iteration == 3 and new.seq == 6 and new.key == "t000000006"
    assert new.file == "shards/shard-000003.safetensors"  # not shard 2's name again
    assert torch.equal(cs.load(new, check=True), torch.full((4, 8), 30.0)) and cs.verify() == []


def _two_sessions(root: Path, first: range, second: range) -> Path:
    """Two sessions on ``root``, one record per iteration: shard 1 holds ``first``'s, shard 2 ``second``'s."""
    for i, its in enumerate((first, second)):
        with capture.start(spec_text(), root, run_id=f"s{i}"):
            s = capture.active_session()
            for it in its:
                s.set_iteration(it)
                torch.ops.fxquant.capture(torch.full((4, 8), float(it)), tap())
    return root / "rank-00000"


def test_superseding_after_crashes_mends_both_files_and_removes_what_a_crash_left(tmp_path, monkeypatch):
    """A crash can leave the manifest's last record without its newline (kept data: it is moved like the others,
    and its shard goes only with it), superseded.jsonl with a torn last line (cut before appending: the next moved
    record is not glued to it), and a moved records' shard not yet removed (the next call removes it)."""
    rank = _two_sessions(tmp_path / "a", range(3), range(3, 5))
    manifest = rank / layout.MANIFEST
    manifest.write_bytes(manifest.read_bytes().rstrip(b"\n"))  # iteration 4's record lost its newline
    with layout.lock_rank_dir(rank):
        assert layout.supersede_from(rank, 4) == 1
    assert [r["iteration"] for r in layout.superseded_records(rank)] == [4]
    cs = capture.open(tmp_path / "a")
    assert sorted(cs.values("iteration")) == [0, 1, 2, 3] and cs.verify() == []  # shard 2 still holds iteration 3

    rank = _two_sessions(tmp_path / "b", range(3), range(3, 6))
    (rank / layout.SUPERSEDED).write_bytes(b'{"iteration": 9, "se')  # torn by a crash mid-append
    with layout.lock_rank_dir(rank):
        assert layout.supersede_from(rank, 3) == 3
    assert [r["iteration"] for r in layout.superseded_records(rank)] == [3, 4, 5]
    assert capture.open(tmp_path / "b").verify() == []

    rank = _two_sessions(tmp_path / "c", range(3), range(3, 5))

    def crash(self, *args, **kwargs):
        raise KeyboardInterrupt("a crash before the shard is removed")

    with monkeypatch.context() as m, layout.lock_rank_dir(rank):
        m.setattr(Path, "unlink", crash)
        with pytest.raises(KeyboardInterrupt):
            layout.supersede_from(rank, 3)
    assert (rank / layout.SHARDS / "shard-000002.safetensors").exists()
    with layout.lock_rank_dir(rank):
        assert layout.supersede_from(rank, 3) == 0  # nothing left to move; the shard only moved records name goes
    assert not (rank / layout.SHARDS / "shard-000002.safetensors").exists()
    assert capture.open(tmp_path / "c").verify() == []


def test_a_complete_last_record_without_its_newline_is_kept(tmp_path):
    """A crash between a record's bytes and its newline leaves a complete record: the next session adds the newline
    and keeps it (only a line that does not parse is cut off)."""
    with capture.start(spec_text(), tmp_path, run_id="first"):
        first = emit(3)
    manifest = _manifest(tmp_path)
    manifest.write_bytes(manifest.read_bytes()[:-1])
    assert len(capture.open(tmp_path)) == 3
    with capture.start(spec_text(), tmp_path, run_id="second"):
        second = emit(1, seed=1)
    cs = capture.open(tmp_path)
    assert [(r.run_id, r.seq, r.key) for r in cs] == [
        ("first", 0, "t000000000"), ("first", 1, "t000000001"), ("first", 2, "t000000002"),
        ("second", 3, "t000000003")]
    assert cs.verify() == [] and manifest.read_bytes().count(b"\n") == 4
    for rec, want in zip(cs, first + second):
        assert torch.equal(cs.load(rec, check=True), want)


def test_a_partial_shard_keeps_its_name_and_keys(tmp_path):
    """A shard the crash left as ``.tmp`` (its header written, its records never appended): the next session names
    its shards and keys after it, so the partial file is neither overwritten nor its keys reused."""
    with capture.start(spec_text(), tmp_path, run_id="first"):
        emit(1)
    shards = tmp_path / "rank-00000" / layout.SHARDS
    partial = shards / "shard-000002.safetensors.tmp"
    layout.write_safetensors(shards / "x.safetensors", [("t000000007", torch.ones(3))], {})
    (shards / "x.safetensors").rename(partial)
    with capture.start(spec_text(), tmp_path, run_id="second"):
        emit(1)
    (rec,) = capture.open(tmp_path).query(run_id="second")
    assert rec.file.endswith("shard-000003.safetensors") and rec.key == "t000000008" and partial.is_file()


def test_a_manifest_line_that_is_json_but_no_record_is_named_and_skipped(tmp_path, capsys):
    with capture.start(spec_text(), tmp_path):
        emit(3)
    manifest = _manifest(tmp_path)
    lines = manifest.read_bytes().split(b"\n")
    manifest.write_bytes(b"\n".join([lines[0], lines[1], b"[1, 2]", *lines[2:]]))
    cs = capture.open(tmp_path)
    assert len(cs) == 3 and cs.problems == [
        "rank-00000/manifest.jsonl:3: not a manifest record (JSON list, not an object); line skipped"]
    assert any("manifest.jsonl:3: not a manifest record" in p for p in cs.verify())
    assert main(["capture", "ls", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "3 records" in captured.out and "manifest.jsonl:3: not a manifest record" in captured.err
    assert main(["capture", "verify", str(tmp_path)]) == 1
    assert "manifest.jsonl:3: not a manifest record" in capsys.readouterr().err
    with capture.start(spec_text(), tmp_path, run_id="second"):  # a session appends after it
        emit(1)
    assert [r.seq for r in capture.open(tmp_path)] == [0, 1, 2, 3]
    (tmp_path / "rank-00000" / layout.RUN_INFO).write_text("[]")
    assert main(["capture", "verify", str(tmp_path)]) == 1
    assert "run.json: not a JSON object" in capsys.readouterr().err


_SIGTERM_CHILD = textwrap.dedent("""
    import time
    from fxquant import capture
    from tests.capture_helpers import emit, spec_text
    capture.start(spec_text(), {root!r}, flush_seconds=3600)  # never closed by the script: atexit's job
    emit(20)
    print("captured", flush=True)
    time.sleep(120)
""")


def test_sigterm_closes_the_session_with_everything_captured(tmp_path):
    """SIGTERM (a scheduler's preemption or time limit) to a process whose SIGTERM has no handler: the session
    drains and commits on the way out (exit status 143), where SIG_DFL lost every tensor still buffered."""
    proc = subprocess.Popen([sys.executable, "-c", _SIGTERM_CHILD.format(root=str(tmp_path))], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "captured"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "Traceback" not in err, err
    cs = capture.open(tmp_path)
    assert cs.committed and len(cs) == 20 and cs.verify() == []
    committed = json.loads((tmp_path / "rank-00000" / layout.COMMITTED).read_text())
    assert committed["records"] == 20 and committed["dropped"] == 0


def test_the_sigterm_handler_is_restored_at_close_and_a_process_handler_is_left_alone(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with capture.start(spec_text(), tmp_path / "a"):
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

        def own(signum, frame):  # e.g. fxquant.megatron_glue.launch._terminate
            raise SystemExit(1)

        signal.signal(signal.SIGTERM, own)
        with capture.start(spec_text(), tmp_path / "b"):
            assert signal.getsignal(signal.SIGTERM) is own
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_is_the_default_again_after_a_caught_exit_or_a_close_cut_short(tmp_path, monkeypatch):
    """The handler's SystemExit caught up the stack (a harness catching BaseException), or a close that raises
    (Ctrl-C in the drain): either way the session's close gives SIGTERM its default action back, so a second
    SIGTERM still ends the process."""
    import os

    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        s = capture.start(spec_text(), tmp_path / "a")
        with pytest.raises(SystemExit) as exit_:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this thread as the call returns
            time.sleep(1)
        assert exit_.value.code == 143
        s.close()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

        s = capture.start(spec_text(), tmp_path / "b")
        real_close = s.writer.close

        def interrupted():
            real_close()
            raise KeyboardInterrupt("Ctrl-C during the drain")

        monkeypatch.setattr(s.writer, "close", interrupted)
        with pytest.raises(KeyboardInterrupt):
            s.close()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
