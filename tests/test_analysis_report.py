"""The report over capture sets written by the real capture writer: numbers against direct computation,
real parallel workers with identical results, per-site quantization error, CLI verbs, robustness."""
from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from fxquant import analysis, capture
from fxquant.capture import layout
from fxquant.cli import main

from tests.analysis_helpers import write_set, write_tensors

FAST = {"formats": ["hifp8", "mxfp8_e4m3", "mxfp4_e2m1", "nvfp4"], "mx_formats": ["mxfp8_e4m3"],
        "offsets": (-1, 0, 1), "sample_blocks": 16, "progress": False}


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("captures")
    sent_q = write_set(root / "mxfp8", ranks=2, layers=3)
    sent_b = write_set(root / "bf16", scheme="bf16", quantized=False, ranks=1, layers=3, seed=1)
    return root, sent_q, sent_b


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_global_statistics_equal_direct_computation(sets, tmp_path):
    root, sent_q, sent_b = sets
    res = analysis.report([root / "mxfp8", root / "bf16"], tmp_path / "r", plots=False, **FAST)
    assert res.records == 2 * len(sent_q) + len(sent_b) and res.problems == []
    st = _json(tmp_path / "r/stats/global_stats.json")["groupings"]
    hp = next(g for g in st["copy"] if g["group"]["copy"] == "hp")
    allx = torch.cat([t.reshape(-1) for t in sent_q + sent_b]).double()
    assert hp["numel"] == allx.numel() and hp["tensors"] == len(sent_q) + len(sent_b)
    assert (hp["min"], hp["max"]) == (allx.min().item(), allx.max().item())
    assert hp["mean"] == pytest.approx(allx.mean().item(), rel=1e-5, abs=1e-9)
    assert hp["std"] == pytest.approx(allx.std().item(), rel=1e-5)
    q50 = hp["quantiles"]["q0.5"]
    assert abs(q50 - allx.median().item()) <= abs(allx.median().item()) / 16 + 1e-6
    by_scheme = {g["group"]["scheme"]: g for g in st["scheme"]}
    assert set(by_scheme) == {"FA_linear_mxfp8", "bf16"} and by_scheme["bf16"]["tensors"] == len(sent_b)
    layers = {g["group"]["layer"] for g in st["layer"]}
    assert layers == {0, 1, 2} and {g["group"]["rank"] for g in st["rank"]} == {0, 1}
    assert {g["group"]["direction"] for g in st["direction"]} == {"forward", "backward"}
    text = (tmp_path / "r/stats/global_stats.txt").read_text()
    assert "== by layer ==" in text and "grad_output" in text


def test_quant_error_per_site_equals_the_tensors(sets, tmp_path):
    root, sent_q, _ = sets
    analysis.report([root / "mxfp8"], tmp_path / "r", plots=False, **FAST)
    sites = _json(tmp_path / "r/quant_error/sites.json")["sites"]
    assert len(sites) == len(sent_q) and all(s["source"] == "tensors" for s in sites)
    cs = capture.open(root / "mxfp8")
    for s in sites[:6]:
        q_rec = next(iter(cs.query(seq=s["seq"], rank=s["rank"])))
        hp_rec = next(iter(cs.query(rank=s["rank"], module=s["module"], role=s["role"], copy="hp",
                                    iteration=s["iteration"])))
        q, x = cs.load(q_rec).double().reshape(-1), cs.load(hp_rec).double().reshape(-1)
        err = q - x
        assert s["max_err"] == pytest.approx(err.abs().max().item(), rel=1e-6)
        assert s["sqnr_db"] == pytest.approx(10 * math.log10(x.square().sum() / err.square().sum()), rel=1e-5)
        assert s["mse"] == pytest.approx(err.square().mean().item(), rel=1e-5)
        assert s["cosine"] == pytest.approx((q @ x / (q.norm() * x.norm())).item(), rel=1e-6)
        assert s["saturated_pct"] == q_rec.stats["saturated_pct"]
    summary = (tmp_path / "r/quant_error/summary.txt").read_text()
    assert "mxfp8_e5m2" in summary and "dgrad" in summary


def test_workers_really_run_in_parallel_and_give_the_same_report(sets, tmp_path):
    root, _, _ = sets
    one = analysis.report([root / "mxfp8", root / "bf16"], tmp_path / "one", workers=1, plots=False, **FAST)
    two = analysis.report([root / "mxfp8", root / "bf16"], tmp_path / "two", workers=2, plots=False, **FAST)
    assert one.worker_pids == [os.getpid()]  # each process once, as report.json lists them
    assert _json(tmp_path / "two/report.json")["worker_pids"] == two.worker_pids == sorted(set(two.worker_pids))
    assert two.workers == 2  # which processes did the work depends on how fast the pool starts: next test
    assert one.files == two.files  # deterministic names
    for rel in one.files:
        if rel != "report.json":
            assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "two" / rel).read_bytes(), rel


def test_engine_runs_tasks_in_every_worker_process_once_they_are_up(sets):
    """With the pool started, the tasks are summarised in its worker processes (two of them), in parallel,
    and the merged result is the one a single process gets."""
    from fxquant.analysis import engine, plan
    from fxquant.analysis.summary import AnalysisConfig

    root, _, _ = sets
    p = plan.build([root / "mxfp8", root / "bf16"], None, 2, task_bytes=1)
    config = AnalysisConfig(("hifp8",), ("mxfp8_e4m3",), sample_blocks=4)
    merged: dict[int, list] = {1: [], 2: []}
    assert engine.run(p, config, 1, lambda r: merged[1].append(r), progress=False) == [os.getpid()] * len(p.tasks)
    pool = engine.worker_pool(2)
    try:
        assert pool.fxquant_started.wait(120)
        pids = engine.run(p, config, 2, lambda r: merged[2].append(r), progress=False, pool=pool)
    finally:
        pool.shutdown()
    assert os.getpid() not in pids and len(set(pids)) == 2
    assert [r.number for r in merged[2]] == list(range(len(p.tasks)))  # merged in plan order
    for a, b in zip(merged[1], merged[2]):
        assert [s.moments.to_dict() for s in a.summaries] == [s.moments.to_dict() for s in b.summaries]


