"""`fxquant plot-tensors`: value heatmaps (largest |value| per cell) and attention maps of captured scores."""
from __future__ import annotations

import math
import re

import torch

from fxquant.analysis.tensor_plots import attention_map, matrix_view, peak_cells, value_heatmap
from fxquant.cli import main
from tests.analysis_helpers import write_tensors


def test_peak_cells_keep_the_largest_magnitude_with_its_sign_and_nan():
    m = torch.zeros(10, 7)
    m[3, 2], m[9, 6], m[0, 0], m[5, 5] = -50.0, 7.0, 1.0, float("nan")
    data, fr, fc = peak_cells(m, 4)
    assert (fr, fc) == (3, 2) and data.shape == (4, 4)
    assert data[1, 1] == -50.0 and data[3, 3] == 7.0 and data[0, 0] == 1.0 and math.isnan(data[1, 2])
    full, fr1, fc1 = peak_cells(m, 64)
    assert (fr1, fc1) == (1, 1) and torch.equal(torch.from_numpy(full).nan_to_num(123.0), m.nan_to_num(123.0))
    assert matrix_view(torch.ones(2, 3, 4, 5))[0].shape == (4, 5) and matrix_view(torch.ones(6))[0].shape == (1, 6)
    # a NaN after an Inf in one cell still wins (both ranked as magnitude inf, the first was kept: the NaN hid)
    row = torch.tensor([[math.inf, math.nan, 1.0, 0.0, -math.inf, 2.0, -3e38, 5.0]])
    data, _, _ = peak_cells(row, 4)
    assert math.isnan(data[0, 0]) and data[0, 1] == 1.0 and data[0, 2] == -math.inf and data[0, 3] == -3e38
    assert peak_cells(torch.tensor([[1e30, -3e38]]), 1)[0][0, 0] == -3e38


def _rects(text: str) -> list[str]:
    return re.findall(r'<rect x="[^"]+" y="[^"]+" width="[^"]+" height="[^"]+" fill="(#[0-9a-f]{6})"/>', text)


def test_value_heatmap_and_attention_map_figures():
    t = torch.randn(2, 100, 80)
    t[0, 50, 40] = 1e4  # an outlier survives the pooling: the cell holding it is the darkest red
    fig = value_heatmap(t, {"module": "m", "role": "input", "rank": 0, "iteration": 0, "micro_batch": 0}, cells=16)
    text = fig.to_svg()
    fills = _rects(text)
    assert len(fills) == 16 * 15  # ceil(100/7)=15 rows of 7, 16 columns of 5
    from fxquant.analysis.svg import cmap, colour

    assert fills.count(colour(tuple(cmap("RdBu_r")(1.0)))[0]) == 1  # only the outlier's cell at the top colour
    assert "[0, :, :] of [2, 100, 80]" in text
    scores = torch.randn(1, 3, 12, 12)
    amap = attention_map(scores, {"module": "a", "role": "scores", "component": "attention"}, heads=8).to_svg()
    assert amap.count("head ") == 3 and "key position" in amap
    probs = torch.softmax(torch.randn(6, 12, 12), -1)  # Megatron's [b*h, Lq, Lk]
    pm = attention_map(probs, {"module": "a", "role": "probs", "component": "attention"}, heads=4).to_svg()
    assert pm.count(">head ") == 4 and "probability" in pm


def test_cli_draws_captured_scores_as_attention_maps(tmp_path, capsys):
    from tests.test_capture_scores import _run_llama

    cs, _, cfg = _run_llama(tmp_path / "cap", "FA_mxfp8")
    write_tensors(tmp_path / "lin", [torch.randn(4, 64)])
    assert main(["plot-tensors", str(tmp_path / "cap"), str(tmp_path / "lin"), "-o", str(tmp_path / "out"),
                 "--cells", "16", "--heads", "2"]) == 0
    assert "tensor(s) drawn" in capsys.readouterr().out
    maps = sorted((tmp_path / "out" / "attention").glob("*.svg"))
    assert len(maps) == cfg.n_layers and all("scores" in p.name for p in maps)
    assert len(list((tmp_path / "out" / "heatmaps").glob("*.svg"))) == 3 * cfg.n_layers + 1  # q, k, scores + 1
    index = (tmp_path / "out" / "index.html").read_text()
    assert all(p.name in index for p in maps)
    assert main(["plot-tensors", str(tmp_path / "cap"), "-o", str(tmp_path / "o2"), "--max-tensors", "1",
                 "--where", "role=scores"]) == 0
    assert "--max-tensors 1 reached" in capsys.readouterr().err
    assert main(["plot-tensors", str(tmp_path / "cap"), "--cells", "1"]) == 2


