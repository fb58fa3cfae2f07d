"""The NaN/Inf sentinel and --tensorboard of the training loop (Megatron-core on CPU, tiny Llama)."""
from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core", reason="needs megatron-core")

from tests.test_train_megatron import _run  # noqa: E402


def _diverging(tmp_path, name, **kw):
    from fxquant.megatron_glue.run_config import OptimConfig

    # lr 1e30 without warm-up: iteration 1 is finite, its update makes every weight huge, iteration 2 overflows
    return _run(tmp_path, name, iters=4, optim=OptimConfig(lr=1e30, min_lr=1e30, warmup_iters=0, clip_grad=0.0), **kw)


def test_sentinel_records_the_first_nonfinite_iteration_and_its_parameters(tmp_path):
    from fxquant.megatron_glue.train import train

    result = train(_diverging(tmp_path, "rec"))
    assert result.iterations == 4  # record: training goes on
    first = result.records[0]
    assert "nonfinite" not in first and first["loss"] == first["loss"]
    bad = [r for r in result.records if "nonfinite" in r]
    assert bad and bad[0]["iteration"] == 2
    ev = json.loads((tmp_path / "rec" / "nonfinite.json").read_text())
    assert ev["iteration"] == 2 and ev["first_iteration"] == 2 and ev["occurrences"] == 1
    assert set(ev["in"]) <= {"loss", "grad_norm"} and ev["in"]
    assert ev["first_site"] == (ev["grads"] or ev["values"])[0] and ev["first_site"].startswith(("embedding", "decoder"))
    assert bad[-1]["nonfinite"]["first_iteration"] == 2 and bad[-1]["nonfinite"]["occurrences"] == len(bad)
    lines = [json.loads(line) for line in (tmp_path / "rec" / "metrics.jsonl").read_text().splitlines()]
    assert [("nonfinite" in r) for r in lines] == [("nonfinite" in r) for r in result.records]
    from fxquant.megatron_glue.launch import format_progress

    assert format_progress(bad[-1], 4).endswith("| NON-FINITE (first at iteration 2)")
    assert "NON-FINITE" not in format_progress(first, 4)


def test_sentinel_names_the_first_captured_site_with_a_nonfinite_value(tmp_path):
    from fxquant.capture.reader import manifest_records
    from fxquant.megatron_glue.run_config import CaptureConfig
    from fxquant.megatron_glue.train import train

    spec = tmp_path / "stats.yaml"
    spec.write_text("sections:\n  - layers: {kinds: [qkv, proj, fc1, fc2]}\n"
                    "    points: [{component: linear, roles: [input, output, grad_output, grad_input]}]\n"
                    "    what: stats\n")
    run = _diverging(tmp_path, "cap", backend="aot_eager", train_iters=2)
    run = __import__("dataclasses").replace(run, capture=CaptureConfig(spec=str(spec)))
    result = train(run)
    ev = result.records[1]["nonfinite"]
    site = ev["first_capture_site"]
    assert site is not None and site["nan_count"] + site["inf_count"] > 0  # here: a gradient (loss stays finite)
    records = manifest_records(tmp_path / "cap" / "captures" / "rank-00000" / "manifest.jsonl")
    bad = sorted((r for r in records if r["iteration"] == 1
                  and (r["stats"]["nan_count"] or r["stats"]["inf_count"])), key=lambda r: r["seq"])
    assert bad and (site["module"], site["role"], site["seq"]) == (bad[0]["module"], bad[0]["role"], bad[0]["seq"])
    assert not any(r["stats"]["nan_count"] or r["stats"]["inf_count"] for r in records if r["iteration"] == 0)


def test_sentinel_fatal_stops_after_writing_the_iteration(tmp_path):
    from fxquant.megatron_glue.sentinel import NonFiniteError, NonFinitePolicy
    from fxquant.megatron_glue.train import train

    with pytest.raises(NonFiniteError, match="at iteration 2 .*--on-nonfinite fatal stops the run") as err:
        train(_diverging(tmp_path, "fatal", nonfinite=NonFinitePolicy.FATAL))
    assert err.value.event["iteration"] == 2
    lines = [json.loads(line) for line in (tmp_path / "fatal" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [1, 2] and "nonfinite" in lines[1]
    assert (tmp_path / "fatal" / "nonfinite.json").is_file()


@pytest.mark.dist
@pytest.mark.slow
def test_sentinel_fatal_stops_every_rank_under_torchrun_tp2(tmp_path):
    import os
    import subprocess
    import sys

    from fxquant.megatron_glue.run_config import ParallelLayout
    from fxquant.megatron_glue.sentinel import NonFinitePolicy
    from tests.test_train_megatron import REPO

    run = _diverging(tmp_path, "tp2", nonfinite=NonFinitePolicy.FATAL, layout=ParallelLayout(tp=2))
    config = tmp_path / "run.json"
    config.write_text(json.dumps(run.to_dict()))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "fxquant.megatron_glue.launch", "--config", str(config)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "FXQUANT_RESULT" not in proc.stdout
    assert out.count("--on-nonfinite fatal stops the run") >= 2, out[-3000:]  # both ranks stopped themselves
    assert "NON-FINITE (first at iteration 2)" in proc.stdout
    ev = json.loads((tmp_path / "tp2" / "nonfinite.json").read_text())
    assert ev["iteration"] == 2 and ev["rank"] == 0 and ev["first_site"]


def test_sentinel_off_and_run_config_round_trip(tmp_path):
    from fxquant.megatron_glue.run_config import RunConfig
    from fxquant.megatron_glue.sentinel import NonFinitePolicy
    from fxquant.megatron_glue.train import train

    run = _diverging(tmp_path, "off", nonfinite=NonFinitePolicy.OFF, train_iters=2)
    assert RunConfig.from_dict(json.loads(json.dumps(run.to_dict()))) == run
    result = train(run)
    assert not (tmp_path / "off" / "nonfinite.json").exists() and all("nonfinite" not in r for r in result.records)


def test_tensorboard_without_the_package_is_refused_by_name(tmp_path, capsys, monkeypatch):
    """Runs whether or not tensorboard is installed: the package is made to look absent to the check's
    ``importlib.util.find_spec`` (what ``run_config.check_tensorboard`` asks)."""
    import dataclasses

    from experiments.__main__ import main

    real_find_spec = importlib.util.find_spec

    def find_spec(name, package=None):
        return None if name.split(".")[0] == "tensorboard" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ValueError, match="--tensorboard needs the 'tensorboard' package"):
        dataclasses.replace(_run(tmp_path, "tb"), tensorboard=True)
    assert main(["run", "--model", "llama32-1b", "--tensorboard", "--dry-run"]) == 2
    assert "--tensorboard needs the 'tensorboard' package" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs the tensorboard package")
def test_tensorboard_writes_event_files(tmp_path):
    import dataclasses

    from fxquant.megatron_glue.train import train

    train(dataclasses.replace(_run(tmp_path, "tb", iters=2), tensorboard=True))
    assert list((tmp_path / "tb" / "tensorboard").glob("events.out.tfevents.*"))