def test_overflow_summary_and_mx_study_outputs(sets, tmp_path):
    root, _, _ = sets
    analysis.report([root / "mxfp8"], tmp_path / "r", plots=False, **FAST)
    ov = _json(tmp_path / "r/overflow/summary.json")
    names = [r["format"] for r in ov["summary"]]
    assert names == ["hifp8", "mxfp8_e4m3", "mxfp4_e2m1", "nvfp4"]
    assert next(r for r in ov["summary"] if r["format"] == "nvfp4")["method"] == "sampled blocks"
    assert {"layer", "direction", "role", "flushed_pct"} <= set(ov["by_layer_direction_role"][0])
    assert (tmp_path / "r/overflow/summary.csv").read_text().startswith("format,numel,nonzero,flushed")
    study = _json(tmp_path / "r/mx_study/study.json")
    assert {(r["scale_mode"], r["offset"]) for r in study["rows"] if r["group"] == "all"} == {
        (m, k) for m in ("floor", "rceil", "ceil", "even") for k in (-1, 0, 1)}
    assert "mxfp8_e4m3/all" in study["recommendation"]
    assert "Recommendation" in (tmp_path / "r/mx_study/study.txt").read_text()


def test_cli_verbs(sets, tmp_path, capsys):
    root, sent_q, _ = sets
    out = tmp_path / "cli"
    rc = main(["report", str(root / "mxfp8"), "--out", str(out), "-j", "1", "--no-plots", "-q",
               "--formats", "hifp8,mxfp4", "--mx-formats", "mxfp4", "--offsets", "0", "--where", "layer=0,1"])
    assert rc == 0 and (out / "index.html").is_file()
    assert _json(out / "report.json")["records"] == 2 * len(sent_q) * 2 // 3
    capsys.readouterr()
    assert main(["quant-error", str(root / "mxfp8"), "--where", "role=weight"]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "fxquant quant-error" in captured.err  # the progress bar names its verb
    assert "weight" in text and "input" not in text.split("\n", 2)[2] and "6 quantized operand(s)" in text
    assert main(["mx-sweep", str(root / "mxfp8"), "-q", "--mx-formats", "mxfp4_e2m1", "--offsets=-1,0"]) == 0
    assert "recommended for mxfp4_e2m1" in capsys.readouterr().out
    for argv in (["quant-error", "--formats", "hifp8"], ["quant-error", "--sample-blocks", "4"],
                 ["mx-sweep", "--formats", "hifp8"], ["mx-sweep", "--sample-blocks", "0"]):
        with pytest.raises(SystemExit):  # an option the verb does not use, or no study at all: refused
            main([argv[0], str(root / "mxfp8"), *argv[1:]])
    assert main(["report", "--out", str(out)]) == 2  # nothing to report: a clear error, not a traceback
    assert main(["report", str(root / "mxfp8"), "--formats", "mxfp9", "-q", "--out", str(out)]) == 2
    assert "did you mean" in capsys.readouterr().err


def test_cli_verbs_refuse_missing_and_empty_directories(tmp_path, capsys):
    missing, empty = tmp_path / "nowhere", tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(missing), "--out", str(tmp_path / "r1"), "-q"]) == 2
    assert f"capture directory not found: {missing}" in capsys.readouterr().err
    assert not (tmp_path / "r1").exists()
    assert main(["report", str(empty), "--out", str(tmp_path / "r2"), "-q"]) == 1
    err = capsys.readouterr().err
    assert "holds no rank-NNNNN directories" in err and f"no capture records in {empty}" in err
    for verb in ("quant-error", "mx-sweep"):  # exit 1, as report and docs/analysis.md (they exited 2)
        assert main([verb, str(empty), "-q"]) == 1
        assert f"fxquant {verb}: error: no capture records in {empty}" in capsys.readouterr().err


def test_robust_to_degenerate_tensors_and_an_empty_set(tmp_path):
    tensors = [torch.zeros(4, 64), torch.full((4, 64), math.nan), torch.tensor([[math.inf, -math.inf] * 32]),
               torch.randn(1, 3), torch.tensor(2.5)]
    write_tensors(tmp_path / "odd", tensors)
    res = analysis.report([tmp_path / "odd"], tmp_path / "r", **{**FAST, "formats": ["hifp8", "mxfp4_e2m1"]})
    assert res.records == 5 and res.problems == []
    st = {g["group"]["layer"]: g for g in _json(tmp_path / "r/stats/global_stats.json")["groupings"]["layer"]}
    assert st[0]["zero_fraction"] == 1.0 and st[0]["std"] == 0.0
    assert st[1]["nan"] == 256 and st[1]["mean"] is None and st[1]["quantiles"]["q0.5"] is None
    assert st[2]["inf"] == 64 and st[2]["min"] is None
    assert st[4]["numel"] == 1 and st[4]["min"] == 2.5
    # an empty capture set (a session that captured nothing) and a single tensor
    write_tensors(tmp_path / "empty", [])
    res = analysis.report([tmp_path / "empty"], tmp_path / "e", **FAST)
    assert res.records == 0 and (tmp_path / "e/index.html").is_file()
    write_tensors(tmp_path / "one", [torch.randn(8, 32)])
    res = analysis.report([tmp_path / "one"], tmp_path / "o", workers=2, plots=False, **FAST)
    assert res.records == 1 and res.tensors == 1


