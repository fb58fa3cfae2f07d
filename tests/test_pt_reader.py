"""The predecessor's .pt captures in `fxquant report`, `quant-error` and `mx-sweep`: fields from the payload's
metadata, the same numbers as the same tensors in an fxquant capture set, pickled objects refused."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from fxquant import analysis, capture
from fxquant.capture.export import export_pt
from fxquant.capture.pt_reader import PtCaptureSet
from fxquant.cli import main
from tests.analysis_helpers import write_set
from tests.capture_helpers import tap

FAST = {"formats": ["hifp8", "mxfp8_e4m3"], "mx_formats": ["mxfp8_e4m3"], "offsets": (-1, 0, 1),
        "sample_blocks": 16, "progress": False, "plots": False}


def predecessor_file(d: Path, i: int, t: torch.Tensor, layer_type: str, layer: int, op: str, phase: str, name: str,
                     quant_type: str = "hifp8", **meta) -> Path:
    """A file as the predecessor's tensor saver wrote it (name and payload: PREDECESSOR.md "Tensor capture")."""
    comp = "FA" if layer_type == "attention" else "linear"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"20250908_095220_{i:04d}_iter{meta.get('iteration', 0)}_{layer_type}_L{layer}_{op}_{phase}_{comp}_" \
               f"{quant_type}_rank{meta.pop('file_rank', 0)}_{name}.pt"
    info = {"shape": list(t.shape), "dtype": str(t.dtype), "device": "cuda:0", "requires_grad": True,
            "min": t.min().item(), "max": t.max().item(), "mean": t.float().mean().item(), "std": t.float().std().item()}
    metadata = {"layer_type": layer_type, "operation": op, "quant_type": quant_type, "tensor_name": name,
                "layer_idx": layer, "phase": phase, "component": comp, "save_time": "2025-09-08 09:52:20", **meta}
    torch.save({"tensor": t, "tensor_info": info, "metadata": metadata}, path)
    return path


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_predecessor_files_become_records(tmp_path):
    g = torch.Generator().manual_seed(0)
    d = tmp_path / "logs" / "hifp8"
    t = [torch.randn(2, 8, 64, generator=g).bfloat16() for _ in range(4)]
    predecessor_file(d, 1, t[0], "attention", 0, "forward", "pre", "query", iteration=3, rank=1)
    predecessor_file(d, 2, t[1], "linear", 1, "forward", "pre", "input", file_rank=2)
    predecessor_file(d, 3, t[2], "linear", 1, "backward", "pre", "input")
    predecessor_file(d, 4, t[3], "linear", 1, "forward", "pre", "weight")
    cs = capture.open(tmp_path / "logs")
    assert isinstance(cs, PtCaptureSet) and len(cs) == 4
    by = {(r.role, r.direction): r for r in cs}
    q = by[("query", "forward")]
    assert (q.component, q.layer, q.iteration, q.rank, q.phase, q.scheme, q.module) == (
        "attention", 0, 3, 1, "pre", "hifp8", "attention.L0")
    assert by[("input", "forward")].rank == 2  # from the file name when the metadata has none
    g_out = by[("grad_output", "backward")]  # the predecessor saved the incoming gradient as "input"
    assert g_out.predecessor_name == "input" and g_out.component == "linear"
    assert torch.equal(cs.load(g_out), t[2]) and cs.load(g_out).dtype == torch.bfloat16
    assert len(cs.query(role="weight")) == 1 and cs.verify() == []


def test_report_on_exported_pt_equals_report_on_the_capture_set(tmp_path):
    write_set(tmp_path / "cap", ranks=2, layers=2, what="full")
    cs = capture.open(tmp_path / "cap")
    export_pt(cs, tmp_path / "pt")
    a = analysis.report([tmp_path / "cap"], tmp_path / "ra", **FAST)
    b = analysis.report([tmp_path / "pt"], tmp_path / "rb", **FAST)
    assert b.problems == [] and b.records == a.records == len(cs)
    sa, sb = (json.loads((r / "stats/global_stats.json").read_text())["groupings"] for r in (tmp_path / "ra", tmp_path / "rb"))
    for key in ("copy", "layer", "rank", "role", "direction"):  # mean/std: merged in another order (file names)
        strip = lambda gs: sorted((json.dumps(x["group"], sort_keys=True), x["numel"], x["min"], x["max"],
                                   pytest.approx(x["mean"], rel=1e-12), pytest.approx(x["std"], rel=1e-12)) for x in gs)
        assert strip(sa[key]) == strip(sb[key]), key
    analysis.report([tmp_path / "pt"], tmp_path / "rc", workers=2, **FAST)  # worker processes open the .pt files
    assert (tmp_path / "rc/stats/global_stats.json").read_text() == (tmp_path / "rb/stats/global_stats.json").read_text()
    qa, qb = (json.loads((r / "quant_error/sites.json").read_text())["sites"] for r in (tmp_path / "ra", tmp_path / "rb"))
    key = lambda s: (s["rank"], s["layer"], s["role"], s["gemm"])
    assert len(qb) == len(qa) == 12 and all(s["source"] == "tensors" for s in qb)
    assert [(key(s), s["format"], s["sqnr_db"], s["max_err"]) for s in sorted(qa, key=key)] == \
        [(key(s), s["format"], s["sqnr_db"], s["max_err"]) for s in sorted(qb, key=key)]


