"""The full report (figures included) renders in headless Chromium with no broken image, offline;
loss curves from metrics JSONL with the mean relative error against bf16."""
from __future__ import annotations

import json
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
    for needed in ("distributions/hifp8/overall_density.svg", "distributions/hifp8/per_layer_density.svg",
                   "distributions/hifp8/per_rank_density.svg", "distributions/per_layer_moments.svg",
                   "distributions/hifp8/layer_rank_heatmap.svg", "quant_error/heatmap_sqnr_db_FA_linear_mxfp8.svg",
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