def test_newer_schema_version_and_hostile_files_are_skipped_with_a_reason(tmp_path):
    write_tensors(tmp_path / "new", [torch.randn(4, 32)])
    run_json = tmp_path / "new/rank-00000" / layout.RUN_INFO
    info = json.loads(run_json.read_text())
    info["format_version"] = layout.FORMAT_VERSION + 1
    run_json.write_text(json.dumps(info))  # hand-edited on purpose: a file from a newer fxquant
    write_tensors(tmp_path / "ok", [torch.randn(4, 32), torch.randn(4, 32)])
    write_tensors(tmp_path / "evil", [torch.randn(4, 32), torch.randn(4, 32)])
    shard = next((tmp_path / "evil/rank-00000/shards").glob("*.safetensors"))

    class Boom:  # unpickling this would run code: the reader must refuse the file instead
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    shard.write_bytes(pickle.dumps(Boom()))
    manifest = tmp_path / "evil/rank-00000" / layout.MANIFEST
    rec = json.loads(manifest.read_text().splitlines()[0])  # hand-crafted hostile records, on purpose
    outside = tmp_path / "outside.safetensors"
    shutil.copy(next((tmp_path / "ok/rank-00000/shards").glob("*.safetensors")), outside)
    hostile = [{**rec, "seq": 90, "file": "../../outside.safetensors", "layer": [1, 2]},
               {**rec, "seq": 91, "stats": [1, 2], "key": None},
               {**rec, "seq": 92, "stats": None, "key": None, "layer": [1, 2]}]
    with open(manifest, "a") as f:
        f.writelines(layout.record_line(r) for r in hostile)  # valid crcs: crafted, not changed
    (tmp_path / "junk").mkdir()
    res = analysis.report([tmp_path / "new", tmp_path / "ok", tmp_path / "evil", tmp_path / "junk"],
                          tmp_path / "r", workers=2, plots=False, **FAST)
    assert not (tmp_path / "pwned").exists()
    assert res.tensors == 2  # only the readable set
    text = "\n".join(res.problems)
    assert "newer capture format" in text and "pickle" in text and "junk" in text
    assert "outside its rank directory" in text and "seq=91" in text and "seq=92" not in text
    assert "Problems" in (tmp_path / "r/index.html").read_text()


def test_a_rank_with_a_corrupt_manifest_is_left_out_and_the_other_ranks_still_count(tmp_path, capsys):
    """A manifest line corrupted before the last one: that rank's records are left out and said so (report,
    verify); the other rank's records are analysed; a torn last line elsewhere is listed too. Strict open
    (capture.open without skip_bad_ranks) still refuses the set."""
    write_set(tmp_path / "s", layers=1, ranks=2)
    manifest = tmp_path / "s/rank-00000" / layout.MANIFEST
    lines = manifest.read_text().splitlines()
    rank1 = len((tmp_path / "s/rank-00001" / layout.MANIFEST).read_text().splitlines())
    lines[1] = lines[1][:25]  # damaged in place, as a bad disk or a hand edit leaves it
    manifest.write_text("\n".join(lines) + "\n")
    torn = tmp_path / "s/rank-00001" / layout.MANIFEST
    torn.write_bytes(torn.read_bytes()[:-20])
    with pytest.raises(capture.CaptureReadError, match="manifest.jsonl:2: corrupt manifest line"):
        capture.open(tmp_path / "s")
    res = analysis.report([tmp_path / "s"], tmp_path / "r", plots=False, **FAST)
    assert res.records == rank1 - 1  # rank 1 without its torn last line
    text = "\n".join(res.problems)
    assert "rank-00000 (all its records)" in text and "manifest.jsonl:2" in text
    assert "rank-00001: 1 torn manifest line(s)" in text
    assert main(["capture", "verify", str(tmp_path / "s")]) == 1
    err = capsys.readouterr().err
    assert "rank-00000: unreadable, its records left out" in err and "rank-00001: 1 torn manifest line(s)" in err


@pytest.mark.parametrize("fmt", ["mxfp4_e2m1", "mxfp8_e4m3:scale_mode=rceil", "hifp8", "mxint8"])
def test_clip_percentages_without_capture_statistics_match_the_reference(tmp_path, fmt):
    """what: full (no capture-time statistics): saturated/flushed % come from the histograms (floor MX,
    element formats) or the reference (other scale rules) and equal the capture's own statistics."""
    from fxquant.capture import stats as capture_stats
    from fxquant.formats.tensor_quant import TensorQuant

    write_set(tmp_path / "c", ranks=1, layers=2, what="full", fmt=fmt, shape=(2, 8, 96))
    analysis.report([tmp_path / "c"], tmp_path / "r", plots=False, **FAST)
    sites = _json(tmp_path / "r/quant_error/sites.json")["sites"]
    cs = capture.open(tmp_path / "c")
    assert len(sites) == 6
    for s in sites:
        q_rec = next(iter(cs.query(seq=s["seq"])))
        hp = cs.load(next(iter(cs.query(module=s["module"], role=s["role"], copy="hp"))))
        tq = TensorQuant.from_spec(q_rec.qspec)
        ref = capture_stats.compute(cs.load(q_rec), hp.reshape(q_rec.shape), tq, q_rec.blocked_dim)
        assert s["saturated_pct"] == pytest.approx(ref["saturated_pct"], abs=1e-9)
        assert s["flushed_pct"] == pytest.approx(ref["flushed_pct"], abs=1e-9)


