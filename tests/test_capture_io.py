"""Capture runtime, writer and reader: round trips, statistics, budget, sampling, and injected faults
(disk full, SIGKILL mid-capture, truncated/corrupted shards, hostile names, untrusted pickles)."""
from __future__ import annotations

import errno
import io
import json
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fxquant
from fxquant import capture
from fxquant.capture import layout
from fxquant.capture.export import export_pt, load_pt
from fxquant.capture.reader import CaptureReadError
from fxquant.cli import main

from tests.capture_helpers import emit, spec_text, tap

REPO = Path(__file__).resolve().parents[1]


def test_round_trip_values_records_and_real_safetensors(tmp_path):
    with capture.start(spec_text(end=3), tmp_path, scheme="bf16", shard_bytes=1000) as s:
        sent = emit(5)
        assert not s.active  # iterations 3, 4 lie outside the window
    cs = capture.open(tmp_path)
    assert cs.committed and len(cs) == 3 and cs.verify() == []
    for rec, want in zip(cs, sent):
        assert torch.equal(cs.load(rec, check=True), want)
        assert (rec.component, rec.role, rec.phase, rec.direction, rec.kind, rec.layer) == (
            "linear", "input", "pre", "forward", "fc2", 0)
        assert rec.shape == [8, 16] and rec.dtype == "float32" and rec.rank == 0 and rec.tp_size == 1
        st = rec.stats
        assert st["max"] == want.max().item() and st["min"] == want.min().item()
        assert st["mean"] == pytest.approx(want.double().mean().item(), rel=1e-12)
        assert st["std"] == pytest.approx(want.double().std().item(), rel=1e-9)
        assert sum(st["exp_hist"].values()) == 128
        # the shard is a real safetensors file: the library reads the same bytes
        assert torch.equal(load_file(rec.path)[rec.key], want)
    assert cs.query(iteration=[0, 2]).values("iteration") == [0, 2]
    assert len(cs.query(iteration=lambda i: i > 0)) == 2
    with pytest.raises(ValueError, match="unknown record field 'nope'"):
        cs.query(nope=1)


def test_a_second_session_appends_and_is_uncommitted_until_it_closes(tmp_path):
    with capture.start(spec_text(end=3), tmp_path, scheme="bf16", run_id="first"):
        first = emit(2, seed=0)
    marker = tmp_path / "rank-00000" / layout.COMMITTED
    assert marker.is_file()
    s = capture.start(spec_text(end=3), tmp_path, scheme="mxfp8", run_id="second")
    try:
        assert not marker.exists()  # a crash now must not leave the first session's marker on the second's records
        assert not capture.open(tmp_path).committed
        second = emit(2, seed=1)
    finally:
        s.close()
    cs = capture.open(tmp_path)
    assert cs.committed and cs.verify() == []
    assert [r.run_id for r in cs] == ["first"] * 2 + ["second"] * 2
    assert [r.scheme for r in cs] == ["bf16"] * 2 + ["mxfp8"] * 2
    # the second session goes on from the first one's shard number and seq: no file or key is reused
    assert [r.seq for r in cs] == [0, 1, 2, 3] and len({(r.file, r.key) for r in cs}) == 4
    assert {r.file for r in cs.query(run_id="first")}.isdisjoint(r.file for r in cs.query(run_id="second"))
    for rec, want in zip(cs, first + second):
        assert torch.equal(cs.load(rec, check=True), want)


def test_a_session_appending_after_a_torn_manifest_line_starts_on_a_line_of_its_own(tmp_path):
    with capture.start(spec_text(end=3), tmp_path, run_id="first"):
        first = emit(3, seed=0)
    manifest = tmp_path / "rank-00000" / layout.MANIFEST
    manifest.write_bytes(manifest.read_bytes()[:-40])  # what a crash mid-append leaves
    assert len(capture.open(tmp_path)) == 2  # the torn line is skipped
    with capture.start(spec_text(end=3), tmp_path, run_id="second"):
        second = emit(2, seed=1)
    cs = capture.open(tmp_path)
    assert [r.run_id for r in cs] == ["first"] * 2 + ["second"] * 2
    # the torn line's tensor is in the first shard, named by no record; the second session's keys come after it
    assert [r.key for r in cs.query(run_id="second")] == ["t000000003", "t000000004"]
    (problem,) = cs.verify()
    assert "shard-000001.safetensors: 1 tensor(s) that no record names (t000000002)" in problem
    for rec, want in zip(cs, first[:2] + second):
        assert torch.equal(cs.load(rec, check=True), want)
    assert manifest.read_bytes().endswith(b"\n")


def test_a_refused_start_touches_nothing(tmp_path):
    old = tmp_path / "old"
    with capture.start(spec_text(end=3), old, run_id="old-run"):
        emit(1)
    before = {p: p.read_bytes() for p in old.rglob("*") if p.is_file()}
    with capture.start(spec_text(end=3), tmp_path / "live"):
        with pytest.raises(RuntimeError, match="another capture session is active"):
            capture.start(spec_text(end=3), old)
    assert {p: p.read_bytes() for p in old.rglob("*") if p.is_file()} == before
    assert capture.active_session() is None