def test_cli_refuses_missing_directories_and_says_when_nothing_was_drawn(tmp_path, capsys):
    """As `report`: a DIR that does not exist (or is a file) is an error, status 2; a run that draws nothing
    (an empty DIR, a --where matching no record) exits 1 saying why, not `0 tensor(s) drawn`."""
    write_tensors(tmp_path / "lin", [torch.randn(4, 64)])
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    assert main(["plot-tensors", str(tmp_path / "nowhere"), "-o", str(tmp_path / "o1")]) == 2
    assert f"capture directory not found: {tmp_path / 'nowhere'}" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists()
    assert main(["plot-tensors", str(tmp_path / "afile"), "-o", str(tmp_path / "o1")]) == 2
    assert f"not a directory (give capture directories): {tmp_path / 'afile'}" in capsys.readouterr().err
    assert main(["plot-tensors", str(tmp_path / "empty"), "-o", str(tmp_path / "o2")]) == 1
    out, err = capsys.readouterr()
    assert "drawn ->" not in out and "error: no records with a stored tensor in" in err
    assert err.count("holds no rank-NNNNN directories") == 1  # the skipped DIR, said once
    assert main(["plot-tensors", str(tmp_path / "lin"), "-o", str(tmp_path / "o3"), "--where", "role=bogus"]) == 1
    out, err = capsys.readouterr()
    assert "drawn ->" not in out and "match --where role=bogus: nothing drawn" in err
    assert "see the warnings above" not in err
    assert main(["plot-tensors", str(tmp_path / "lin"), "-o", str(tmp_path / "afile")]) == 2  # output is a file
    assert capsys.readouterr().err.startswith("fxquant plot-tensors: error: File exists")


def test_two_directories_with_the_same_records_get_a_figure_each(tmp_path, capsys):
    """Two capture sets with one record each at the same module/role/iteration/seq: two figures, each linked
    from its own section (the second replaced the first, both sections showing it)."""
    write_tensors(tmp_path / "a", [torch.zeros(4, 8)])
    write_tensors(tmp_path / "b", [torch.ones(4, 8)])
    assert main(["plot-tensors", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(tmp_path / "out")]) == 0
    figures = sorted(p.name for p in (tmp_path / "out" / "heatmaps").iterdir())
    assert len(figures) == 2 and figures[0].startswith("0-a_") and figures[1].startswith("1-b_")
    index = (tmp_path / "out" / "index.html").read_text()
    assert all(f"heatmaps/{f}" in index for f in figures)
    # again into the same directory with one DIR: the other DIR's figure goes, a file of the user's stays
    (tmp_path / "out" / "heatmaps" / "notes.txt").write_text("mine")
    assert main(["plot-tensors", str(tmp_path / "a"), "-o", str(tmp_path / "out")]) == 0
    again = sorted(p.name for p in (tmp_path / "out" / "heatmaps").iterdir())
    assert len(again) == 2 and "notes.txt" in again and not any(f.startswith(("0-a_", "1-b_")) for f in again)


def test_long_module_names_keep_one_figure_per_record(tmp_path):
    """A Megatron MoE expert's name is long enough that the record's name is cut before its iteration and seq:
    the cut name ends in a hash of the whole one, so each record keeps a figure of its own (the second figure of
    a cut name was refused as 'written twice')."""
    from fxquant import capture
    from fxquant.analysis import outputs
    from fxquant.analysis.tensor_plots import plot_tensors
    from fxquant.capture.runtime import RankInfo
    from fxquant.capture.spec import Component, ModuleKind, Role
    from fxquant.capture.tap import Tap
    from tests.analysis_helpers import spec

    module = "decoder.layers.10.mlp.experts.local_experts.3.linear_fc1"
    with capture.start(spec("full"), tmp_path / "cap", scheme="bf16", rank=RankInfo(0, 1), run_id="r") as s:
        for it in range(12):
            s.set_iteration(it)
            tap = Tap(Component.LINEAR, Role.GRAD_OUTPUT, module, (0,), ModuleKind.FC1, 10)
            for _ in range(2):
                torch.ops.fxquant.capture(torch.randn(4, 64), tap.encode())
    index, problems, drawn = plot_tensors([tmp_path / "cap"], tmp_path / "out", max_tensors=100)
    figures = sorted(p.name for p in (tmp_path / "out" / "heatmaps").iterdir())
    assert drawn == 24 and len(figures) == 24 and problems == []
    assert all(len(f) <= outputs.SLUG_MAX + len(".svg") and f.startswith(module) for f in figures)
    long, slug = "x" * 100, outputs.slug
    assert slug(long + "_1") != slug(long + "_2") and len(slug(long + "_1")) == outputs.SLUG_MAX == 80
    assert slug(long + "_1") == slug(long + "_1") and slug("short name") == "short_name"
