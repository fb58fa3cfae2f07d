"""`fxquant collect` (single / batch / quick) and `fxquant draw` (collect / visualize / both): real short
training runs with capture through `python -m experiments run`, counted per pattern, then `fxquant report`."""
from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core", reason="needs megatron-core")

FAST = ["--backend", "eager"]  # fxquant's rewritten graph interpreted: the same captures, less compile time


def _summary(root):
    return json.loads((root / "collection_summary.json").read_text())


def _check_counts(row):
    """The per-pattern counts agree with the capture set they were read from."""
    from fxquant import capture

    cs = capture.open(row["captures"])
    assert cs.committed and cs.verify() == []
    assert row["records"] == len(cs) == row["forward"] + row["backward"] == row["pre"] + row["post"] \
        == row["FA"] + row["linear"]
    assert row["FA"] > 0 and row["linear"] > 0
    assert row["quantized"] == len(cs.query(copy="quantized"))
    assert cs.values("scheme") == [row["scheme"]]
    return cs


def test_collect_quick_then_draw_visualize(tmp_path, capsys):
    from fxquant.cli import main

    logs = tmp_path / "enhanced_tensor_logs"
    assert main(["collect", "quick", "hifp8", "--tensor-save-dir", str(logs), "--out", str(tmp_path / "runs"),
                 "--export-pt", str(tmp_path / "pt"), *FAST]) == 0
    summary = _summary(logs)
    assert summary["mode"] == "quick" and [r["scheme"] for r in summary["runs"]] == ["FA_linear_hifp8"]
    (row,) = summary["runs"]
    assert row["status"] == "ok" and (row["iterations"], row["micro_batches"]) == ([0], [0])
    cs = _check_counts(row)
    assert row["quantized"] > 0 and set(cs.query(copy="quantized").values("format")) == {"hifp8"}
    metrics = (tmp_path / "runs" / "llama32-1b-tiny" / "mock" / "FA_linear_hifp8" / "metrics.jsonl").read_text()
    assert len(metrics.splitlines()) == 1
    assert "FA_linear_hifp8" in (logs / "collection_summary.txt").read_text()
    pts = sorted((tmp_path / "pt" / "FA_linear_hifp8").glob("*.pt"))  # the predecessor's files, safely loadable
    assert len(pts) == row["tensors"]
    first = torch.load(pts[0], weights_only=True)
    assert set(first) == {"tensor", "tensor_info", "metadata"} and first["metadata"]["quant_type"] == "FA_linear_hifp8"

    draw = tmp_path / "draw"
    assert main(["draw", "--tensor-dir", str(logs), "--output-dir", str(draw), "--no-plots"]) == 0  # visualize
    report = json.loads((draw / "report.json").read_text())
    assert report["records"] == row["records"] and report["problems"] == []
    assert (draw / "index.html").is_file() and (draw / "training" / "loss_vs_reference.json").is_file()

    capsys.readouterr()
    assert main(["draw", "visualize", "--tensor-dir", str(tmp_path / "runs"), "--output-dir", str(draw)]) == 2
    assert "holds no capture set" in capsys.readouterr().err


def test_collect_batch_every_quant_type(tmp_path, capsys):
    from experiments.catalog import PREDECESSOR_SCHEMES
    from fxquant.cli import main

    logs = tmp_path / "logs"
    common = ["--tensor-save-dir", str(logs), "--out", str(tmp_path / "runs"), "--collect-micro-batches", "1", *FAST]
    assert main(["collect", "batch", *common, "--dry-run"]) == 0  # the predecessor's ten schemes by default
    out = capsys.readouterr().out
    assert out.count("torch.distributed.run") == len(PREDECESSOR_SCHEMES) == 10
    for scheme in PREDECESSOR_SCHEMES:
        assert f'"dir": "{logs / scheme}"' in out

    # one real batch member (the others are the same command; the quantized schemes run in the other tests)
    assert main(["collect", "--mode", "batch", "--quant-types", "bf16", *common]) == 0
    (row,) = _summary(logs)["runs"]
    assert (row["scheme"], row["status"]) == ("bf16", "ok")
    _check_counts(row)
    assert (row["iterations"], row["micro_batches"], row["quantized"]) == ([0], [0], 0)  # bf16: no quantized copies

    assert main(["collect", "batch", "mxfp8", *common]) == 2
    assert "use --quant-types" in capsys.readouterr().err
    assert main(["collect", "single", "--quant-type", "mxfp9", *common]) == 2
    assert "did you mean 'mxfp8'" in capsys.readouterr().err


def test_draw_both_collects_single_then_reports(tmp_path):
    from fxquant.cli import main

    logs, draw = tmp_path / "logs", tmp_path / "draw"
    assert main(["draw", "both", "mxfp8", "--control-iter", "2", "--collect-micro-batches", "2", "--tensor-dir",
                 str(logs), "--output-dir", str(draw), "--out", str(tmp_path / "runs"), "--no-plots", *FAST]) == 0
    summary = _summary(logs)
    (row,) = summary["runs"]
    assert (summary["mode"], summary["control_iter"], row["scheme"]) == ("single", 2, "FA_linear_mxfp8")
    assert (row["iterations"], row["micro_batches"]) == ([0, 1], [0, 1])
    _check_counts(row)
    metrics = (tmp_path / "runs" / "llama32-1b-tiny" / "mock" / "FA_linear_mxfp8" / "metrics.jsonl").read_text()
    assert len(metrics.splitlines()) == 2  # --control-iter 2 stopped training, as the predecessor's did
    assert json.loads((draw / "report.json").read_text())["records"] == row["records"]