def test_a_session_never_closed_is_committed_at_exit(tmp_path):
    code = textwrap.dedent(f"""
        import torch
        from fxquant import capture
        from tests.capture_helpers import spec_text
        capture.start(spec_text(end=3), {str(tmp_path)!r})
        for i in range(3):
            assert capture.save(torch.full((4, 4), float(i)), f"t{{i}}")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    cs = capture.open(tmp_path)
    assert cs.committed and [r.role for r in cs] == ["t0", "t1", "t2"]
    assert [cs.load(r)[0, 0].item() for r in cs] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("policy", ["stop", "abort"])
def test_any_writer_failure_is_reported_counted_and_never_hangs(tmp_path, monkeypatch, policy):
    """A failure other than an I/O error while a shard is written (here a RuntimeError) stops the writer like
    one: the error is kept, the records not written count as dropped, and saves, flush and close return."""
    real = layout.write_safetensors
    calls = []

    def failing(path, tensors, metadata):
        calls.append(path)
        if len(calls) == 2:
            raise RuntimeError("injected writer failure")
        return real(path, tensors, metadata)

    monkeypatch.setattr(layout, "write_safetensors", failing)
    s = capture.start(spec_text(end=100, policy=policy), tmp_path, queue_items=2)
    stored, raised = 0, None
    try:
        for i in range(40):
            if capture.save(torch.full((4, 4), float(i)), f"t{i}"):
                stored += 1
            s.flush()  # one shard per save
    except capture.CaptureError as exc:
        raised = exc
    summary = s.close()
    assert summary["clean"] is False and "injected writer failure" in summary["error"]
    assert summary["records"] == 1 and summary["records"] + summary["dropped"] == stored
    assert (raised is not None) == (policy == "abort") and capture.active_session() is None
    assert not s.writer._thread.is_alive()
    cs = capture.open(tmp_path)
    problems = cs.verify()  # the set is consistent, and verify says that it is incomplete
    assert cs.committed and len(cs) == 1 and len(problems) == 1
    assert "ended on an error" in problems[0] and "injected writer failure" in problems[0]
    assert f"({summary['dropped']} queued record(s) not written" in problems[0]


def test_one_tensor_for_several_works_survives_a_writer_that_is_done_with_the_first(tmp_path, monkeypatch):
    """One tensor tapped twice with different work (its quantized copies for fprop, blocked along dim -1, and for
    wgrad, along dim 0; statistics only): the capture call shares one private copy between the works. The writer
    may finish the first work, and release its hold on the copy, before the call has queued the second: the call
    keeps its own hold until its loop ends (a training run with `stats_only` crashed with 'lease already returned
    to its pool')."""
    from fxquant.capture.spec import Component, Copy, Gemm, ModuleKind, Role
    from fxquant.capture.tap import Tap, encode_taps
    from fxquant.formats.tensor_quant import TensorQuant

    spec = capture.load_spec("q.yaml", text="sections: [{name: q, points: [{component: linear, copies: [quantized]}],"
                                            " what: stats}]\n")
    qspec = TensorQuant("mxfp8_e4m3").spec()
    taps = encode_taps([Tap(Component.LINEAR, Role.INPUT, "layers.0.mlp.down_proj", (0,), ModuleKind.FC2, 0,
                            Copy.QUANTIZED, gemm, qspec, dim) for gemm, dim in ((Gemm.FPROP, -1), (Gemm.WGRAD, 0))])
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    with capture.start(spec, tmp_path) as s:
        real_put = s.writer.put

        def put_and_drain(item):  # the writer thread processes each item before the call goes on
            real_put(item)
            s.writer.wait_idle()

        monkeypatch.setattr(s.writer, "put", put_and_drain)
        torch.ops.fxquant.capture(x, taps)
    cs = capture.open(tmp_path)
    assert sorted(r.gemm for r in cs) == ["fprop", "wgrad"] and cs.verify() == [] and s.summary["clean"]
    for rec in cs:
        q = TensorQuant("mxfp8_e4m3").quantize(x, -1 if rec.gemm == "fprop" else 0)
        assert rec.stats["max"] == q.max().item() and rec.stats["min"] == q.min().item()


def test_save_refuses_a_dtype_capture_sets_cannot_store(tmp_path):
    with capture.start(spec_text(end=3), tmp_path):
        with pytest.raises(TypeError, match="float8_e4m3fnuz"):
            capture.save(torch.ones(4).to(torch.float8_e4m3fnuz), "odd")
        assert capture.save(torch.ones(4).to(torch.float8_e4m3fn), "fp8")
    cs = capture.open(tmp_path)
    assert [r.role for r in cs] == ["fp8"] and cs.load(cs[0]).dtype == torch.float8_e4m3fn


def test_stats_nan_inf_and_quantized_operand(tmp_path):
    from fxquant.capture import stats
    from fxquant.formats.tensor_quant import TensorQuant

    x = torch.tensor([[0.0, 1.0, -3.0, float("nan")], [float("inf"), 2.0, 0.0, 1e-30]])
    st = stats.compute(x)
    assert (st["nan_count"], st["inf_count"], st["min"], st["max"], st["amax"]) == (1, 1, -3.0, 2.0, 3.0)
    assert st["zero_fraction"] == 0.25 and st["exp_hist"] == {"-100": 1, "0": 1, "1": 2}
    finite = x[torch.isfinite(x)].double()  # moments over the 6 finite elements, not all 8
    assert st["mean"] == pytest.approx(finite.mean().item(), abs=1e-12)
    assert st["std"] == pytest.approx(finite.std().item(), rel=1e-12)  # sqrt(14 / 5)
    sy = stats.compute(torch.tensor([1.0, 2.0, 6.0, float("nan"), -float("inf")]))
    assert sy["mean"] == pytest.approx(3.0, rel=1e-12) and sy["std"] == pytest.approx(math.sqrt(7.0), rel=1e-12)
    assert (sy["nan_count"], sy["inf_count"], sy["zero_fraction"]) == (1, 1, 0.0)
    tq = TensorQuant("mxfp4")
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 7.5, 1e-3, 6.9  # floor scale: amax 7.5 -> s = 2 - 2 = 0; 7.5 > 6 saturates
    q = tq.quantize(x, -1)
    qs = stats.compute(q, x, tq, -1)
    assert qs["saturated_pct"] == pytest.approx(200 / 32)  # 7.5 and 6.9 both beyond 6
    assert qs["flushed_pct"] == pytest.approx(100 / 3)  # 1e-3 -> 0; 3 non-zero inputs
    err = (q - x).double()
    assert qs["mse"] == pytest.approx(err.square().mean().item())
    assert qs["cosine"] == pytest.approx(torch.nn.functional.cosine_similarity(q.double(), x.double()).item())


def test_budget_stops_cleanly_and_training_goes_on(tmp_path):
    with capture.start(spec_text(budget="{bytes: 1500}"), tmp_path) as s:
        emit(5)  # 512 bytes each: the 3rd would pass 1500
        assert s.stop_reason.startswith("budget.bytes=1500")
    cs = capture.open(tmp_path)
    assert len(cs) == 2 and cs.verify() == []
    assert cs.meta["rank-00000"]["committed"]["stop_reason"].startswith("budget.bytes")


def test_budget_files_and_sampling(tmp_path):
    text = """
sections:
  - points: [{component: linear, roles: input}]
    sampling: {random_rows: 3, seed: 7}
budget: {files: 2}
"""
    with capture.start(capture.load_spec("t.yaml", text=text), tmp_path, shard_bytes=1) as s:
        sent = emit(4)
    assert "budget.files=2" in s.stop_reason
    cs = capture.open(tmp_path)
    assert len(cs) == 2
    rows = torch.randperm(8, generator=torch.Generator().manual_seed(7))[:3].sort().values
    for rec, want in zip(cs, sent):
        assert rec.sample == {"mode": "random_rows", "rows": 3, "of_rows": 8, "seed": 7}
        assert torch.equal(cs.load(rec), want[rows]) and rec.stored_shape == [3, 16] and rec.shape == [8, 16]


def _fail_after(monkeypatch, n_ok: int) -> None:
    """Make the n_ok+1-th shard write fail with ENOSPC half-way through (an injected full disk)."""
    real = layout.write_atomic
    calls = {"n": 0}

    def write_atomic(path, write, **kw):
        if path.suffix != ".safetensors":
            return real(path, write, **kw)
        calls["n"] += 1
        if calls["n"] <= n_ok:
            return real(path, write, **kw)

        def half_then_full(f):
            buf = io.BytesIO()
            write(buf)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return real(path, half_then_full, **kw)

    monkeypatch.setattr(layout, "write_atomic", write_atomic)


def _no_partial_finals(root: Path) -> None:
    for p in root.rglob("*.safetensors"):
        load_file(p)  # every file under a final name is complete
    assert not list(root.rglob("*.tmp"))


def test_disk_full_policy_stop(tmp_path, monkeypatch):
    _fail_after(monkeypatch, 2)
    with capture.start(spec_text(), tmp_path, shard_bytes=1) as s:
        emit(3)
        s.flush()
        emit(2)  # after the failure: no error raised, nothing captured
        assert "No space left on device" in s.stop_reason
    _no_partial_finals(tmp_path)
    cs = capture.open(tmp_path)
    problems = cs.verify()  # consistent, and incomplete: the session ended on the error
    assert len(cs) == 2 and len(problems) == 1 and "ended on an error" in problems[0] and "errno 28" in problems[0]
    assert "errno 28" in cs.meta["rank-00000"]["committed"]["error"]


def test_disk_full_policy_abort(tmp_path, monkeypatch):
    _fail_after(monkeypatch, 1)
    s = capture.start(spec_text(policy="abort"), tmp_path, shard_bytes=1)
    try:
        emit(2)
        s.flush()
        with pytest.raises(capture.CaptureError, match="No space left on device") as err:
            emit(1)
        assert isinstance(err.value.__cause__, OSError) and err.value.__cause__.errno == errno.ENOSPC
    finally:
        s.close()
    _no_partial_finals(tmp_path)
    assert len(capture.open(tmp_path)) == 1


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_disk_full_real_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    if not _tmpfs(mnt, "256k"):
        pytest.skip("cannot mount a tmpfs here (needs root); the injected-ENOSPC tests cover the same path")
    try:
        with capture.start(spec_text(), mnt, shard_bytes=1) as s:
            emit(40, shape=(64, 64))  # 16 KiB each: the 256 KiB tmpfs fills up part-way
            s.flush()
        assert s.stop_reason and "No space left" in s.stop_reason
        _no_partial_finals(mnt)
        with capture.open(mnt) as cs:
            assert 0 < len(cs) < 40 and all(torch.isfinite(cs.load(r, check=True)).all() for r in cs)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


_CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {repo!r})
    from fxquant import capture
    from tests.capture_helpers import spec_text, tap
    with capture.start(spec_text(end=10**9), {root!r}, shard_bytes=1) as s:
        i = 0
        while True:
            s.set_iteration(i); i += 1
            torch.ops.fxquant.capture(torch.full((256, 256), float(i)), tap())
""")


def test_sigkill_mid_capture_leaves_only_complete_shards(tmp_path):
    root = tmp_path / "cap"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD.format(repo=str(REPO), root=str(root))])
    manifest = root / "rank-00000" / layout.MANIFEST
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not manifest.is_file() or manifest.read_bytes().count(b"\n") < 5):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    cs = capture.open(root)
    assert not cs.committed and len(cs) >= 5
    for rec in cs:
        t = cs.load(rec, check=True)
        assert torch.equal(t, torch.full((256, 256), float(rec.iteration + 1)))
    problems = capture.open(root).verify()
    assert any("no COMMITTED marker" in p for p in problems)
    assert all("checksum" not in p for p in problems)


def _one_shard(tmp_path) -> tuple[capture.CaptureSet, Path]:
    with capture.start(spec_text(), tmp_path):
        emit(2)
    cs = capture.open(tmp_path)
    return cs, cs[0].path


def test_truncated_shard_is_a_clear_error(tmp_path):
    cs, shard = _one_shard(tmp_path)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    cs = capture.open(tmp_path)
    with pytest.raises(CaptureReadError, match="shard-000001.safetensors"):
        cs.load(cs[1])
    assert main(["capture", "verify", str(tmp_path)]) == 1


def test_corrupted_bytes_fail_checksum(tmp_path, capsys):
    cs, shard = _one_shard(tmp_path)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    cs = capture.open(tmp_path)
    with pytest.raises(CaptureReadError, match="checksum mismatch"):
        cs.load(cs[1], check=True)
    assert main(["capture", "verify", str(tmp_path)]) == 1
    assert "checksum mismatch" in capsys.readouterr().err


def _strict_json(line: str) -> object:
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    return json.loads(line, parse_constant=refuse)


def test_changed_manifest_line_and_shard_header_are_found(tmp_path, capsys):
    """Corruption that keeps the syntax: a flipped digit in a manifest line (crc), a shard header's dtype or shape
    changed (the tensor no longer is what its record says; its bytes still hash the same)."""
    cs, shard = _one_shard(tmp_path)
    manifest = shard.parents[1] / layout.MANIFEST
    lines = manifest.read_bytes().split(b"\n")
    assert b'"iteration":0' in lines[0]
    manifest.write_bytes(b"\n".join([lines[0].replace(b'"iteration":0', b'"iteration":1'), *lines[1:]]))
    problems = capture.open(tmp_path).verify()
    assert len(capture.open(tmp_path)) == 1 and any("manifest.jsonl:1: record seq=0 fails its crc" in p for p in problems)
    manifest.write_bytes(b"\n".join(lines))
    header = shard.read_bytes()
    for old, new, what in ((b'"F32"', b'"I32"', "is int32, its record says float32"),
                           (b'"shape":[8,16]', b'"shape":[16,8]', "has shape [16, 8], its record says [8, 16]")):
        assert header.count(old) == 2  # both tensors' entries
        shard.write_bytes(header.replace(old, new, 1))
        cs = capture.open(tmp_path)
        with pytest.raises(CaptureReadError, match=re.escape(what)):
            cs.load(cs[0], check=True)
        assert main(["capture", "verify", str(tmp_path)]) == 1
        assert what in capsys.readouterr().err
    shard.write_bytes(header)
    assert capture.open(tmp_path).verify() == []


def test_lines_lost_or_repeated_at_a_line_boundary_are_found(tmp_path):
    """A manifest cut or extended at a line boundary parses: verify compares it with COMMITTED's count and seqs."""
    cs, shard = _one_shard(tmp_path)
    manifest = shard.parents[1] / layout.MANIFEST
    whole = manifest.read_bytes()
    first, second = whole.splitlines(keepends=True)
    manifest.write_bytes(first)
    assert capture.open(tmp_path).verify()[0].endswith("1 record(s), 2 when its session committed (lines lost since)")
    manifest.write_bytes(whole + second)
    problems = capture.open(tmp_path).verify()
    assert any("3 record(s), 2 when its session committed (lines added since)" in p for p in problems)
    assert any("seq 1 on 2 records" in p for p in problems)


def test_corrupt_line_before_an_unterminated_last_one_is_corruption_not_a_torn_tail(tmp_path):
    cs, shard = _one_shard(tmp_path)
    manifest = shard.parents[1] / layout.MANIFEST
    first, second = manifest.read_bytes().splitlines()
    manifest.write_bytes(first[:-10] + b"\n" + second)  # no final newline: the corrupt line is not the last
    with pytest.raises(CaptureReadError, match=r"manifest.jsonl:1: corrupt manifest line"):
        capture.open(tmp_path)


def test_non_finite_statistics_are_strict_json_and_read_back_as_floats(tmp_path, capsys):
    """An exactly representable quantized copy has no error: its sqnr_db is +inf, written as "inf"."""
    spec = capture.load_spec("q", text="version: 1\nsections: [{name: q, points: [{component: linear, roles: "
                                        "[weight], copies: [quantized]}], what: stats}]\n")
    model = torch.nn.Linear(32, 32, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.randint(-2, 3, (32, 32)).float())
    compiled = fxquant.compile(model, scheme="linear_mxfp8", capture=spec, backend="aot_eager")
    with capture.start(spec, tmp_path, scheme="linear_mxfp8"):
        compiled(torch.randn(4, 32)).sum().backward()
    lines = next(tmp_path.glob(f"rank-*/{layout.MANIFEST}")).read_text().splitlines()
    assert lines and all(isinstance(_strict_json(line), dict) for line in lines)
    assert any('"sqnr_db":"inf"' in line for line in lines)
    cs = capture.open(tmp_path)
    assert {r.stats["sqnr_db"] for r in cs} == {math.inf} and cs.verify() == []
    assert main(["capture", "ls", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(cs) and all(_strict_json(line)["stats"]["sqnr_db"] == "inf" for line in out)


def test_missing_and_unreferenced_shards_reported(tmp_path):
    cs, shard = _one_shard(tmp_path)
    extra = shard.with_name("shard-000099.safetensors")
    extra.write_bytes(shard.read_bytes())
    (shard.parent / "shard-000100.safetensors.tmp").write_bytes(b"partial")
    shard.unlink()
    problems = capture.open(tmp_path).verify()
    assert any("is missing" in p for p in problems)
    assert any("shard-000099.safetensors: not referenced" in p for p in problems)
    assert any("shard-000100.safetensors.tmp: partial shard" in p for p in problems)


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_untrusted_pickle_is_refused_never_loaded(tmp_path):
    cs, shard = _one_shard(tmp_path / "cap")
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Evil(marker))
    shard.write_bytes(evil)
    with pytest.raises(CaptureReadError, match="fxquant never loads pickles"):
        capture.open(tmp_path / "cap").load(cs[0])
    pt = tmp_path / "evil.pt"
    torch.save({"tensor": torch.ones(1), "x": _Evil(marker)}, pt)
    with pytest.raises(pickle.UnpicklingError):
        load_pt(pt)
    assert not marker.exists()


def test_hostile_names_stay_inside_and_export_pt(tmp_path):
    hostile = ["../../../../etc/evil", "a/b\\c:d", "x" * 5000, "..", "layers.0.mlp\n\x00name"]
    root, out = tmp_path / "cap", tmp_path / "out"
    with capture.start(spec_text(), root, scheme="../mx/../../fp8", run_id="../../run"):
        for i, name in enumerate(hostile):
            capture.active_session().set_iteration(i)
            torch.ops.fxquant.capture(torch.full((2, 3), float(i)), tap(module=name))
    cs = capture.open(root)
    assert [r.module for r in cs] == hostile
    paths = export_pt(cs, out)
    assert len(paths) == 5 and len(set(paths)) == 5
    for p, rec in zip(paths, cs):
        assert p.resolve().is_relative_to(out.resolve()) and p.parent.parent == out and len(p.name) <= 255
        d = load_pt(p)
        assert torch.equal(d["tensor"], torch.full((2, 3), float(rec.iteration)))
        assert d["metadata"]["extras"]["module"] == rec.module and d["metadata"]["tensor_name"] == "input"
    assert {p.parent.name for p in paths} == {layout.sanitize("../mx/../../fp8", 60)}
    assert [x.name for x in tmp_path.iterdir()] and not (tmp_path / "etc").exists()


def test_export_pt_names_and_payload(tmp_path):
    with capture.start(spec_text(), tmp_path / "cap", scheme="mxfp8"):
        emit(1)
    assert main(["capture", "export-pt", str(tmp_path / "cap"), str(tmp_path / "out")]) == 0
    (p,) = (tmp_path / "out" / "mxfp8").iterdir()
    parts = p.name.split("_")
    assert parts[3:] == ["000000", "iter0", "fc2", "L0", "forward", "pre", "linear", "mxfp8", "rank0", "input.pt"]
    d = torch.load(p, weights_only=True)
    assert set(d) == {"tensor", "tensor_info", "metadata"}
    assert d["tensor_info"]["shape"] == [8, 16] and d["metadata"]["operation"] == "forward"
    assert d["metadata"]["component"] == "linear" and d["metadata"]["quant_type"] == "mxfp8"


def test_cli_ls(tmp_path, capsys):
    with capture.start(spec_text(), tmp_path):
        emit(2)
    assert main(["capture", "ls", str(tmp_path), "--records", "--where", "iteration=1"]) == 0
    out = capsys.readouterr().out
    assert "committed" in out and "1 records (1 with tensors)" in out
    assert main(["capture", "ls", str(tmp_path), "--json"]) == 0
    assert [json.loads(x)["iteration"] for x in capsys.readouterr().out.splitlines()] == [0, 1]
    assert main(["capture", "ls", str(tmp_path / "nope")]) == 2


def test_predecessor_flags_and_env(tmp_path):
    import argparse

    from fxquant.capture.compat import add_arguments, from_args, from_predecessor

    assert from_predecessor(env={}) is None
    assert from_predecessor(env={"TENSOR_SAVE_ENABLED": "false"}) is None
    spec, cfg = from_predecessor(env={"TENSOR_SAVE_ENABLED": "true", "CUSTOM_QUANT_TYPE": "hifp8"})
    assert cfg["root"] == Path("./enhanced_tensor_logs") and cfg["scheme"] == "hifp8"
    assert all(s.when.contains(0, 3, 5) and not s.when.contains(1, 0, 0) for s in spec.sections)
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--save-tensors", "--tensor-save-dir", str(tmp_path), "--control-iter", "3"])
    spec, cfg = from_args(args, start_iteration=10, env={"TENSOR_SAVE_DIR": "/elsewhere"})
    assert cfg["root"] == tmp_path and cfg["start_iteration"] == 10
    assert [i for i in range(20) if i in spec.sections[0].when.iterations] == [10, 11, 12]
    spec, cfg = from_predecessor(True, None, 0, env={"TENSOR_SAVE_DIR": str(tmp_path)})
    assert cfg["root"] == tmp_path and 10**6 in spec.sections[0].when.iterations
    with pytest.raises(ValueError, match="TENSOR_SAVE_ENABLED='maybe'"):
        from_predecessor(env={"TENSOR_SAVE_ENABLED": "maybe"})


_TWO_RANKS = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, {repo!r})
    from fxquant import capture
    from tests.capture_helpers import spec_text, tap
    dist.init_process_group("gloo")
    r = dist.get_rank()
    with capture.start(spec_text(), {root!r}, scheme="bf16") as s:
        for it in range(3):
            s.set_iteration(it)
            x = torch.full((4, 4), float(10 * r + it))
            dist.all_reduce(torch.zeros(1))
            torch.ops.fxquant.capture(x, tap())
    dist.destroy_process_group()
""")


@pytest.mark.dist
def test_two_ranks_torchrun_gloo_one_root(tmp_path):
    script, root = tmp_path / "two_ranks.py", tmp_path / "cap"
    script.write_text(_TWO_RANKS.format(repo=str(REPO), root=str(root)))
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(script)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cs = capture.open(root)
    assert cs.committed and sorted(cs.meta) == ["rank-00000", "rank-00001"]
    assert cs.values("rank") == [0, 1] and cs.values("world_size") == [2] and len(cs.values("run_id")) == 1
    for rec in cs:
        assert torch.equal(cs.load(rec, check=True), torch.full((4, 4), float(10 * rec.rank + rec.iteration)))
    assert cs.verify() == []


def test_reader_query_results_load_and_hostile_file_fields_are_refused(tmp_path):
    """A queried subset loads tensors; a manifest 'file' escaping its rank directory is refused."""
    with capture.start(spec_text(end=3), tmp_path, scheme="bf16"):
        sent = emit(3)
    cs = capture.open(tmp_path)
    sub = cs.query(iteration=[1, 2])
    assert len(sub) == 2 and torch.equal(sub.load(sub[0]), sent[1])
    manifest = next(tmp_path.glob(f"rank-*/{layout.MANIFEST}"))
    lines = manifest.read_text().splitlines()
    rec = json.loads(lines[0])
    rec["file"] = "../../outside.safetensors"
    manifest.write_text(layout.record_line(rec) + "\n".join(lines[1:]) + "\n")  # a valid crc: no changed byte
    hostile = capture.open(tmp_path)
    with pytest.raises(CaptureReadError, match="outside"):
        hostile.load(hostile.query(seq=rec["seq"])[0])
    problems = hostile.verify()  # listed with the rest, not raised: the other records are still checked
    assert len(problems) == 2 and "lies outside its rank directory" in problems[0]  # the two others verified
    assert "1 tensor(s) that no record names (t000000000)" in problems[1]  # the record names another file
    assert main(["capture", "verify", str(tmp_path)]) == 1


def test_a_second_process_writing_the_same_rank_directory_is_refused(tmp_path):
    """Two sessions on one root and rank would both name their shards shard-000001 and their keys t000000000
    (each reads the resume point once), renaming one's shards over the other's: a session holds the rank
    directory's lock until it closes, and a second one, from another process, is refused naming the owner."""
    child = textwrap.dedent(f"""
        import sys, time, torch
        sys.path.insert(0, {str(REPO)!r})
        from fxquant import capture
        from tests.capture_helpers import spec_text
        with capture.start(spec_text(), {str(tmp_path)!r}, run_id="first"):
            capture.save(torch.ones(2, 2), "first")
            print("open", flush=True)
            sys.stdin.readline()
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "open"
        with pytest.raises(capture.RankDirBusy, match=f"pid {proc.pid}"):
            capture.start(spec_text(), tmp_path, run_id="second")
        assert capture.active_session() is None
    finally:
        proc.communicate("\n", timeout=120)
    assert proc.returncode == 0
    with capture.start(spec_text(), tmp_path, run_id="second"):  # the first has closed: its lock is free
        capture.save(torch.full((2, 2), 2.0), "second")
    cs = capture.open(tmp_path)
    assert [r.run_id for r in cs] == ["first", "second"] and cs.verify() == []
    assert [cs.load(r)[0, 0].item() for r in cs] == [1.0, 2.0]


def test_sections_asking_for_the_whole_tensor_and_for_sampled_rows_get_the_whole_tensor(tmp_path, caplog):
    """A tensor two sections select is stored once: whole when one of them asks for it whole (its rows hold
    the other's sample), whatever their order, and the record names that section; between two different
    samplings the first listed wins, with a warning."""
    from fxquant.capture.spec import Component, ModuleKind, Role
    from fxquant.capture.tap import Tap

    sampled = "  - name: overview\n    points: [{component: linear, roles: [input]}]\n    sampling: {%s}\n"
    whole = "  - name: full0\n    layers: {indices: [0]}\n    points: [{component: linear, roles: [input]}]\n"
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    for i, body in enumerate([sampled % "first_rows: 2" + whole, whole + sampled % "first_rows: 2",
                              sampled % "first_rows: 2" + sampled.replace("overview", "random") % "random_rows: 3"]):
        spec = capture.load_spec("two.yaml", text="sections:\n" + body)
        t = Tap(Component.LINEAR, Role.INPUT, "m", spec.sections_for("m", ModuleKind.FC2, 0), ModuleKind.FC2, 0)
        root = tmp_path / str(i)
        with caplog.at_level("WARNING", logger="fxquant.capture.runtime"):
            with capture.start(spec, root):
                torch.ops.fxquant.capture(x, t.encode())
        (rec,) = capture.open(root)
        if i < 2:
            assert rec.section == "full0" and rec.sample is None and torch.equal(capture.open(root).load(rec), x)
        else:
            assert rec.section == "overview" and rec.stored_shape == [2, 4]
            assert "sections 'overview' and 'random' both store a tensor, sampled differently" in caplog.text


def test_a_failing_capture_keeps_what_was_prepared_before_it(tmp_path):
    """A tensor whose deferred work fails in the writer thread stops capture (the policy applies), but the
    tensors queued before it, already prepared and waiting for their shard, are written, not dropped."""
    from fxquant.capture.spec import Component, Copy, Gemm, ModuleKind, Role
    from fxquant.capture.tap import Tap

    spec = capture.load_spec("q.yaml", text="sections: [{name: q, points: [{component: linear, copies: [quantized]}]}]\n")
    bad = Tap(Component.LINEAR, Role.INPUT, "m", (0,), ModuleKind.FC2, 0, Copy.QUANTIZED, Gemm.FPROP,
              "no_such_format", -1).encode()
    with capture.start(spec, tmp_path) as s:
        sent = [torch.full((4, 4), float(i)) for i in range(4)]
        for i, x in enumerate(sent):
            assert capture.save(x, f"good{i}")
        s.writer.wait_idle()  # prepared, waiting for their shard (256 MiB, 30 s away)
        torch.ops.fxquant.capture(torch.ones(4, 4), bad)  # the re-quantization fails in the writer thread
        s.writer.wait_idle()
        assert not capture.save(torch.ones(1), "after")  # capture has stopped; training goes on
    assert s.summary["records"] == 4 and s.summary["dropped"] == 1 and not s.summary["clean"]
    assert "no_such_format" in s.summary["error"]
    cs = capture.open(tmp_path)
    assert len(cs) == 4 and all(torch.equal(cs.load(r), x) for r, x in zip(cs, sent))
    assert [p.split(":")[0] for p in cs.verify()] == ["rank-00000"]  # only: ended on an error, 1 queued record lost


@pytest.mark.parametrize("what", ["full", "both"])
def test_row_sampling_of_a_tensor_with_an_empty_last_dim(tmp_path, what):
    """Sampled rows of a tensor with no columns ([3, 0]) are [2, 0]: no ambiguous reshape(-1, 0) in the op (what:
    full) or in the writer thread (what: both)."""
    spec = capture.load_spec("e.yaml", text="sections: [{name: e, points: [{component: linear, roles: [input]}],"
                                            f" what: {what}, sampling: {{first_rows: 2}}}}]\n")
    with capture.start(spec, tmp_path) as s:
        torch.ops.fxquant.capture(torch.empty(3, 0), tap())
        torch.ops.fxquant.capture(torch.ones(3, 2), tap())
    assert s.summary["clean"] and s.summary["records"] == 2
    cs = capture.open(tmp_path)
    assert [r.stored_shape for r in cs] == [[2, 0], [2, 2]] and cs.load(cs[0]).shape == (2, 0)


def test_safetensors_header_length_starting_with_0x80_is_not_taken_for_a_pickle(tmp_path):
    """A valid shard whose 8-byte header length begins with byte 0x80 (the pickle protocol marker) is read."""
    from safetensors.torch import save_file

    from fxquant.capture.reader import _check_shard

    for n_keys in range(1, 60):  # grow the JSON header until its length's low byte is 0x80
        tensors = {f"t{i:03d}": torch.zeros(1) for i in range(n_keys)}
        path = tmp_path / f"s{n_keys}.safetensors"
        save_file(tensors, path)
        if path.read_bytes()[0] == 0x80:
            break
    assert path.read_bytes()[0] == 0x80, "no header length with low byte 0x80 found: widen the search"
    _check_shard(path)  # must not raise
    (tmp_path / "pickle.safetensors").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CaptureReadError, match="pickle"):
        _check_shard(tmp_path / "pickle.safetensors")


def test_the_rank_directory_lock_is_released_while_a_forked_child_lives(tmp_path):
    """A child forked during a session (a DataLoader worker) shares the lock's file descriptor: closing the
    session unlocks it all the same, so the next session of the process starts (it was refused, naming itself)."""
    s = capture.start(spec_text(), tmp_path, run_id="first")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child holds its copy of every descriptor until the parent writes
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    try:
        os.close(r)
        s.close()
        with capture.start(spec_text(), tmp_path, run_id="second"):
            capture.save(torch.ones(2), "x")
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)
    assert [rec.run_id for rec in capture.open(tmp_path)] == ["second"]


def test_a_filesystem_without_flock_captures_with_a_warning(tmp_path, monkeypatch, caplog):
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level("WARNING", logger="fxquant.capture.layout"):
        with capture.start(spec_text(), tmp_path):
            assert capture.save(torch.ones(2), "x")
    assert "cannot be locked" in caplog.text and len(capture.open(tmp_path)) == 1


@pytest.mark.parametrize("policy", ["stop", "abort"])
def test_a_failing_capture_after_the_files_budget_is_still_reported(tmp_path, policy):
    """The buffered tensors' commit before a failing item may reach budget.files; the failure is still recorded
    (it was lost: a clean summary, and no CaptureError under abort)."""
    from fxquant.capture.spec import Component, Copy, Gemm, ModuleKind, Role
    from fxquant.capture.tap import Tap

    spec = capture.load_spec("q.yaml", text="sections: [{name: q, points: [{component: linear, copies: [quantized]}]}]\n"
                                            f"budget: {{files: 1}}\non_error: {policy}\n")
    bad = Tap(Component.LINEAR, Role.INPUT, "m", (0,), ModuleKind.FC2, 0, Copy.QUANTIZED, Gemm.FPROP,
              "no_such_format", -1).encode()
    s = capture.start(spec, tmp_path)
    capture.save(torch.ones(4, 4), "g0")
    s.flush()  # the one shard the budget allows
    capture.save(torch.ones(4, 4), "g1")
    s.writer.wait_idle()  # buffered
    torch.ops.fxquant.capture(torch.ones(4, 4), bad)
    s.writer.wait_idle()
    if policy == "abort":
        with pytest.raises(capture.CaptureError, match="no_such_format"):
            s.close()
    else:
        s.close()
    assert s.summary["clean"] is False and "no_such_format" in s.summary["error"]
    assert s.summary["records"] == 1


def test_verify_reports_a_failure_of_the_ops_own_work_and_keeps_earlier_captures_errors(tmp_path, monkeypatch):
    """A failure of the capture call's own tensor work (sampling; on CUDA the queued re-quantization) stops capture
    like a writer failure and leaves the capture unclean (it committed clean); the error stays recorded
    (errors.jsonl) through later captures appending to the directory, one that crashes before closing included
    (the next capture's marker replaced the earlier one's)."""
    from fxquant.capture import prepare

    text = "sections: [{name: rows, points: [{component: linear, roles: [input]}], what: full, sampling: {first_rows: 2}}]"
    spec = capture.load_spec("rows", text=text)
    real, calls = prepare.Work.sample, []

    def failing(self, x):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated: out of memory")
        return real(self, x)

    monkeypatch.setattr(prepare.Work, "sample", failing)
    with capture.start(spec, tmp_path, scheme="s") as cap:
        for i in range(3):
            cap.set_iteration(i)
            torch.ops.fxquant.capture(torch.randn(4, 16), tap())
    assert cap.summary["clean"] is False and "simulated: out of memory" in cap.summary["error"]
    (problem,) = capture.open(tmp_path).verify()
    assert "the capture of run" in problem and "ended on an error" in problem and "out of memory" in problem
    monkeypatch.setattr(prepare.Work, "sample", real)
    code = ("import os, sys, torch\nfrom fxquant import capture\nfrom tests.capture_helpers import tap\n"
            f"s = capture.start(capture.load_spec('rows', text={text!r}), sys.argv[1], scheme='s')\n"
            "s.set_iteration(4)\ntorch.ops.fxquant.capture(torch.randn(4, 16), tap())\nos._exit(1)\n")
    crash = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert crash.returncode == 1 and not (tmp_path / "rank-00000" / layout.COMMITTED).exists(), crash.stderr
    with capture.start(spec, tmp_path, scheme="s") as cap:
        cap.set_iteration(5)
        torch.ops.fxquant.capture(torch.randn(4, 16), tap())
    assert cap.summary["clean"] is True
    (problem,) = capture.open(tmp_path).verify()
    assert "ended on an error" in problem and "simulated: out of memory" in problem
