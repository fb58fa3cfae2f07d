"""The full report (figures included) renders in headless Chromium with no broken image, offline;
loss curves from metrics JSONL with the mean relative error against bf16."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fxquant import analysis

from tests.analysis_helpers import write_set

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHECK = """<script>
window.addEventListener('load', () => {
  const imgs = Array.from(document.images);
  const broken = imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.getAttribute('src'));
  const d = document.createElement('div'); d.id = 'fxq-check';
  d.textContent = JSON.stringify({total: imgs.length, broken: broken});
  document.body.appendChild(d);
});
</script>"""


def _metrics(path: Path, losses: list[float], scheme: str) -> Path:
    """A run directory as fxquant.megatron_glue.train writes it: metrics.jsonl + run_config.json."""
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses, start=1):
            f.write(json.dumps({"iteration": i, "loss": loss, "lr": 1e-4, "grad_norm": 1.0 / i, "skipped": False,
                                "step_time_s": 0.5, "tokens_per_s": 2048.0}) + "\n")
    (path / "run_config.json").write_text(json.dumps({"scheme": scheme}))
    return path


def test_loss_curves_mean_relative_error(tmp_path):
    ref = [4.0, 3.0, 2.0, 1.0]
    q = [4.4, 3.0, 2.2, 1.1]
    runs = [analysis.load_run(_metrics(tmp_path / "a", ref, "bf16")),
            analysis.load_run(_metrics(tmp_path / "b", q, "FA_linear_mxfp4") / "metrics.jsonl")]
    assert [r.label for r in runs] == ["bf16", "FA_linear_mxfp4"]
    assert analysis.mean_relative_error(runs[1], runs[0]) == pytest.approx((0.1 + 0 + 0.1 + 0.1) / 4)
    assert analysis.mean_relative_error(runs[1], runs[0], last_n=2) == pytest.approx(0.1)
    res = analysis.report([], tmp_path / "r", metrics=[tmp_path / "a", tmp_path / "b", tmp_path / "missing"],
                          last_n=2, progress=False)
    rows = {r["run"]: r for r in json.loads((tmp_path / "r/training/loss_vs_reference.json").read_text())["runs"]}
    assert rows["FA_linear_mxfp4"]["mre_last_2"] == pytest.approx(0.1) and rows["bf16"]["mre_all"] is None
    assert "training/curves.svg" in res.files and "training/relative_error.svg" in res.files
    assert any("missing" in p for p in res.problems)


def test_a_diverged_run_has_an_infinite_loss_error_counting_its_nonfinite_iterations(tmp_path):
    """Loss NaN from iteration 10 on (iterations 1..30): every error is infinite there, not left out; the last
    N are the last N logged iterations, not the last N finite ones."""
    from fxquant.analysis.loss_curves import loss_error

    ref = [5.0 - 0.1 * i for i in range(30)]
    diverged = [v if i < 9 else float("nan") for i, v in enumerate(ref)]
    runs = [analysis.load_run(_metrics(tmp_path / "a", ref, "bf16")),
            analysis.load_run(_metrics(tmp_path / "b", diverged, "FA_linear_mxfp4"))]
    assert analysis.mean_relative_error(runs[1], runs[0]) == math.inf
    assert loss_error(runs[1], runs[0], last_n=10) == (math.inf, 10)
    assert loss_error(runs[1], runs[0], last_n=22) == (math.inf, 21)
    healed = analysis.load_run(_metrics(tmp_path / "c", diverged[:9] + ref[9:], "healed"))
    assert loss_error(healed, runs[0], last_n=10) == (0.0, 0)
    analysis.report([], tmp_path / "r", metrics=[tmp_path / "a", tmp_path / "b"], last_n=10, plots=False,
                    progress=False)
    rows = {r["run"]: r for r in json.loads((tmp_path / "r/training/loss_vs_reference.json").read_text())["runs"]}
    row = rows["FA_linear_mxfp4"]
    assert (row["mre_all"], row["mre_last_10"], row["nonfinite_loss"]) == ("inf", "inf", 21)
    # drawn, the loss panel keeps its scale from the finite points (an Inf left it with no ticks and switched it
    # to a log scale) and says how many it leaves out
    diverged[12] = float("inf")
    runs[1] = analysis.load_run(_metrics(tmp_path / "d", diverged, "FA_linear_mxfp4"))
    analysis.report([], tmp_path / "p", metrics=[tmp_path / "a", tmp_path / "d"], progress=False)
    curves = (tmp_path / "p/training/curves.svg").read_text()
    assert "loss (21 non-finite not drawn)" in curves and "grad norm (" not in curves
    texts = re.findall(r">([^<]+)</text>", curves)
    loss_ticks = texts[texts.index("30") + 1:texts.index("loss (21 non-finite not drawn)")]  # y ticks after x's
    assert loss_ticks == ["2", "3", "4", "5"], texts
    assert "FA_linear_mxfp4 (21 non-finite not drawn)" in (tmp_path / "p/training/relative_error.svg").read_text()


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (scripts/ensure_chromium.sh)")
def test_index_html_renders_in_headless_chromium_without_broken_images(tmp_path):
    write_set(tmp_path / "mxfp8", ranks=2, layers=2)
    write_set(tmp_path / "bf16", scheme="bf16", quantized=False, ranks=1, layers=2, seed=1)
    _metrics(tmp_path / "run_bf16", [3.0, 2.5, 2.0], "bf16")
    _metrics(tmp_path / "run_mx", [3.1, 2.6, 2.1], "FA_linear_mxfp8")
    res = analysis.report([tmp_path / "mxfp8", tmp_path / "bf16"], tmp_path / "report", workers=2, progress=False,
                          formats=["hifp8", "mxfp8_e4m3", "nvfp4"], mx_formats=["mxfp8_e4m3"], offsets=(0, 1),
                          sample_blocks=8, metrics=[tmp_path / "run_bf16", tmp_path / "run_mx"])
    page = res.index.read_text()
    figures = [f for f in res.files if f.endswith(".svg")]
    mx = "distributions/FA_linear_mxfp8"  # two schemes: each one's distribution and layer pages apart
    for needed in (f"{mx}/hifp8/overall_density.svg", f"{mx}/hifp8/per_layer_density.svg",
                   f"{mx}/hifp8/per_rank_density.svg", f"{mx}/per_layer_moments.svg",
                   f"{mx}/hifp8/layer_rank_heatmap.svg", "distributions/bf16/hifp8/overall_density.svg",
                   "layers/bf16/layer_1_rank_0_analysis.svg", "quant_error/heatmap_sqnr_db_FA_linear_mxfp8.svg",
                   "mx_study/mxfp8_e4m3.svg", "overflow/summary.svg", "training/curves.svg",
                   "stats/binades_by_direction.svg", "compare/linear_input_hp.svg"):
        assert needed in figures, needed
    assert all(f"src='{f}'" in page for f in figures)
    assert all(f"href='{f}'" in page for f in res.files if not f.endswith(".svg"))
    assert "http://" not in page and "https://" not in page  # offline: relative links only
    check = tmp_path / "report" / "_check.html"
    check.write_text(page.replace("</body>", CHECK + "</body>"))
    profile = tmp_path / "chromium-profile"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
           "--allow-file-access-from-files", "--virtual-time-budget=15000", "--dump-dom", check.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    m = re.search(r'<div id="fxq-check">(.*?)</div>', proc.stdout)
    assert m, f"chromium produced no check marker; rc={proc.returncode} stderr={proc.stderr[-2000:]}"
    result = json.loads(m.group(1).replace("&quot;", '"'))
    assert result["total"] == len(figures) and result["broken"] == []
    # a broken image is detected by the same check
    (tmp_path / "report" / figures[0]).unlink()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    result = json.loads(re.search(r'<div id="fxq-check">(.*?)</div>', proc.stdout).group(1).replace("&quot;", '"'))
    assert result["broken"] == [figures[0]]


def _run(path: Path, losses: list[float], scheme: str, model: str) -> Path:
    """A run directory whose run_config.json names its model and dataset, as RunConfig.to_dict writes them."""
    _metrics(path, losses, scheme)
    (path / "run_config.json").write_text(json.dumps({"scheme": scheme, "model": {"name": model},
                                                      "data": {"kind": "mock", "prefixes": []}}))
    return path


def test_runs_of_one_scheme_on_two_models_get_unique_labels_and_their_own_reference(tmp_path):
    """Two models x {bf16, linear_mxfp8}: four rows with distinct labels, each run compared with the bf16 run of
    its own model; a run whose model has no bf16 run is not compared with another model's, and a problem says so."""
    runs = {(m, s): _run(tmp_path / m / s, [4.0 * k, 3.0 * k, 2.0 * k], s, m)
            for m, k in (("m1", 1.0), ("m2", 2.0)) for s in ("bf16", "linear_mxfp8")}
    (runs["m1", "linear_mxfp8"] / "metrics.jsonl").write_text("".join(
        json.dumps({"iteration": i, "loss": v}) + "\n" for i, v in enumerate([4.4, 3.3, 2.2], start=1)))
    res = analysis.report([], tmp_path / "r", metrics=list(runs.values()), last_n=2, progress=False, plots=False)
    rows = {r["run"]: r for r in json.loads((tmp_path / "r/training/loss_vs_reference.json").read_text())["runs"]}
    assert set(rows) == {"m1/mock/bf16", "m1/mock/linear_mxfp8", "m2/mock/bf16", "m2/mock/linear_mxfp8"}
    assert rows["m1/mock/linear_mxfp8"]["reference"] == "m1/mock/bf16"
    assert rows["m1/mock/linear_mxfp8"]["mre_all"] == pytest.approx(0.1)
    assert rows["m2/mock/linear_mxfp8"]["reference"] == "m2/mock/bf16" and rows["m2/mock/linear_mxfp8"]["mre_all"] == 0
    assert res.problems == []
    lonely = [runs["m1", "bf16"], runs["m1", "linear_mxfp8"], runs["m2", "linear_mxfp8"]]
    res = analysis.report([], tmp_path / "r2", metrics=lonely, progress=False, plots=False)
    rows = {r["run"]: r for r in json.loads((tmp_path / "r2/training/loss_vs_reference.json").read_text())["runs"]}
    assert set(rows) == {"bf16", "m1/mock/linear_mxfp8", "m2/mock/linear_mxfp8"}  # a unique label is kept
    assert rows["m2/mock/linear_mxfp8"]["mre_all"] is None and rows["m2/mock/linear_mxfp8"]["reference"] is None
    assert rows["m1/mock/linear_mxfp8"]["mre_all"] == pytest.approx(0.1)
    assert len(res.problems) == 1 and "'m2/mock/linear_mxfp8' (m2/mock) is not compared" in res.problems[0]
    # without run_config.json the directories tell the runs apart
    a, b = tmp_path / "x" / "run", tmp_path / "y" / "run"
    for d in (a, b):
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text('{"iteration": 1, "loss": 2.0}\n')
    assert [r.label for r in analysis.loss_curves.unique_labels([analysis.load_run(a), analysis.load_run(b)])] == \
        [str(a), str(b)]