def test_where_matching_no_record_is_said_and_skipped_sets_are_reported_once(sets, tmp_path, capsys, caplog):
    """`--where` that matches nothing says so (no "see the warnings above" when there are none); a skipped
    DIR is printed once (the plan logs it at INFO only; the CLI prints the problem)."""
    import logging

    root, _, _ = sets
    assert main(["report", str(root / "mxfp8"), "--where", "role=bogus", "-o", str(tmp_path / "r"), "-q",
                 "--no-plots"]) == 1
    err = capsys.readouterr().err
    assert f"error: no capture records in {root / 'mxfp8'} match --where role=bogus: nothing to analyse" in err
    assert "see the warnings above" not in err
    assert main(["quant-error", str(root / "mxfp8"), "--where", "layer=7", "-q"]) == 1
    assert "match --where layer=7" in capsys.readouterr().err
    (tmp_path / "junk").mkdir()
    with caplog.at_level(logging.INFO):
        assert main(["report", str(root / "bf16"), str(tmp_path / "junk"), "-o", str(tmp_path / "r2"), "-q",
                     "--no-plots"]) == 0
    assert capsys.readouterr().err.count(f"{tmp_path / 'junk'}: skipped") == 1
    assert [r.levelname for r in caplog.records if "skipped" in r.getMessage()] == ["INFO"]


def test_capture_ls_and_export_where_take_any_of_several_values_as_report_does(sets, tmp_path, capsys):
    root, sent_q, _ = sets
    assert main(["capture", "ls", str(root / "mxfp8"), "--json", "--where", "role=input,weight",
                 "--where", "copy=hp"]) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(recs) == 2 * len(sent_q) // 3 and {r["role"] for r in recs} == {"input", "weight"}
    assert main(["capture", "export-pt", str(root / "mxfp8"), str(tmp_path / "pt"), "--where", "layer=0,2",
                 "--where", "copy=hp"]) == 0
    assert f"wrote {2 * len(sent_q) // 3} .pt files" in capsys.readouterr().out
    assert main(["capture", "ls", str(root / "mxfp8"), "--where", "role"]) == 2
    assert "expected FIELD=VALUE or FIELD=V1,V2" in capsys.readouterr().err


@pytest.mark.parametrize("quantized_first", [False, True])
def test_a_site_called_twice_per_step_pairs_each_quantized_copy_with_its_own_call(tmp_path, quantized_first):
    """One module called twice in one step (shared weights, recompute): each call writes its high-precision
    record and quantized copy (in either order within the call); each copy is scored against its own call's
    tensor, not the first call's."""
    from fxquant.capture.runtime import RankInfo
    from fxquant.capture.spec import Component, Copy, Gemm, ModuleKind, Role
    from fxquant.capture.tap import Tap
    from fxquant.formats.tensor_quant import TensorQuant
    from tests.analysis_helpers import spec

    g = torch.Generator().manual_seed(3)
    calls = [torch.randn(16, 64, generator=g), 100 * torch.randn(16, 64, generator=g) + 50]
    tq = TensorQuant.from_spec("mxfp8_e4m3")
    module = "decoder.layers.0.mlp.linear_fc1"
    hp = Tap(Component.LINEAR, Role.INPUT, module, (0,), ModuleKind.FC1, 0)
    qt = Tap(Component.LINEAR, Role.INPUT, module, (0,), ModuleKind.FC1, 0, copy=Copy.QUANTIZED,
             gemm=Gemm.FPROP, qspec=tq.spec(), dim=-1)
    with capture.start(spec("full"), tmp_path / "c", scheme="s", rank=RankInfo(0, 1), run_id="r") as s:
        s.set_iteration(0)
        for x in calls:
            writes = [lambda: torch.ops.fxquant.capture(x, hp.encode()),
                      lambda: torch.ops.fxquant.capture(tq.quantize(x, -1), qt.encode(), x)]
            for w in (writes[::-1] if quantized_first else writes):
                w()
    analysis.report([tmp_path / "c"], tmp_path / "r", plots=False, **FAST)
    sites = sorted(_json(tmp_path / "r/quant_error/sites.json")["sites"], key=lambda s: s["seq"])
    assert len(sites) == 2
    for s, x in zip(sites, calls):
        x = x.double()
        err = tq.quantize(x.float(), -1).double() - x
        assert s["sqnr_db"] == pytest.approx(10 * math.log10(x.square().sum() / err.square().sum()), rel=1e-6)
        assert s["max_err"] == pytest.approx(err.abs().max().item(), rel=1e-6)


SAMPLED_SPEC = """\
sections:
  - name: all
    points: [{component: linear}]
    when: {iterations: {start: 0, end: 100}}
    what: both
    sampling: {first_rows: 2}
"""


def test_sampled_records_take_whole_tensor_moments_and_label_sampled_quantiles(tmp_path):
    """Only the first 2 rows stored (all zero), capture-time statistics of all 64: the moments and the exponent
    histogram describe the whole tensor; the quantiles say they cover the 128 stored elements only."""
    from fxquant.analysis import summary
    from fxquant.capture.runtime import RankInfo
    from fxquant.capture.spec import Component, ModuleKind, Role
    from fxquant.capture.tap import Tap

    x = torch.cat([torch.zeros(2, 64), 1000 + torch.randn(62, 64, generator=torch.Generator().manual_seed(0))])
    spec = capture.load_spec("s.yaml", text=SAMPLED_SPEC)
    with capture.start(spec, tmp_path / "c", scheme="bf16", rank=RankInfo(0, 1), run_id="r") as s:
        s.set_iteration(0)
        tap = Tap(Component.LINEAR, Role.INPUT, "decoder.layers.0.mlp.linear_fc1", (0,), ModuleKind.FC1, 0)
        torch.ops.fxquant.capture(x, tap.encode())
    analysis.report([tmp_path / "c"], tmp_path / "r", plots=False, **FAST)
    st = _json(tmp_path / "r/stats/global_stats.json")
    g = st["groupings"]["overall"][0]
    xd = x.double()
    assert g["numel"] == 4096 and g["zero_fraction"] == 128 / 4096
    assert g["mean"] == pytest.approx(xd.mean().item(), rel=1e-9)
    assert g["std"] == pytest.approx(xd.std().item(), rel=1e-6) and g["amax"] == xd.abs().max().item()
    assert (g["histogram_numel"], g["sampled_tensors"]) == (128, 1) and "sampled" in st["quantile_coverage"]
    assert "* quantiles over stored sampled rows" in (tmp_path / "r/stats/global_stats.txt").read_text()
    cs = capture.open(tmp_path / "c")
    rec = next(iter(cs))
    config = summary.AnalysisConfig(("hifp8",), ("mxfp8_e4m3",), sample_blocks=0)
    s = summary.summarize(0, rec.fields, cs.load(rec), config)
    binade = summary.dense(s.binade, 256)
    assert s.sampled and binade.sum() == 4096 and binade[127 + 9] == 62 * 64  # every |x| in [512, 1024)


