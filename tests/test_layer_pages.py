"""The report's per-layer / per-rank / per-tensor-type pages: one overlay figure per (layer, rank), one table row
per tensor type, numbers equal to the tensors."""
from __future__ import annotations

import csv
import json

import pytest
import torch

from fxquant import analysis
from tests.analysis_helpers import OPERANDS, write_set, write_tensors

FAST = {"formats": ["hifp8"], "mx_formats": ["mxfp8_e4m3"], "offsets": (0,), "sample_blocks": 8, "progress": False}


def test_layer_rank_type_pages(tmp_path):
    sent = write_set(tmp_path / "cap", ranks=2, layers=3, what="full")
    res = analysis.report([tmp_path / "cap"], tmp_path / "r", **FAST)
    figs = sorted(p.name for p in (tmp_path / "r" / "layers").glob("layer_*.svg"))
    assert figs == [f"layer_{l}_rank_{r}_analysis.svg" for l in range(3) for r in range(2)]
    types = sorted(p.name for p in (tmp_path / "r" / "layers").glob("type_*.svg"))
    assert len(types) == 6 and "type_linear_backward_grad_output_quantized_mxfp8_e5m2.svg" in types, types
    across = (tmp_path / "r" / "layers" / "type_linear_forward_input.svg").read_text()
    assert "rank 0" in across and "rank 1" in across and "amax" in across
    assert all(f"layers/{f}" in res.files for f in figs)
    rows = list(csv.DictReader(open(tmp_path / "r" / "layers" / "layers.csv")))
    # per (layer, rank): 3 hp types + 3 quantized copies (fprop x, fprop w, dgrad dy)
    assert len(rows) == 3 * 2 * 6
    it = iter(sent)
    for rank in range(2):
        for layer in range(3):
            for role, *_ in OPERANDS:
                x = next(it)
                direction = "backward" if role.value == "grad_output" else "forward"
                row = next(r for r in rows if (r["layer"], r["rank"], r["tensor type"]) ==
                           (str(layer), str(rank), f"linear {direction} {role.value}"))
                assert float(row["min"]) == x.min().item() and float(row["max"]) == x.max().item()
                assert float(row["mean"]) == pytest.approx(x.double().mean().item(), rel=1e-6, abs=1e-12)
                assert int(row["numel"]) == x.numel() and row["tensors"] == "1"
    assert any(r["tensor type"] == "linear backward grad_output [quantized mxfp8_e5m2]" for r in rows)
    svg = (tmp_path / "r" / "layers" / "layer_2_rank_1_analysis.svg").read_text()
    for label in ("linear forward input", "linear forward weight", "linear backward grad_output",
                  "linear forward input [quantized mxfp8_e4m3]"):
        assert label in svg
    assert "Per layer and rank" in (tmp_path / "r" / "index.html").read_text()


def test_no_plots_writes_the_tables_only(tmp_path):
    write_set(tmp_path / "cap", ranks=1, layers=1, quantized=False, what="full")
    analysis.report([tmp_path / "cap"], tmp_path / "r", plots=False, **FAST)
    assert sorted(p.name for p in (tmp_path / "r" / "layers").iterdir()) == ["layers.csv", "layers.txt"]
    assert "linear forward weight" in (tmp_path / "r" / "layers" / "layers.txt").read_text()


def test_a_report_over_several_schemes_keeps_each_schemes_tensors_apart(tmp_path):
    """Two capture sets of different schemes with a tensor at the same layer, rank and type (the README's
    `fxquant report captures/bf16 captures/FA_linear_mxfp8`): the per-layer table and figures and the
    distribution pages and the underflow heatmaps are per scheme and name it (they pooled both sets: tensors=2,
    mean 2.5); a report over one scheme keeps its names and columns."""
    write_tensors(tmp_path / "a", [torch.full((4, 64), 1.0)], scheme="bf16")
    write_tensors(tmp_path / "b", [torch.full((4, 64), 4.0)], scheme="FA_linear_mxfp8")
    res = analysis.report([tmp_path / "a", tmp_path / "b"], tmp_path / "r", **FAST)
    r = tmp_path / "r"
    rows = list(csv.DictReader(open(r / "layers/layers.csv")))
    got = [(x["scheme"], x["layer"], x["rank"], x["tensor type"], x["tensors"], float(x["mean"])) for x in rows]
    assert got == [("FA_linear_mxfp8", "0", "0", "linear forward input", "1", 4.0),
                   ("bf16", "0", "0", "linear forward input", "1", 1.0)]
    assert (r / "layers/layers.txt").read_text().split()[0] == "scheme"
    for scheme in ("bf16", "FA_linear_mxfp8"):
        for rel in (f"layers/{scheme}/layer_0_rank_0_analysis.svg", f"layers/{scheme}/type_linear_forward_input.svg",
                    f"distributions/{scheme}/per_layer_moments.svg", f"distributions/{scheme}/hifp8/summary.json",
                    f"overflow/{scheme}/underflow_hifp8.svg"):
            assert rel in res.files, rel
        assert f"Layer 0, rank 0 ({scheme})" in (r / f"layers/{scheme}/layer_0_rank_0_analysis.svg").read_text()
    assert not list((r / "layers").glob("*.svg")) and not (r / "distributions/hifp8").exists()
    assert "2 schemes together" in (r / "overflow/summary.txt").read_text()  # per scheme in the CSV beside it
    one = json.loads((r / "distributions/bf16/hifp8/summary.json").read_text())
    four = json.loads((r / "distributions/FA_linear_mxfp8/hifp8/summary.json").read_text())
    assert one["scheme"] == "bf16" and four["scheme"] == "FA_linear_mxfp8"
    assert one["quantiles"]["overall"]["q0.999"] == pytest.approx(1.0, rel=1 / 16)  # not the other scheme's 4.0
    assert four["quantiles"]["0"]["q0.001"] == pytest.approx(4.0, rel=1 / 16)
    index = (r / "index.html").read_text()
    assert "bf16: layer 0, rank 0" in index and "FA_linear_mxfp8: hifp8: overall density" in index

    single = analysis.report([tmp_path / "a"], tmp_path / "s", **FAST)
    assert (tmp_path / "s/layers/layers.csv").read_text().startswith("layer,rank,tensor type,")
    assert {"layers/layer_0_rank_0_analysis.svg", "distributions/per_layer_moments.svg",
            "distributions/hifp8/summary.json", "overflow/underflow_hifp8.svg"} <= set(single.files)
    assert "scheme" not in json.loads((tmp_path / "s/distributions/hifp8/summary.json").read_text())