def test_report_cli_checks_metrics_runs_reference_and_last_n(tmp_path, capsys):
    from fxquant.cli import main

    _metrics(tmp_path / "a", [4.0, 3.0], "bf16")
    _metrics(tmp_path / "b", [4.4, 3.0], "FA_linear_mxfp4")
    out = tmp_path / "r"
    assert main(["report", "--metrics", str(tmp_path / "a"), "--metrics", str(tmp_path / "nowhere"), "-o", str(out),
                 "-q"]) == 2
    assert f"--metrics: no metrics JSONL at {tmp_path / 'nowhere'}" in capsys.readouterr().err
    assert not out.exists()
    assert main(["report", "--metrics", str(tmp_path / "a"), "--metrics", str(tmp_path / "b"), "--reference", "bf61",
                 "-o", str(out), "-q"]) == 0
    assert "warning: --metrics: no run labelled 'bf61' among bf16, FA_linear_mxfp4" in capsys.readouterr().err
    # a single run has nothing to be compared with: the report says so in its table, with no console warning
    assert main(["report", "--metrics", str(tmp_path / "b"), "-o", str(tmp_path / "one"), "-q"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert (tmp_path / "one/training/loss_vs_reference.txt").read_text().startswith(
        "one run (FA_linear_mxfp4): no run labelled 'bf16' to compare it with")
    for bad in ("0", "-3"):
        with pytest.raises(SystemExit) as exit_:
            main(["report", "--metrics", str(tmp_path / "a"), "--last-n", bad, "-o", str(out), "-q"])
        assert exit_.value.code == 2 and f"argument --last-n: {bad}: must be >= 1" in capsys.readouterr().err
    run_a, run_b = analysis.load_run(tmp_path / "a"), analysis.load_run(tmp_path / "b")
    with pytest.raises(ValueError, match="last_n=0: must be an integer >= 1"):
        analysis.mean_relative_error(run_b, run_a, last_n=0)