@pytest.mark.parametrize("what", ["both", "stats"])
def test_quant_error_summary_pools_sqnr_over_sites_lossless_ones_included(tmp_path, what):
    """Three operands, the first exactly representable (SQNR inf): the summary's SQNR is the pooled
    10 log10(sum x^2 / sum e^2) over all three, from the tensors or from the capture-time statistics alone,
    not the mean of the two finite ones."""
    from fxquant.capture.runtime import RankInfo
    from fxquant.capture.spec import Component, Copy, Gemm, ModuleKind, Role
    from fxquant.capture.tap import Tap
    from fxquant.formats.tensor_quant import TensorQuant
    from tests.analysis_helpers import spec

    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(-8, 8, (16, 64), generator=g).float(), torch.randn(16, 64, generator=g),
          3 * torch.randn(16, 64, generator=g)]
    tq = TensorQuant.from_spec("mxfp8_e4m3")
    with capture.start(spec(what), tmp_path / "c", scheme="s", rank=RankInfo(0, 1), run_id="r") as s:
        s.set_iteration(0)
        for layer, x in enumerate(xs):
            m = f"decoder.layers.{layer}.mlp.linear_fc1"
            torch.ops.fxquant.capture(x, Tap(Component.LINEAR, Role.INPUT, m, (0,), ModuleKind.FC1, layer).encode())
            tap = Tap(Component.LINEAR, Role.INPUT, m, (0,), ModuleKind.FC1, layer, copy=Copy.QUANTIZED,
                      gemm=Gemm.FPROP, qspec=tq.spec(), dim=-1)
            torch.ops.fxquant.capture(tq.quantize(x, -1), tap.encode(), x)
    analysis.report([tmp_path / "c"], tmp_path / "r", **FAST)
    d = _json(tmp_path / "r/quant_error/sites.json")
    assert [s["source"] for s in d["sites"]] == ["tensors" if what == "both" else "manifest"] * 3
    assert d["sites"][0]["sqnr_db"] == "inf"
    e2 = sum((tq.quantize(x, -1).double() - x.double()).square().sum().item() for x in xs)
    r2 = sum(x.double().square().sum().item() for x in xs)
    row = d["summary"][0]
    assert row["sqnr_db_pooled"] == pytest.approx(10 * math.log10(r2 / e2), rel=1e-6)
    assert row["lossless_sites"] == 1 and row["operands"] == 3
    assert "pooled over captures" in (tmp_path / "r/quant_error/heatmap_sqnr_db_s.svg").read_text()


def test_quant_error_of_an_export_pt_directory_equals_that_of_its_capture_set(tmp_path, capsys):
    """export-pt keeps each quantized copy's blocked dim: its saturated/flushed % are those of the capture set
    (a wgrad copy, blocked along dim 0, was scored as blocked along the last dim)."""
    import fxquant

    torch.manual_seed(0)
    spec = capture.load_spec("q.yaml", text="sections: [{name: q, points: [{component: linear, roles: [input, "
                                            "grad_output], copies: [hp, quantized]}]}]\n")
    model = fxquant.compile(torch.nn.Sequential(torch.nn.Linear(64, 64)), "linear_mxfp8", backend="aot_eager",
                            capture=spec, capture_dir=tmp_path / "set")
    (model(torch.randn(64, 64) * torch.logspace(-3, 3, 64)) ** 2).sum().backward()
    fxquant.compile_state(model).capture_session.close()
    assert main(["capture", "export-pt", str(tmp_path / "set"), str(tmp_path / "pt")]) == 0
    capsys.readouterr()
    rows = {}
    for name, d in (("set", tmp_path / "set"), ("pt", tmp_path / "pt")):
        assert main(["quant-error", str(d), "--json", "-q"]) == 0
        rows[name] = sorted((r["module"], r["role"], r["gemm"], r["saturated_pct"], r["flushed_pct"])
                            for r in map(json.loads, capsys.readouterr().out.splitlines()))
    assert rows["pt"] == rows["set"] and any(r[2] == "wgrad" for r in rows["set"])


def test_mx_sweep_without_stored_operands_says_so(tmp_path, capsys):
    from tests.analysis_helpers import write_tensors

    write_tensors(tmp_path / "stats", [torch.randn(4, 64)], what="stats")
    assert main(["mx-sweep", str(tmp_path / "stats"), "-q"]) == 1
    assert "no MX study rows" in capsys.readouterr().err
    assert main(["mx-sweep", str(tmp_path / "stats"), "-q", "--offsets="]) == 2
    assert "give at least one exponent offset" in capsys.readouterr().err


def test_an_output_path_that_is_a_file_fails_before_any_tensor_is_read(sets, tmp_path, monkeypatch):
    """`-o` naming a file: the same error as before, but before the analysis (it came after all of it)."""
    from fxquant.analysis import engine

    root, _, _ = sets
    (tmp_path / "afile").write_text("not a directory")
    monkeypatch.setattr(engine, "run", lambda *a, **k: pytest.fail("tensors analysed before the output was checked"))
    with pytest.raises(FileExistsError) as exc:
        analysis.report([root / "mxfp8"], tmp_path / "afile", **FAST)
    assert exc.value.strerror == "File exists" and exc.value.filename == str(tmp_path / "afile")


