"""The Megatron-core training loop on CPU: loss falls on WikiText, resume is exact, TP=2 / PP=2 match one process,
tied embeddings split over two pipeline stages equal one process bit for bit."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core", reason="needs megatron-core")

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path, name, *, data=None, scheme="bf16", backend="none", iters=6, layout=None, **train):
    from fxquant.megatron_glue.config import tiny_llama_config
    from fxquant.megatron_glue.run_config import (CompileBackend, DataConfig, OptimConfig, ParallelLayout,
                                                  RunConfig, TrainConfig)

    opts = dict(seq_length=32, micro_batch_size=2, global_batch_size=4, train_iters=iters,
                optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=1))
    opts.update(train)
    return RunConfig(model=tiny_llama_config(vocab_size=257), train=TrainConfig(**opts), data=data or DataConfig(),
                     output_dir=str(tmp_path / name), scheme=scheme, backend=CompileBackend(backend),
                     layout=layout or ParallelLayout())


@pytest.fixture(scope="module")
def wiki_data(wikitext_dir, tmp_path_factory):
    from fxquant.megatron_glue.data import read_documents, write_indexed_dataset
    from fxquant.megatron_glue.dataset_label import DatasetLabel
    from fxquant.megatron_glue.run_config import DataConfig, DataKind
    from fxquant.megatron_glue.tokenizer import ByteTokenizer

    root = tmp_path_factory.mktemp("wiki")
    stats = write_indexed_dataset(read_documents(wikitext_dir / "valid.txt", "wikitext"), root / "valid",
                                  ByteTokenizer(), label=DatasetLabel("wikipedia", tokenizer="byte"))
    return DataConfig(DataKind.INDEXED, (stats.prefix,), split="99,1,0", cache_dir=str(root / "cache"))


def _losses(records):
    return [r["loss"] for r in records]


def test_loss_falls_on_wikitext_and_metrics_are_written(tmp_path, wiki_data):
    from fxquant.megatron_glue.train import train

    result = train(_run(tmp_path, "wiki", data=wiki_data, iters=12, global_batch_size=8))
    losses = _losses(result.records)
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5  # bytes: ~5.9 nats at init, falls fast
    lines = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["iteration"] for r in lines] == list(range(1, 13))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "consumed_samples"):
        assert all(key in r for r in lines)
    assert lines[0]["lr"] == 0.0 and lines[1]["lr"] == pytest.approx(3e-3)  # warm-up then cosine decay
    assert lines[-1]["lr"] < lines[1]["lr"] and lines[-1]["consumed_samples"] == 96


@pytest.mark.slow
def test_quantized_scheme_trains_through_fxquant_compile(tmp_path, wiki_data):
    from fxquant.megatron_glue.train import SITES_FILE, train

    result = train(_run(tmp_path, "q", data=wiki_data, scheme="FA_linear_hifp8", backend="aot_eager", iters=4,
                        seq_length=32))
    losses = _losses(result.records)
    assert all(l == l for l in losses) and losses[-1] < losses[0]
    # the scheme reached fxquant.compile: every decoder linear and the core attention were rewritten under it
    assert json.loads((result.run_dir / SITES_FILE).read_text())["scheme"] == "FA_linear_hifp8"
    sites = {s["module_path"]: s for s in result.sites}
    expected = [f"decoder.layers.{l}.{m}" for l in (0, 1) for m in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.core_attention",
        "mlp.linear_fc1", "mlp.linear_fc2")]
    assert all(sites.get(p, {}).get("status") == "rewritten" for p in expected), {p: sites.get(p) for p in expected}
    assert sites["output_layer"]["status"] == "high"


def test_control_iter_stops_and_resume_continues_identically(tmp_path):
    from fxquant.megatron_glue.run_config import TrainConfig
    from fxquant.megatron_glue.train import train

    whole = train(_run(tmp_path, "whole", iters=6))
    first = _run(tmp_path, "split", iters=6, save_interval=3, control_iter=3)
    part = train(first)
    assert part.stopped_by_control_iter and part.iterations == 3
    assert (Path(first.output_dir) / "checkpoints" / "latest").read_text().strip() == "3"
    rest = train(_run(tmp_path, "split", iters=6, save_interval=3))
    assert [r["iteration"] for r in rest.records] == [4, 5, 6]
    # Same losses, grad norms and learning rates, bit for bit, as the uninterrupted run.
    for a, b in zip(whole.records[3:], rest.records):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"])
    metrics = Path(first.output_dir) / "metrics.jsonl"
    assert [json.loads(l)["iteration"] for l in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="control_iter"):
        TrainConfig(control_iter=0)
    # run again to the same end: the checkpoint is there already; said, not a silent run that trains nothing
    with pytest.raises(ValueError, match="nothing to train: .*checkpoint at iteration 6, and this run trains to 6"):
        train(_run(tmp_path, "split", iters=6, save_interval=3))


def test_resume_with_more_iterations_follows_the_new_schedule_and_a_layout_change_is_refused(tmp_path, caplog):
    """Resuming with a larger --iters (what 'nothing to train' advises) goes on with the schedule of the run's own
    config, as run_config.json records it (it went on at min_lr on the checkpoint's schedule), saying what changed;
    a checkpoint written by another parallel layout is refused naming both (an opaque state-dict error)."""
    import torch

    from fxquant.megatron_glue.train import train

    whole = train(_run(tmp_path, "whole", iters=6))
    train(_run(tmp_path, "more", iters=3, save_interval=3))
    with caplog.at_level("WARNING", logger="fxquant.megatron_glue.checkpoint"):
        rest = train(_run(tmp_path, "more", iters=6, save_interval=3))
    assert [r["iteration"] for r in rest.records] == [4, 5, 6]
    assert [r["lr"] for r in rest.records] == [r["lr"] for r in whole.records[3:]]
    assert "lr schedule differs" in caplog.text and "lr_decay_steps 3 -> 6" in caplog.text
    rank_file = tmp_path / "more" / "checkpoints" / "iter_0000006" / "rank_00000.pt"
    payload = torch.load(rank_file, weights_only=True)
    assert payload["layout"] == {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "ep": 1, "cp": 1}
    payload["layout"] = {"world_size": 2, "tp": 2, "pp": 1, "dp": 1, "ep": 1, "cp": 1}
    torch.save(payload, rank_file)
    with pytest.raises(ValueError, match="written by a job of 2 processes, tp=2, pp=1, dp=1, ep=1, cp=1; this job has 1 "
                                         "processes, tp=1, pp=1, dp=1, ep=1, cp=1"):
        train(_run(tmp_path, "more", iters=8, save_interval=3))


def _torchrun(tmp_path, run, nproc: int) -> list[dict]:
    config = tmp_path / f"{Path(run.output_dir).name}.json"
    config.write_text(json.dumps(run.to_dict()))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "fxquant.megatron_glue.launch", "--config", str(config)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FXQUANT_RESULT" in proc.stdout
    lines = (Path(run.output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def single_process_reference(tmp_path_factory):
    from fxquant.megatron_glue.train import train

    return _losses(train(_run(tmp_path_factory.mktemp("ref"), "ref", iters=4)).records)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_two_processes_match_one(tmp_path, single_process_reference, tp, pp):
    from fxquant.megatron_glue.run_config import ParallelLayout

    records = _torchrun(tmp_path, _run(tmp_path, f"tp{tp}pp{pp}", iters=4, layout=ParallelLayout(tp=tp, pp=pp)), 2)
    losses = _losses(records)
    assert len(losses) == 4
    for ours, ref in zip(losses, single_process_reference):
        assert ours == pytest.approx(ref, rel=1e-4, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama31-8b", "llama32-1b"])
@pytest.mark.parametrize("scheme", ["bf16", "FA_linear_mxfp8"])
def test_catalogue_tiny_llamas_train_on_wikitext(tmp_path, wiki_data, model, scheme):
    """Each catalogue tiny Llama (the published architecture, shrunk) trains on WikiText and its loss falls,
    in high precision and with every linear and attention QK^T GEMM in MXFP8 (deepseek2_lite: test_deepseek_megatron)."""
    from dataclasses import replace

    from experiments.catalog import TINY
    from fxquant.megatron_glue.train import train

    run = _run(tmp_path, f"{model}-{scheme}", data=wiki_data, scheme=scheme, iters=10, global_batch_size=8,
               backend="none" if scheme == "bf16" else "aot_eager")
    result = train(replace(run, model=TINY[model]))
    losses = _losses(result.records)
    assert len(losses) == 10 and all(math.isfinite(l) for l in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    if scheme != "bf16":
        quantized = [s for s in result.sites if s["status"] == "rewritten"]
        assert {s["kind"] for s in quantized} >= {"qkv", "proj", "fc1", "fc2", "attention"}



def _checkpointed_model(run, rank: int, iteration: int) -> dict:
    import torch

    path = Path(run.output_dir) / "checkpoints" / f"iter_{iteration:07d}" / f"rank_{rank:05d}.pt"
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


@pytest.mark.dist
@pytest.mark.slow
def test_tied_embeddings_pp2_match_one_process(tmp_path):
    """Llama 3.2 1B (tiny) ties its embeddings. Split over two pipeline stages, each stage holds a copy, kept
    equal by Megatron's protocol: the last stage's copy is set from the first stage's at set-up (it is not drawn),
    and the two copies' gradients are all-reduced after every backward. Six iterations, so the gradient sync
    changes the weights five times before the last loss is measured.

    Bit for bit: with one micro-batch per iteration the tied gradient is the sum of the same two terms (LM head,
    embedding) on one process and on two, and every other operation is the same. (With several micro-batches
    the two-stage sum adds each stage's micro-batches first, so losses then differ in the last bit.) The grad
    norm sums the same squares in another order (per stage, then across stages), in float64."""
    from dataclasses import replace

    import torch

    from experiments.catalog import TINY
    from fxquant.megatron_glue.run_config import ParallelLayout
    from fxquant.megatron_glue.train import train

    tied = TINY["llama32-1b"]
    assert tied.tie_embeddings
    iters = 6

    def run(name, layout=None):
        return replace(_run(tmp_path, name, iters=iters, layout=layout, global_batch_size=2, save_interval=iters),
                       model=tied)

    one_run, two_run = run("pp1"), run("pp2", ParallelLayout(pp=2))
    one = train(one_run).records
    two = _torchrun(tmp_path, two_run, 2)
    assert [r["iteration"] for r in two] == list(range(1, iters + 1))
    assert _losses(two) == _losses(one)
    for a, b in zip(one, two):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-12, abs=0)  # the copy is counted once
    # One weight on one process; after six updates both stages' copies still equal it, bit for bit.
    single = _checkpointed_model(one_run, 0, iters)
    first, last = _checkpointed_model(two_run, 0, iters), _checkpointed_model(two_run, 1, iters)
    assert "output_layer.weight" not in single and "output_layer.weight" not in first
    embedding = single["embedding.word_embeddings.weight"]
    torch.testing.assert_close(first["embedding.word_embeddings.weight"], embedding, rtol=0, atol=0)
    torch.testing.assert_close(last["output_layer.weight"], embedding, rtol=0, atol=0)


@pytest.mark.parametrize("iters,warmup,expected", [(1, 4, 0), (3, 4, 2), (40, 4, 4), (5, 0, 0)])
def test_warmup_is_clipped_so_the_run_reaches_the_peak_lr(iters, warmup, expected):
    import torch

    from fxquant.megatron_glue.optim import lr_scheduler
    from fxquant.megatron_glue.run_config import OptimConfig, warmup_for

    cfg = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=warmup)
    assert warmup_for(cfg, iters) == expected
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = lr_scheduler(optimizer, cfg, iters)
    lrs = []
    for _ in range(iters):  # the loop reads the lr an iteration trains at, then steps the scheduler
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(1)
    assert max(lrs) == pytest.approx(cfg.lr)
    assert lrs[0] > 0 or expected > 0  # --iters 1 trains at the peak lr, not at 0


def test_resume_under_other_settings_is_refused_naming_each_difference(tmp_path, caplog):
    """A checkpoint records the run's settings: resuming under another precision, attention, sequence length,
    scheme, data split or optimizer hyperparameter is refused with each difference named (it went on silently;
    the optimizer's state dict restores the checkpoint's weight decay and betas over the run's), before
    run_config.json is rewritten (a refused run, or one with nothing to train, leaves the configuration the
    checkpoint was made by). A checkpoint that does not record some settings resumes, naming them at INFO. A
    resume under the same settings, another `kernels` choice included, says so (`resumed`) and reports the run's
    checkpoints even when it saves none."""
    from dataclasses import replace

    import torch

    from fxquant.lowering import Kernels
    from fxquant.megatron_glue.config import AttentionKind
    from fxquant.megatron_glue.run_config import DataConfig, OptimConfig, Precision
    from fxquant.megatron_glue.train import train

    train(_run(tmp_path, "r", iters=2, save_interval=2))
    config = tmp_path / "r" / "run_config.json"
    written = config.read_text()
    optim = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=1, weight_decay=0.0, adam_beta2=0.99, clip_grad=0.5)
    other = _run(tmp_path, "r", iters=4, save_interval=2, seq_length=64, precision=Precision.BF16, optim=optim,
                 data=DataConfig(split="90,10,0"))
    with pytest.raises(ValueError) as exc:
        train(replace(other, attention=AttentionKind.LOCAL, scheme_yaml="rules: []\n"))
    message = str(exc.value)
    for difference in ("seq_length: checkpoint 32, this run 64", "precision: checkpoint 'fp32', this run 'bf16'",
                       "attention: checkpoint 'sdpa', this run 'local'",
                       "scheme YAML: checkpoint a preset, this run a scheme file",
                       "data.split: checkpoint '98,2,0', this run '90,10,0'",
                       "optim.weight_decay: checkpoint 0.1, this run 0.0",
                       "optim.adam_beta2: checkpoint 0.95, this run 0.99",
                       "optim.clip_grad: checkpoint 1.0, this run 0.5"):
        assert difference in message
    assert "optim.lr" not in message and "optim.decay" not in message  # the schedule: the run's own, warned about
    assert "another --out" in message and f"delete '{tmp_path / 'r' / 'checkpoints'}'" in message
    assert config.read_text() == written
    with pytest.raises(ValueError, match=r"other settings \(optim\.adam_beta1: checkpoint 0\.9, this run 0\.8\)"):
        train(_run(tmp_path, "r", iters=4, optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=1, adam_beta1=0.8)))
    with pytest.raises(ValueError, match="nothing to train"):
        train(_run(tmp_path, "r", iters=2, save_interval=2, optim=OptimConfig(lr=1e-3, min_lr=1e-4)))
    assert config.read_text() == written

    rank_file = tmp_path / "r" / "checkpoints" / "iter_0000002" / "rank_00000.pt"
    payload = torch.load(rank_file, weights_only=True)
    for key in ("tokenizer", "data", "optim"):  # as a checkpoint written before they were recorded
        del payload["settings"][key]
    torch.save(payload, rank_file)
    said = []
    with caplog.at_level("INFO", logger="fxquant.megatron_glue.checkpoint"):
        result = train(replace(_run(tmp_path, "r", iters=3), kernels=Kernels.REFERENCE),
                       resumed=lambda it, where: said.append((it, where)))
    assert "does not record data, optim, tokenizer" in caplog.text
    assert said == [(2, tmp_path / "r" / "checkpoints")] and result.checkpoint_dir == tmp_path / "r" / "checkpoints"
    assert [r["iteration"] for r in result.records] == [3]


def test_run_settings_cover_tokenizer_data_and_optimizer_but_not_derived_or_machine_choices(tmp_path):
    """The tokenizer and the data prefixes are settings; the data cache directory (derived from the files), the
    compile backend and `kernels` (the same bits whichever is chosen) and the lr schedule are not. Every
    OptimConfig field is either a recorded setting or part of the lr schedule (a new field must choose)."""
    import dataclasses
    from dataclasses import replace

    from fxquant.lowering import Kernels
    from fxquant.megatron_glue import checkpoint
    from fxquant.megatron_glue.run_config import CompileBackend, DataConfig, DataKind, OptimConfig

    for name in ("a", "b"):
        for suffix in (".bin", ".idx"):
            (tmp_path / f"{name}{suffix}").write_bytes(b"")
    data = DataConfig(DataKind.INDEXED, (str(tmp_path / "a"),), cache_dir=str(tmp_path / "cache1"))
    run = _run(tmp_path, "s", data=data)
    saved = checkpoint.run_settings(run, bf16=False)
    other = replace(run, tokenizer="/tokenizers/llama3", data=replace(data, prefixes=(str(tmp_path / "b"),)))
    assert checkpoint.run_settings(other, bf16=False) != saved
    differences, _ = checkpoint._compare(saved, checkpoint.run_settings(other, bf16=False))
    assert differences == [f"data.prefixes: checkpoint [{str(tmp_path / 'a')!r}], this run [{str(tmp_path / 'b')!r}]",
                           "tokenizer: checkpoint 'byte', this run '/tokenizers/llama3'"]
    schedule = OptimConfig(lr=1e-3, min_lr=0.0, decay_style="linear")
    same = replace(run, data=replace(data, cache_dir=str(tmp_path / "cache2")), backend=CompileBackend.INDUCTOR,
                   kernels=Kernels.TRITON, train=replace(run.train, train_iters=60, optim=schedule))
    assert checkpoint.run_settings(same, bf16=False) == saved
    recorded, lr_schedule = set(checkpoint.OPTIMIZER_SETTINGS), {"lr", "min_lr", "warmup_iters", "decay_iters",
                                                                 "decay_style"}
    assert {f.name for f in dataclasses.fields(OptimConfig)} == recorded | lr_schedule and not recorded & lr_schedule


def test_a_fresh_run_removes_an_earlier_runs_sites_report(tmp_path):
    """fxquant_sites.json belongs to the run that wrote it: a run starting at iteration 0 that writes none
    (--backend none) leaves no earlier one beside its metrics."""
    from fxquant.megatron_glue.train import SITES_FILE, train

    stale = tmp_path / "s" / SITES_FILE
    stale.parent.mkdir()
    stale.write_text('{"scheme": "FA_linear_hifp8", "sites": []}')
    train(_run(tmp_path, "s", iters=1))
    assert not stale.exists()


def test_the_training_entry_point_says_it_resumed(tmp_path, capsys):
    """`launch` prints `resumed from iteration N (DIR)` (the supervisor echoes it), and its FXQUANT_RESULT names
    the run's checkpoints after a resume that saved none of its own."""
    from fxquant.megatron_glue.launch import main

    for iters, save_interval in ((2, 2), (3, 0)):
        config = tmp_path / f"run{iters}.json"
        config.write_text(json.dumps(_run(tmp_path, "e", iters=iters, save_interval=save_interval).to_dict()))
        assert main(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"resumed from iteration 2 ({tmp_path / 'e' / 'checkpoints'})" in out
    result = json.loads(out.rsplit("FXQUANT_RESULT ", 1)[1].splitlines()[0])
    assert result["checkpoints"] == str(tmp_path / "e" / "checkpoints") and result["iterations"] == 3