def test_cli_verbs_read_pt_and_pickles_are_refused(tmp_path, capsys):
    g = torch.Generator().manual_seed(1)
    d = tmp_path / "logs" / "mxfp8"
    for i in range(3):
        predecessor_file(d, i, torch.randn(4, 64, generator=g), "linear", i, "forward", "pre", "input",
                         quant_type="mxfp8")
    marker = tmp_path / "pwned"
    torch.save({"tensor": torch.ones(4, 64), "metadata": {"x": _Evil(marker)}}, d / "evil.pt")
    (d / "junk.pt").write_bytes(b"not a torch file")
    assert main(["report", str(tmp_path / "logs"), "-o", str(tmp_path / "r"), "-q", "--no-plots",
                 "--formats", "hifp8", "--sample-blocks", "8"]) == 0
    err = capsys.readouterr().err
    assert "evil.pt: refused: not loadable with weights_only=True" in err and "junk.pt" in err
    assert err.count("evil.pt: refused") == 1  # said once (not logged and printed)
    assert main(["capture", "ls", str(tmp_path / "logs" / "mxfp8")]) == 0
    err = capsys.readouterr().err
    assert err.count("evil.pt: refused") == 1 and err.count("junk.pt") == 1
    assert not marker.exists()
    rep = json.loads((tmp_path / "r/report.json").read_text())
    assert rep["records"] == 3 and len(rep["problems"]) == 2
    assert main(["mx-sweep", str(tmp_path / "logs"), "-q", "--json", "--sample-blocks", "8",
                 "--mx-formats", "mxfp8_e4m3", "--offsets=0"]) == 0
    study = json.loads(capsys.readouterr().out)
    assert {r["format"] for r in study["rows"]} == {"mxfp8_e4m3"} and study["recommendation"]
    assert main(["quant-error", str(tmp_path / "logs"), "-q", "--json"]) == 0  # hp tensors only: no rows
    got = capsys.readouterr()
    assert got.out == "" and "`fxquant what-if DIR` gives the error" in got.err
    with pytest.raises(pickle.UnpicklingError):
        torch.load(d / "evil.pt", weights_only=True)
    # the predecessor's run_tensor_draw on its own enhanced_tensor_logs/: fxquant draw visualize reads it too
    assert main(["draw", "--mode", "visualize", "--tensor-dir", str(tmp_path / "logs"), "--output-dir",
                 str(tmp_path / "draw"), "--no-plots"]) == 0
    assert json.loads((tmp_path / "draw/report.json").read_text())["records"] == 3
    assert not marker.exists()


def test_export_pt_keeps_a_sampled_records_sample_section_and_statistics(tmp_path):
    """A sampled record (``random_rows``) read back from export-pt looked like a whole tensor of its rows: its
    ``sample``, ``section``, whole-tensor ``shape`` and capture-time ``stats`` travel in the payload's metadata."""
    text = "sections:\n  - name: sampled\n    points: [{component: linear, roles: [input]}]\n" \
           "    sampling: {random_rows: 4, seed: 3}\n"
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(0))
    with capture.start(capture.load_spec("t.yaml", text=text), tmp_path / "cap", scheme="mxfp8"):
        torch.ops.fxquant.capture(x, tap())
    (orig,) = capture.open(tmp_path / "cap")
    assert orig.sample["rows"] == 4 and orig.stored_shape == [4, 8] and orig.shape == [2, 16, 8]
    export_pt(capture.open(tmp_path / "cap"), tmp_path / "pt")
    cs = capture.open(tmp_path / "pt")
    (back,) = cs
    for name in ("shape", "stored_shape", "sample", "section", "stats", "module", "role", "iteration"):
        assert back[name] == orig[name], name
    assert torch.equal(cs.load(back), capture.open(tmp_path / "cap").load(orig))
    assert back.stats["max"] == x.max().item()  # over the whole tensor, not the 4 rows stored
    predecessor_file(tmp_path / "logs" / "hifp8", 1, torch.ones(2, 3), "linear", 0, "forward", "pre", "input")
    (rec,) = capture.open(tmp_path / "logs")  # a predecessor's file has none of them
    assert (rec.sample, rec.section, rec.stats, rec.shape) == (None, None, None, [2, 3])


def test_a_second_export_into_the_same_out_is_refused_or_replaces(tmp_path, capsys):
    """Exporting into an OUT/<quant_type>/ that holds an earlier export wrote the records again under other counters
    (read back twice: 14 records of a 12-record set): refused, naming the directory; --replace deletes the earlier
    files first. `capture ls` of a file says so (it said the path did not exist)."""
    write_set(tmp_path / "cap", ranks=1, layers=2, what="full")
    n = len(capture.open(tmp_path / "cap"))
    assert main(["capture", "export-pt", str(tmp_path / "cap"), str(tmp_path / "pt"), "--where", "role=input"]) == 0
    capsys.readouterr()
    assert main(["capture", "export-pt", str(tmp_path / "cap"), str(tmp_path / "pt")]) == 2
    err = capsys.readouterr().err
    assert "already holds" in err and "--replace" in err
    assert main(["capture", "export-pt", str(tmp_path / "cap"), str(tmp_path / "pt"), "--replace"]) == 0
    assert len(PtCaptureSet(tmp_path / "pt")) == n
    (tmp_path / "afile").write_text("x")
    assert main(["capture", "ls", str(tmp_path / "afile")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_export_pt_read_back_keeps_the_site_kind(tmp_path):
    """A linear record's kind (fc1, ...) came back None from its export-pt file: `--where kind=fc1` found nothing
    in the export that it found in the capture set. The predecessor's own linear files still have none."""
    write_set(tmp_path / "cap", ranks=1, layers=2, what="full")
    cs = capture.open(tmp_path / "cap")
    export_pt(cs, tmp_path / "pt")
    pt = PtCaptureSet(tmp_path / "pt")
    kinds = sorted(r.fields["kind"] for r in cs if r.has_tensor)
    assert kinds and sorted(r.fields["kind"] for r in pt) == kinds and "fc1" in kinds
    assert len(pt.query(kind="fc1")) == len(cs.query(kind="fc1")) > 0