def test_a_reused_output_directory_keeps_only_this_reports_files(sets, tmp_path):
    """A report written where an earlier one was removes the earlier files it does not write itself (a second
    rank's pages, formats no longer analysed) and the directories left empty; files the earlier report.json does
    not list (the user's) stay, and so does anything a listed path names outside the directory."""
    root, _, _ = sets
    out = tmp_path / "r"
    first = analysis.report([root / "mxfp8"], out, **FAST)  # 2 ranks, quantized copies
    assert {"layers/layer_0_rank_1_analysis.svg", "distributions/mxfp4_e2m1/summary.json"} <= set(first.files)
    (out / "notes.txt").write_text("mine")
    (out / "layers" / "mine.svg").write_text("<svg/>")
    second = analysis.report([root / "bf16"], out, **{**FAST, "formats": ["hifp8"]})  # 1 rank, hp only
    on_disk = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert on_disk == sorted([*second.files, "index.html", "notes.txt", "layers/mine.svg"])
    assert not (out / "distributions" / "mxfp4_e2m1").exists()  # emptied: removed
    assert _json(out / "report.json")["files"] == second.files[:-1]  # all but report.json itself

    victim = tmp_path / "victim.txt"
    victim.write_text("not the report's")
    manifest = _json(out / "report.json")
    manifest["files"] += ["../victim.txt", str(victim), "notes.txt/..", "layers"]  # hand-edited: hostile paths
    (out / "report.json").write_text(json.dumps(manifest))
    analysis.report([root / "bf16"], out, **{**FAST, "formats": ["hifp8"]})
    assert victim.read_text() == "not the report's" and (out / "notes.txt").is_file() and (out / "layers").is_dir()
    (out / "report.json").write_text("{not json")
    analysis.report([root / "bf16"], out, **{**FAST, "formats": ["hifp8"]})  # an unreadable manifest: nothing removed
    assert (out / "layers" / "mine.svg").is_file()


def test_a_report_with_the_mx_study_turned_off_says_so(sets, tmp_path):
    """--sample-blocks 0 turns the MX study off (docs/analysis.md): study.txt says that, not that the capture held
    no high-precision GEMM operands (which it does: the same set studied otherwise)."""
    root, _, _ = sets
    off = dict(FAST, sample_blocks=0)
    analysis.report([root / "mxfp8"], tmp_path / "off", plots=False, **off)
    assert (tmp_path / "off/mx_study/study.txt").read_text().strip() == "the MX study is turned off (--sample-blocks 0)"
    analysis.report([root / "mxfp8"], tmp_path / "on", plots=False, **dict(FAST, sample_blocks=4))
    assert (tmp_path / "on/mx_study/study.txt").read_text().startswith("Recommendation")


def test_mx_study_max_error_is_the_largest_over_tensors_not_their_sum(tmp_path, capsys):
    """The same tensor stored once or three times: the study's max |q - x| is the reference's, every time."""
    from fxquant.formats.tensor_quant import TensorQuant

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    true = (TensorQuant.from_spec("mxfp4_e2m1").quantize(x, -1) - x).abs().max().item()
    for copies in (1, 3):
        write_tensors(tmp_path / str(copies), [x.clone() for _ in range(copies)])
        assert main(["mx-sweep", str(tmp_path / str(copies)), "--mx-formats", "mxfp4", "--offsets=0", "--json",
                     "-q"]) == 0
        rows = json.loads(capsys.readouterr().out)["rows"]
        row = next(r for r in rows if r["scale_mode"] == "floor" and r["group"] == "all")
        assert row["max_err"] == pytest.approx(true, rel=1e-6) and row["n"] == copies * x.numel()


@pytest.mark.parametrize("what", ["both", "full"])
def test_quantization_error_of_a_sampled_copy(tmp_path, what):
    """Only the first 2 rows of a 64-row operand stored: with capture statistics (what: both) the site's error is
    the whole tensor's, as its saturation is (the report mixed the 2 rows' SQNR with the whole tensor's saturation);
    without them (what: full) it is the rows', and says so."""
    from fxquant.capture.runtime import RankInfo
    from fxquant.capture.spec import Component, Copy, Gemm, ModuleKind, Role
    from fxquant.capture.tap import Tap
    from fxquant.formats.tensor_quant import TensorQuant

    spec = capture.load_spec("s.yaml", text="sections:\n  - name: all\n    points: [{component: linear, copies: "
                                            f"[hp, quantized]}}]\n    what: {what}\n    sampling: {{first_rows: 2}}\n")
    x = torch.cat([torch.zeros(2, 64), 1000 + torch.randn(62, 64, generator=torch.Generator().manual_seed(0))])
    x[0, :32] = torch.randn(32, generator=torch.Generator().manual_seed(1)) * 1e-3
    tq = TensorQuant.from_spec("mxfp4_e2m1")
    q = tq.quantize(x, -1)
    base = (Component.LINEAR, Role.INPUT, "layers.0.mlp.fc1", (0,), ModuleKind.FC1, 0)
    with capture.start(spec, tmp_path / "cap", scheme="s", rank=RankInfo(0, 1), run_id="r"):
        torch.ops.fxquant.capture(x, Tap(*base).encode())
        torch.ops.fxquant.capture(q, Tap(*base, copy=Copy.QUANTIZED, gemm=Gemm.FPROP, qspec=tq.spec(), dim=-1).encode(), x)
    analysis.report([tmp_path / "cap"], tmp_path / "r", plots=False, **FAST)
    (site,) = _json(tmp_path / "r/quant_error/sites.json")["sites"]
    if what == "both":
        e2, r2 = (q.double() - x.double()).square().sum().item(), x.double().square().sum().item()
        assert site["source"] == "manifest" and site["sqnr_db"] == pytest.approx(10 * math.log10(r2 / e2), rel=1e-4)
        assert site["mse"] == pytest.approx(e2 / x.numel(), rel=1e-4)
    else:
        rows_q, rows_x = q[:2].double(), x[:2].double()
        e2, r2 = (rows_q - rows_x).square().sum().item(), rows_x.square().sum().item()
        assert site["source"] == "tensors (sampled rows)"
        assert site["sqnr_db"] == pytest.approx(10 * math.log10(r2 / e2), rel=1e-6)


