"""Reading capture sets: query conditions and ``--where``, empty selections in ``capture ls`` / ``export-pt``,
statistics-only records in ``export-pt``, and the shard handles (memory maps) a reader keeps open."""
from __future__ import annotations

import json

import torch

from fxquant import capture
from fxquant.capture.spec import Component, ModuleKind, Role
from fxquant.capture.tap import Tap
from fxquant.cli import main
from tests.capture_helpers import emit, spec_text, tap


def test_a_number_matches_the_same_digits_stored_as_a_string(tmp_path, capsys, monkeypatch):
    """torchrun's run id (``--rdzv-id=$SLURM_JOB_ID``) is a string of digits; ``--where run_id=4711`` parses 4711 as
    an integer and selected nothing."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4711")
    monkeypatch.delenv("FXQUANT_RUN_ID", raising=False)
    with capture.start(spec_text(), tmp_path):
        emit(3)
    cs = capture.open(tmp_path)
    assert cs.values("run_id") == ["4711"]
    assert len(cs.query(run_id=4711)) == 3 and len(cs.query(run_id=[1, 4711])) == 3
    assert len(cs.query(iteration="1")) == 1 and len(cs.query(iteration=["0", 2])) == 2
    assert len(cs.query(run_id=4712)) == 0 and len(cs.query(layer=True)) == 0  # a boolean is no number here
    assert main(["capture", "ls", str(tmp_path), "--where", "run_id=4711", "--json"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert main(["capture", "export-pt", str(tmp_path), str(tmp_path / "out"), "--where", "run_id=4711"]) == 0
    assert "wrote 3 .pt files" in capsys.readouterr().out


def test_ls_and_export_pt_say_when_nothing_matched(tmp_path, capsys):
    with capture.start(spec_text(), tmp_path / "cap"):
        emit(2)
    cap, out = str(tmp_path / "cap"), tmp_path / "out"
    for argv in (["ls", cap], ["ls", cap, "--json"], ["ls", cap, "--records"], ["export-pt", cap, str(out)]):
        assert main(["capture", *argv, "--where", "role=weight", "--where", "iteration=0"]) == 1, argv
        err = capsys.readouterr().err
        assert f"fxquant capture {argv[0]}: error: no " in err and f"in {cap} match --where role=weight iteration=0" in err
    assert not out.exists()


def test_export_pt_says_how_many_statistics_only_records_it_skipped(tmp_path, capsys):
    text = """sections:
  - name: full
    layers: {module: down_proj}
    points: [{component: linear, roles: [input]}]
  - name: st
    layers: {module: up_proj}
    points: [{component: linear, roles: [input]}]
    what: stats
"""
    cap, out = tmp_path / "cap", tmp_path / "out"
    with capture.start(capture.load_spec("t.yaml", text=text), cap, scheme="mxfp8"):
        for i in range(3):  # selected by section 1 (st), as the tap pass encodes it
            up = Tap(Component.LINEAR, Role.INPUT, f"layers.{i}.mlp.up_proj", (1,), ModuleKind.FC1, i)
            torch.ops.fxquant.capture(torch.randn(4, 8), up.encode())
        torch.ops.fxquant.capture(torch.randn(4, 8), tap("layers.0.mlp.down_proj"))
    assert main(["capture", "export-pt", str(cap), str(out)]) == 0
    got = capsys.readouterr()
    assert "wrote 1 .pt files" in got.out
    assert "3 statistics-only record(s) skipped: they hold no tensor (what: stats)" in got.err
    assert main(["capture", "export-pt", str(cap), str(tmp_path / "out2"), "--where", "section=st"]) == 1
    got = capsys.readouterr()
    assert "3 statistics-only record(s) skipped" in got.err
    assert "error: no records with a stored tensor in" in got.err and not (tmp_path / "out2").exists()


def test_the_reader_keeps_a_few_shards_mapped_not_every_one(tmp_path):
    """verify and tensors() close each shard's handle once done with its records; load() keeps the few most
    recently used (every shard of a large set stayed memory-mapped until close)."""
    with capture.start(spec_text(), tmp_path, shard_bytes=1):  # one shard per tensor
        emit(12)
    cs = capture.open(tmp_path)
    assert len({r.file for r in cs}) == 12
    assert cs.verify() == [] and len(cs._handles) == 0
    seen = []
    for rec, t in cs.tensors():
        seen.append(len(cs._handles))
        assert torch.equal(t, cs.load(rec))
    assert max(seen) == 1 and len(cs._handles) == 0
    sub = cs.query(iteration=lambda i: i < 12)
    for rec in sub:
        sub.load(rec)
    assert len(cs._handles) == len(sub._handles) == cs._handles.max_open < 12  # shared, least recently used closed
    first = cs[0]
    assert torch.equal(cs.load(first, check=True), cs.load(first))  # reopened on demand
    cs.close()
    assert len(cs._handles) == 0 and json.loads((tmp_path / "rank-00000" / "COMMITTED").read_text())["shards"] == 12
