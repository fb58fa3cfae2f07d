"""A resumed or validated Megatron run goes on as the uninterrupted one: stochastic-rounding seeds (torch's
generator) untouched by the data loaders and the validation, a torn metrics line dropped, the non-finite report
kept, and a fresh run that fails before its first iteration leaves no earlier metrics beside its configuration."""
from __future__ import annotations

import json
import logging

import pytest

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core", reason="needs megatron-core")

SR = "name: sr_mx\nrules:\n  - linear: {format: mxfp8, rounding: sr}\n"


def _run(tmp_path, name, *, lr=3e-3, sr=False, data=None, **train):
    from fxquant.megatron_glue.config import tiny_llama_config
    from fxquant.megatron_glue.run_config import CompileBackend, DataConfig, OptimConfig, RunConfig, TrainConfig

    optim = OptimConfig(lr=lr, min_lr=lr, warmup_iters=0, clip_grad=0.0) if lr >= 1e20 else \
        OptimConfig(lr=lr, min_lr=3e-4, warmup_iters=1)
    opts = dict(seq_length=32, micro_batch_size=2, global_batch_size=4, train_iters=4, optim=optim)
    opts.update(train)
    scheme = dict(scheme="sr_mx", scheme_yaml=SR, backend=CompileBackend.EAGER) if sr else \
        dict(backend=CompileBackend.NONE)
    return RunConfig(model=tiny_llama_config(vocab_size=257), train=TrainConfig(**opts), data=data or DataConfig(),
                     output_dir=str(tmp_path / name), **scheme)


def _losses(result):
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in result.records]


def test_a_stochastic_rounding_run_resumes_and_validates_bit_for_bit(tmp_path):
    """The data loaders drew their base seed from torch's global generator, which SR draws its seeds from: a
    resumed run (loader started after the restored RNG state) and a run that validated had other SR seeds from
    then on (losses 5.7843 vs 5.7837 at iteration 3)."""
    from fxquant.megatron_glue.train import train

    whole = train(_run(tmp_path, "whole", sr=True))
    train(_run(tmp_path, "split", sr=True, save_interval=2, control_iter=2))
    resumed = train(_run(tmp_path, "split", sr=True, save_interval=2))
    assert [r["iteration"] for r in resumed.records] == [3, 4]
    assert _losses(resumed) == _losses(whole)[2:]
    evaluated = train(_run(tmp_path, "eval", sr=True, eval_interval=2, eval_iters=1))
    assert [r["iteration"] for r in evaluated.records if "val_loss" in r] == [2, 4]
    assert _losses(evaluated) == _losses(whole)


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path, caplog):
    """A run killed while writing its metrics leaves a torn last line: the resume failed on it (JSONDecodeError
    naming no file); it lies after the checkpoint and is dropped with a warning naming file and line."""
    from fxquant.megatron_glue.train import train

    train(_run(tmp_path, "torn", save_interval=2, control_iter=3))
    metrics = tmp_path / "torn" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:2]) + "\n" + lines[2][:40])
    with caplog.at_level(logging.WARNING):
        resumed = train(_run(tmp_path, "torn", save_interval=2))
    assert f"{metrics}:3: not JSON" in caplog.text
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]
    assert [r["iteration"] for r in resumed.records] == [3, 4]


def test_a_resumed_run_keeps_the_first_non_finite_iteration(tmp_path):
    """nonfinite.json names the run's first NaN/Inf iteration: a resume replaced it by its own first one, and
    counted first_iteration / occurrences from the resume."""
    from fxquant.megatron_glue.train import train

    whole = train(_run(tmp_path, "whole", lr=1e30))
    train(_run(tmp_path, "split", lr=1e30, save_interval=2, control_iter=3))
    resumed = train(_run(tmp_path, "split", lr=1e30, save_interval=2))
    first = json.loads((tmp_path / "whole" / "nonfinite.json").read_text())["iteration"]
    assert first == 2
    assert json.loads((tmp_path / "split" / "nonfinite.json").read_text())["iteration"] == first
    events = lambda result: [(r["iteration"], r["nonfinite"]["first_iteration"], r["nonfinite"]["occurrences"])  # noqa: E731
                             for r in result.records if "nonfinite" in r]
    assert events(resumed) == events(whole)[1:] == [(3, 2, 2), (4, 2, 3)]


def test_a_report_after_the_checkpoint_is_removed_on_resume(tmp_path):
    """A nonfinite.json of an iteration after the checkpoint (trained again by the resume) is removed."""
    from fxquant.megatron_glue.train import train

    train(_run(tmp_path, "late", save_interval=2, control_iter=3))
    (tmp_path / "late" / "nonfinite.json").write_text(json.dumps({"iteration": 3, "in": ["loss"]}))
    train(_run(tmp_path, "late", save_interval=2))
    assert not (tmp_path / "late" / "nonfinite.json").exists()


def test_a_fresh_run_that_fails_before_training_leaves_no_earlier_metrics(tmp_path):
    """A run starting at iteration 0 writes its run_config.json, then failed (a corrupt dataset index) with the earlier
    run's metrics.jsonl beside it, read as this configuration's."""
    from fxquant.megatron_glue.run_config import DataConfig, DataKind
    from fxquant.megatron_glue.train import train

    train(_run(tmp_path, "run", train_iters=2))
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    prefix = tmp_path / "bad" / "bad_text_document"
    prefix.parent.mkdir()
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).write_bytes(b"not an index")
    with pytest.raises(AssertionError, match="bad header"):  # Megatron's index reader
        train(_run(tmp_path, "run", train_iters=2, data=DataConfig(DataKind.INDEXED, (str(prefix),))))
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["data"]["prefixes"] == [str(prefix)]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_resume_whose_train_split_is_built_for_more_samples_warns(tmp_path, caplog):
    """Megatron's shuffle of an indexed train split depends on the samples it is built for: a resume with a
    larger --iters on data read for more than one epoch reads its later samples in another order (some again,
    some never) than the checkpointed run; a WARNING says so, naming both counts."""
    from fxquant.megatron_glue.data import write_indexed_dataset
    from fxquant.megatron_glue.run_config import DataConfig, DataKind
    from fxquant.megatron_glue.tokenizer import ByteTokenizer
    from fxquant.megatron_glue.train import train

    prefix = tmp_path / "small" / "small_text_document"
    prefix.parent.mkdir()
    write_indexed_dataset([f"document number {i} " * 3 for i in range(40)], prefix, ByteTokenizer())
    data = DataConfig(DataKind.INDEXED, (str(prefix),), split="98,2,0", cache_dir=str(tmp_path / "cache"))
    train(_run(tmp_path, "run", train_iters=2, save_interval=2, data=data))
    with caplog.at_level(logging.WARNING):
        train(_run(tmp_path, "run", train_iters=3, save_interval=2, data=data))
    assert "the train split is built for 12 samples, the checkpointed run's for 8" in caplog.text
    assert "from iteration 3 on" in caplog.text