def test_flush_counts_where_mx_block_scales_clamp_at_2_pow_minus_127(tmp_path):
    """Blocks whose amax lies below 2**(emax - 127) have their E8M0 scale clamped (FORMATS.md) and flush more than
    the floor rule's block-relative bins say: the count is a lower bound then, with the upper bound beside it, and
    the reference quantizer's count lies between; a tensor without such elements stays exact."""
    from fxquant.formats.tensor_quant import TensorQuant

    g = torch.Generator().manual_seed(0)
    tiny = torch.randn(8, 64, generator=g) * 2.0 ** -122 * 2.0 ** -(torch.arange(64) % 32).float()
    write_tensors(tmp_path / "tiny", [tiny])
    write_tensors(tmp_path / "normal", [torch.randn(8, 64, generator=g)])
    for name in ("tiny", "normal"):
        analysis.report([tmp_path / name], tmp_path / f"r_{name}", plots=True, **FAST)
    rows = {r["format"]: r for r in _json(tmp_path / "r_tiny/overflow/summary.json")["summary"]}
    for fmt in ("mxfp8_e4m3", "mxfp4_e2m1"):
        true = int(((tiny != 0) & (TensorQuant.from_spec(fmt).quantize(tiny, -1) == 0)).sum())
        r = rows[fmt]
        assert r["flushed"] <= true <= r["flushed_at_most"] and r["flushed"] < true, (fmt, r, true)
        assert "flushed is a lower bound" in r["method"]
    normal = {r["format"]: r for r in _json(tmp_path / "r_normal/overflow/summary.json")["summary"]}
    assert normal["mxfp8_e4m3"]["method"] == "floor block scale, exact" and "flushed_at_most" not in normal["mxfp8_e4m3"]
    page = _json(tmp_path / "r_tiny/distributions/mxfp8_e4m3/summary.json")["counts"]["flushed"]
    assert page.startswith("lower bound: ")
    assert _json(tmp_path / "r_normal/distributions/mxfp8_e4m3/summary.json")["counts"]["flushed"] == "exact"


# -- a report over tensors built for its numbers: two schemes, stored tensors (what: full, no capture-time stats) --
def _table_rows(text: str, title: str | None = None) -> list[dict[str, str]]:
    """The rows of a tabulate "simple" table (the one under ``== by TITLE ==`` when given) as {header: cell};
    headers are split on runs of 2+ spaces ("zero frac"), data rows on any space (no cell holds one)."""
    if title is not None:
        text = text.split(f"== by {title} ==\n", 1)[1].split("\n\n", 1)[0]
    lines = text.splitlines()
    heads = re.split(r"\s{2,}", lines[0].strip())
    assert set(lines[1]) <= {"-", " "}, lines[1]
    rows = [line.split() for line in lines[2:]]
    assert all(len(cells) == len(heads) for cells in rows), (heads, rows)
    return [dict(zip(heads, cells)) for cells in rows]


@pytest.fixture(scope="module")
def known(tmp_path_factory):
    """Scheme "sa": layer 0 holds a NaN, 16 zeros and its largest magnitude in a negative value (-50); layers 1 and 2
    also store their mxfp8_e4m3 copies, layer 2's error 10x layer 1's. Scheme "sb": layer 9, mean 3, std 0.5. One
    report over both, with plots (compare/schemes.txt is written with them)."""
    from fxquant.capture.runtime import RankInfo
    from fxquant.capture.spec import Component, Copy, Gemm, ModuleKind, Role
    from fxquant.capture.tap import Tap
    from fxquant.formats.tensor_quant import TensorQuant
    from tests.analysis_helpers import spec

    root = tmp_path_factory.mktemp("known")
    g = torch.Generator().manual_seed(5)
    t0 = 2 * torch.randn(4, 64, generator=g)
    t0[0, 0], t0[1, :16], t0[2, 5] = -50.0, 0.0, math.nan
    xs = {"sa": {0: t0, 1: torch.randn(4, 64, generator=g), 2: 10 * torch.randn(4, 64, generator=g)},
          "sb": {9: 3 + 0.5 * torch.randn(4, 64, generator=g)}}
    tq = TensorQuant.from_spec("mxfp8_e4m3")
    for scheme, tensors in xs.items():
        with capture.start(spec("full"), root / scheme, scheme=scheme, rank=RankInfo(0, 1), run_id=scheme) as cap:
            cap.set_iteration(0)
            for layer, x in tensors.items():
                m = f"decoder.layers.{layer}.mlp.linear_fc1"
                torch.ops.fxquant.capture(x, Tap(Component.LINEAR, Role.INPUT, m, (0,), ModuleKind.FC1, layer).encode())
                if layer in (1, 2):
                    qt = Tap(Component.LINEAR, Role.INPUT, m, (0,), ModuleKind.FC1, layer, copy=Copy.QUANTIZED,
                             gemm=Gemm.FPROP, qspec=tq.spec(), dim=-1)
                    torch.ops.fxquant.capture(tq.quantize(x, -1), qt.encode(), x)
    out = root / "r"
    res = analysis.report([root / "sa", root / "sb"], out, plots=True, **FAST)
    assert res.problems == [] and res.records == 6
    return out, xs, tq


