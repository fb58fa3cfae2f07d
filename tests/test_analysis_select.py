"""What the analysis verbs select: `--where` keeps the high-precision source of every quantized copy it selects
(pairing comes before filtering), a DIR named twice is read once, and repeated `--where` items for one field add up."""
from __future__ import annotations

import json

import torch

from fxquant import capture
from fxquant.analysis import plan
from fxquant.analysis.what_if import what_if
from fxquant.cli import main
from fxquant.cli.options import where_conditions
from tests.analysis_helpers import write_set, write_tensors


def _rows(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_where_on_a_field_of_the_quantized_copies_keeps_their_sources(tmp_path, capsys):
    """`--where gemm=dgrad` matches only quantized copies (a high-precision record has no GEMM): each keeps the
    high-precision record it was quantized from, so the error comes from the two tensors, as without a filter,
    while `capture ls --where` lists the matching records only."""
    full, both = tmp_path / "full", tmp_path / "both"
    write_set(full, ranks=1, layers=2, what="full")  # no capture-time statistics: the error needs the source
    write_set(both, ranks=1, layers=2, what="both")

    p = plan.build([full], {"gemm": "dgrad"})
    units = [u for t in p.tasks for u in t.units]
    assert [sorted(i.fields["copy"] for i in u) for u in units] == [["hp", "quantized"]] * 2
    assert (p.records, p.partners) == (4, 2)
    assert {i.fields["role"] for u in units for i in u} == {"grad_output"}
    assert plan.build([full], {"copy": "hp"}).partners == 0  # high-precision records bring nothing along
    assert {(i.fields["copy"], i.partner) for u in units for i in u} == {("hp", True), ("quantized", False)}
    # the sources are read for the pairing only: the statistics count the selected records alone
    from fxquant.analysis import report
    res = report([full], tmp_path / "r", where={"gemm": "dgrad"}, plots=False, progress=False)
    assert (res.records, res.tensors) == (2, 2)
    rows = (tmp_path / "r" / "layers" / "layers.csv").read_text().splitlines()[1:]
    assert len(rows) == 2 and all("grad_output [quantized mxfp8_e5m2]" in r for r in rows)

    assert main(["capture", "ls", str(full), "--where", "gemm=dgrad", "--json"]) == 0
    assert len(_rows(capsys.readouterr().out)) == 2

    assert main(["quant-error", str(full), "-q", "--json"]) == 0
    unfiltered = [r for r in _rows(capsys.readouterr().out) if r["gemm"] == "dgrad"]
    for d in (full, both):
        assert main(["quant-error", str(d), "-q", "--json", "--where", "gemm=dgrad"]) == 0
        out = capsys.readouterr()
        rows = _rows(out.out)
        assert len(rows) == 2 and "note:" not in out.err, out.err
        assert all(r["source"] == "tensors" and r["max_err"] is not None for r in rows)
        if d == full:
            assert rows == unfiltered


def test_the_note_without_quantized_copies_names_what_selected_none(tmp_path, capsys):
    """With no quantized copy selected, the note gives the filter (not the predecessor's .pt files)."""
    write_set(tmp_path / "cap", ranks=1, layers=1, what="full")
    assert main(["quant-error", str(tmp_path / "cap"), "-q", "--where", "copy=hp"]) == 0
    err = capsys.readouterr().err
    assert "no quantized copies among the selected records (--where copy=hp)" in err and ".pt" not in err


def test_a_directory_named_twice_is_read_once(tmp_path, capsys):
    """`caps/run`, `caps/run/` and a link to it are one directory: its records count once in every verb."""
    d = tmp_path / "cap"
    write_tensors(d, [torch.randn(4, 64), torch.randn(4, 64)])
    (tmp_path / "link").symlink_to(d)
    again = [str(d) + "/", str(tmp_path / "link"), str(tmp_path / "." / "cap")]
    assert plan.build([d, *again]).records == plan.build([d]).records == 2
    assert what_if([d, *again], "hifp8").records == 2
    assert main(["what-if", str(d), *again, "--formats", "hifp8", "-q", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 2
    assert main(["report", str(d), *again, "-o", str(tmp_path / "r"), "-q", "--no-plots"]) == 0
    assert capsys.readouterr().out.startswith("2 records")


def test_repeated_where_for_one_field_is_the_union_of_its_values(tmp_path, capsys):
    assert where_conditions(["role=input", "role=weight"]) == {"role": ["input", "weight"]}
    assert where_conditions(["role=input,weight", "layer=0", "role=weight", "layer=1"]) == {
        "role": ["input", "weight"], "layer": [0, 1]}
    assert where_conditions(["layer=2", "layer=2"]) == {"layer": 2}
    write_set(tmp_path / "cap", ranks=1, layers=2)
    counts = []
    for argv in (["--where", "role=input,weight"], ["--where", "role=input", "--where", "role=weight"]):
        assert main(["capture", "ls", str(tmp_path / "cap"), "--json", *argv]) == 0
        counts.append(sorted((r["role"], r["copy"]) for r in _rows(capsys.readouterr().out)))
    assert counts[0] == counts[1] and {role for role, _ in counts[0]} == {"input", "weight"}


def test_where_values_with_a_leading_zero_stay_text(tmp_path, capsys):
    """run_id=0042 selects a run id stored as "0042" (it was read as 42, which reads "42", and matched nothing)."""
    assert where_conditions(["run_id=0042", "layer=-1", "seq=-0"]) == {"run_id": "0042", "layer": -1, "seq": "-0"}
    spec = capture.load_spec("x", text="version: 1\nsections: [{name: s, points: [{component: linear}]}]\n")
    with capture.start(spec, tmp_path / "cap", scheme="t", run_id="0042") as session:
        session.save(torch.ones(2, 2), "a")
    assert main(["capture", "ls", str(tmp_path / "cap"), "--json", "--where", "run_id=0042"]) == 0
    assert [r["run_id"] for r in _rows(capsys.readouterr().out)] == ["0042"]
    assert main(["capture", "ls", str(tmp_path / "cap"), "--json", "--where", "run_id=42"]) == 1
