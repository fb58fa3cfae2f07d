"""Validation loss inside the Megatron training loop: when it runs, what it records, and that it changes nothing else."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core", reason="needs megatron-core")


def _run(tmp_path, name, *, data=None, **train):
    from fxquant.megatron_glue.config import tiny_llama_config
    from fxquant.megatron_glue.run_config import CompileBackend, DataConfig, OptimConfig, RunConfig, TrainConfig

    opts = dict(seq_length=32, micro_batch_size=2, global_batch_size=4, train_iters=5,
                optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=1))
    opts.update(train)
    return RunConfig(model=tiny_llama_config(vocab_size=257), train=TrainConfig(**opts), data=data or DataConfig(),
                     output_dir=str(tmp_path / name), backend=CompileBackend.NONE)


def test_validation_at_interval_and_end_changes_nothing_else(tmp_path):
    from fxquant.megatron_glue.launch import format_progress
    from fxquant.megatron_glue.train import train

    plain = train(_run(tmp_path, "plain"))
    lines = []
    evaluated = train(_run(tmp_path, "eval", eval_interval=2, eval_iters=2),
                      progress=lambda r: lines.append(format_progress(r, 5)))
    val = {r["iteration"]: r["val_loss"] for r in evaluated.records if "val_loss" in r}
    assert sorted(val) == [2, 4, 5]  # every 2 iterations and after the last
    assert val[5] < val[2]  # the model learns: the same validation batches cost less later
    # Evaluating (eval mode, no grad, its own batches) leaves training bit-identical.
    keys = ("loss", "grad_norm", "lr")
    assert [[r[k] for k in keys] for r in evaluated.records] == [[r[k] for k in keys] for r in plain.records]
    written = [json.loads(line) for line in evaluated.metrics_path.read_text().splitlines()]
    assert {r["iteration"]: r["val_loss"] for r in written if "val_loss" in r} == val
    assert "val loss" in lines[1] and "val loss" not in lines[0]


def test_a_run_stopped_by_control_iter_validates_at_its_last_iteration(tmp_path):
    """control_iter stops a run early: its last iteration is validated too, so the run's final validation loss
    belongs to the model its final loss does (it came from an earlier iteration). A resumed run counts control_iter
    from where it starts."""
    from fxquant.megatron_glue.train import train

    stopped = train(_run(tmp_path, "ctl", train_iters=10, eval_interval=4, eval_iters=1, control_iter=6,
                         save_interval=3))
    assert stopped.stopped_by_control_iter and stopped.iterations == 6
    assert sorted(r["iteration"] for r in stopped.records if "val_loss" in r) == [4, 6]
    resumed = train(_run(tmp_path, "ctl", train_iters=10, eval_interval=4, eval_iters=1, control_iter=1,
                         save_interval=3))  # resumes after iteration 6 (the checkpoint), stops after 7
    assert resumed.iterations == 7 and [r["iteration"] for r in resumed.records] == [7]
    assert [r["iteration"] for r in resumed.records if "val_loss" in r] == [7]  # no multiple of 4: the last one
    t = _run(tmp_path, "x", train_iters=10, eval_interval=4, control_iter=3).train
    assert [i for i in range(1, 11) if t.evaluates_at(i)] == [3, 4, 8]
    assert [i for i in range(6, 11) if t.evaluates_at(i, start=5)] == [8]
    assert [i for i in range(9, 11) if t.evaluates_at(i, start=8)] == [10]  # control_iter past train_iters


def test_validation_loss_is_the_models_loss_on_the_validation_split(tmp_path):
    import torch

    from fxquant.megatron_glue.data import build_datasets
    from fxquant.megatron_glue.model import build_gpt_model, causal_attention_mask
    from fxquant.megatron_glue.tokenizer import ByteTokenizer
    from fxquant.megatron_glue.train import train

    # Iteration 1 runs at lr 0 (warm-up from 0), so the weights it validates are the initial ones.
    run = _run(tmp_path, "first", train_iters=2, eval_interval=1, eval_iters=2)
    result = train(run)
    assert result.records[0]["lr"] == 0.0
    t = run.train
    model = build_gpt_model(run.model, seed=t.seed, max_sequence_length=t.seq_length).eval()
    _, valid = build_datasets(run.data, ByteTokenizer(), seq_length=t.seq_length,
                              train_samples=t.train_iters * t.global_batch_size, valid_samples=t.eval_samples,
                              seed=t.seed)
    losses = []
    with torch.no_grad():
        for start in range(0, t.eval_samples, t.micro_batch_size):
            batch = torch.utils.data.default_collate([valid[i] for i in range(start, start + t.micro_batch_size)])
            per_token = model(batch["tokens"], batch["position_ids"], causal_attention_mask(t.seq_length),
                              labels=batch["labels"])
            losses.append((per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum())
    assert result.records[0]["val_loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-6)
    assert result.records[1]["val_loss"] < result.records[0]["val_loss"]


def test_validation_needs_a_validation_split(tmp_path, wiki_data):  # noqa: F811
    from dataclasses import replace

    from fxquant.megatron_glue.train import train

    with pytest.raises(ValueError, match="eval_interval=2 needs 8 validation samples"):
        train(_run(tmp_path, "nosplit", data=replace(wiki_data, split="100,0,0"), eval_interval=2, eval_iters=2))
    with pytest.raises(ValueError, match="eval_interval must be >= 0"):
        _run(tmp_path, "bad", eval_interval=-1)


from tests.test_train_megatron import wiki_data  # noqa: E402,F401  (module fixture: WikiText-2 indexed dataset)