def test_global_statistics_of_a_stored_tensor_with_nan_count_zeros_of_all_elements_and_moments_of_the_finite(known):
    """zero_fraction is zeros / numel (NaN included in numel), mean and std are over the finite elements only."""
    out, xs, _ = known
    layer = {g["group"]["layer"]: g for g in _json(out / "stats/global_stats.json")["groupings"]["layer"]}[0]
    t0 = xs["sa"][0]
    finite = t0[torch.isfinite(t0)].double()
    assert (layer["numel"], layer["finite"], layer["nan"], layer["inf"]) == (256, 255, 1, 0)
    assert layer["zero_fraction"] == 16 / 256
    assert layer["mean"] == pytest.approx(finite.mean().item(), rel=1e-9)
    assert layer["std"] == pytest.approx(finite.std().item(), rel=1e-9)


def test_amax_of_a_stored_tensor_whose_largest_magnitude_is_negative(known):
    """Without capture-time statistics amax comes from the stored tensor: max(|min|, |max|), here |-50|."""
    out, xs, _ = known
    layer = {g["group"]["layer"]: g for g in _json(out / "stats/global_stats.json")["groupings"]["layer"]}[0]
    t0 = xs["sa"][0]
    assert layer["min"] == -50.0 and layer["max"] == t0.nan_to_num(nan=-1.0).max().item() < 50
    assert layer["amax"] == 50.0


def test_global_stats_text_columns_hold_the_json_values(known):
    """Each column of stats/global_stats.txt (by layer) is the JSON's value under that header, min and max not
    swapped."""
    from fxquant.analysis.outputs import fmt_num

    out, _, _ = known
    groups = {str(g["group"]["layer"]): g for g in _json(out / "stats/global_stats.json")["groupings"]["layer"]}
    rows = {r["layer"]: r for r in _table_rows((out / "stats/global_stats.txt").read_text(), "layer")}
    assert set(rows) == set(groups) == {"0", "1", "2", "9"}
    for label, g in groups.items():
        row = rows[label]
        assert row["min"] != row["max"]
        for col, key in (("min", "min"), ("max", "max"), ("mean", "mean"), ("std", "std"), ("amax", "amax"),
                         ("zero frac", "zero_fraction"), ("numel", "numel"), ("nan", "nan")):
            assert row[col] == fmt_num(g[key]), (label, col, row, g)


def test_compare_schemes_text_columns_hold_each_schemes_moments(known):
    """compare/schemes.txt: per scheme and site, mean and std (not swapped) of the finite elements of its tensors."""
    out, xs, _ = known
    rows = [r for r in _table_rows((out / "compare/schemes.txt").read_text()) if r["copy"] == "hp"]
    assert sorted(r["scheme"] for r in rows) == ["sa", "sb"]
    for row in rows:
        allx = torch.cat([t.reshape(-1) for t in xs[row["scheme"]].values()]).double()
        allx = allx[torch.isfinite(allx)]
        assert float(row["mean"]) == pytest.approx(allx.mean().item(), rel=1e-3, abs=1e-4), row
        assert float(row["std"]) == pytest.approx(allx.std().item(), rel=1e-3, abs=1e-4), row
        assert float(row["amax"]) == pytest.approx(allx.abs().max().item(), rel=1e-3), row


def test_quant_error_summary_max_err_is_the_largest_of_its_sites(known):
    """The summary row of two sites (layers 1 and 2, the second 10x larger) carries the larger max |q - x|."""
    out, xs, tq = known
    d = _json(out / "quant_error/sites.json")
    assert len(d["sites"]) == 2 and len(d["summary"]) == 1
    want = [(tq.quantize(x, -1).double() - x.double()).abs().max().item() for x in (xs["sa"][1], xs["sa"][2])]
    assert want[1] > 2 * want[0]
    assert sorted(s["max_err"] for s in d["sites"]) == pytest.approx(sorted(want), rel=1e-6)
    assert d["summary"][0]["max_err"] == pytest.approx(want[1], rel=1e-6)


def test_overflow_percentages_divide_flushed_by_nonzero_and_saturated_by_all_elements(known):
    """flushed_pct = 100 flushed / nonzero, saturated_pct = 100 saturated / numel, in the summary and per layer.
    mxfp4_e2m1's counts are the reference quantizer's: of 1024 elements, 976 non-zero (16 zeros, and the 32 of the
    block holding the NaN apart), 86 of them flushed: the two denominators differ."""
    from fxquant.formats.tensor_quant import TensorQuant

    out, xs, _ = known
    ov = _json(out / "overflow/summary.json")
    tq = TensorQuant.from_spec("mxfp4_e2m1")
    nonzero = flushed = 0
    for x in (x for tensors in xs.values() for x in tensors.values()):
        q = tq.quantize(x, -1)
        good = torch.isfinite(q) & (x != 0)
        nonzero, flushed = nonzero + int(good.sum()), flushed + int((good & (q == 0)).sum())
    row = next(r for r in ov["summary"] if r["format"] == "mxfp4_e2m1")
    assert (row["numel"], row["nonzero"], row["flushed"]) == (1024, nonzero, flushed) == (1024, 976, 86)
    assert row["flushed_pct"] == pytest.approx(100 * 86 / 976, rel=1e-12) and row["saturated"] > 0
    for r in ov["summary"] + ov["by_layer_direction_role"]:
        assert r["flushed_pct"] == pytest.approx(100 * r["flushed"] / r["nonzero"], rel=1e-12), r
        assert r["saturated_pct"] == pytest.approx(100 * r["saturated"] / r["numel"], rel=1e-12), r
