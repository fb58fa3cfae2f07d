"""The report's per-layer / per-rank / per-tensor-type pages: one overlay figure per (layer, rank), one table row
per tensor type, numbers equal to the tensors."""
from __future__ import annotations

import csv

import pytest

from fxquant import analysis
from tests.analysis_helpers import OPERANDS, write_set

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
