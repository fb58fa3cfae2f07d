"""Capture during Megatron-core training: records per iteration / micro-batch / role / layer / rank,
backward attributed to its micro-batch, validation captures nothing, predecessor flags and environment,
and two torchrun ranks (DP=2) writing their own coordinates into one capture root."""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core", reason="needs megatron-core")

REPO = Path(__file__).resolve().parents[1]
SCHEME = "FA_linear_hifp8"  # quantizes Q.K^T (forward and both gradients), keeps P.V in high precision
ATTN = "decoder.layers.{}.self_attention.core_attention"
ATTN_FORWARD = {"query", "key", "value", "probs", "output"}
ATTN_BACKWARD = {"grad_output", "grad_query", "grad_key", "grad_value", "grad_probs"}
LINEARS = {"qkv": "decoder.layers.{}.self_attention.linear_qkv", "proj": "decoder.layers.{}.self_attention.linear_proj",
           "fc1": "decoder.layers.{}.mlp.linear_fc1", "fc2": "decoder.layers.{}.mlp.linear_fc2"}
LINEAR_POINTS = {("input", "hp", None, "forward"), ("weight", "hp", None, "forward"), ("output", "hp", None, "forward"),
                 ("grad_output", "hp", None, "backward"), ("grad_input", "hp", None, "backward"),
                 ("grad_weight", "hp", None, "backward"),
                 ("input", "quantized", "fprop", "forward"), ("input", "quantized", "wgrad", "forward"),
                 ("weight", "quantized", "fprop", "forward"), ("weight", "quantized", "dgrad", "forward"),
                 ("grad_output", "quantized", "dgrad", "backward"), ("grad_output", "quantized", "wgrad", "backward")}


def _run(tmp_path, name, iters=4, **train):
    from fxquant.megatron_glue.config import AttentionKind, tiny_llama_config
    from fxquant.megatron_glue.run_config import CompileBackend, DataConfig, OptimConfig, RunConfig, TrainConfig

    opts = dict(seq_length=32, micro_batch_size=2, global_batch_size=4, train_iters=iters,
                optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=1))
    opts.update(train)
    return RunConfig(model=tiny_llama_config(vocab_size=257), train=TrainConfig(**opts), data=DataConfig(),
                     output_dir=str(tmp_path / name), scheme=SCHEME, backend=CompileBackend.AOT_EAGER,
                     attention=AttentionKind.LOCAL)


def _config_file(tmp_path, run) -> Path:
    path = tmp_path / f"{Path(run.output_dir).name}.json"
    path.write_text(json.dumps(run.to_dict()))
    return path


def _by_key(records):
    return collections.Counter((r.iteration, r.micro_batch, r.module, r.role, r.copy, r.gemm) for r in records)


def test_predecessor_env_capture_during_training(tmp_path, monkeypatch, capsys):
    """TENSOR_SAVE_ENABLED / TENSOR_SAVE_DIR + --control-iter 2 on the training entry point: every micro-batch
    of iterations 0 and 1, forward and backward (each backward under its own micro-batch), then training stops;
    validation (every iteration) adds nothing."""
    from fxquant import capture
    from fxquant.cli import main as fxquant_main
    from fxquant.megatron_glue.launch import main

    root = tmp_path / "tensor_logs"
    monkeypatch.setenv("TENSOR_SAVE_ENABLED", "true")
    monkeypatch.setenv("TENSOR_SAVE_DIR", str(root))
    run = _run(tmp_path, "env", iters=4, eval_interval=1, eval_iters=1)
    assert main(["--config", str(_config_file(tmp_path, run)), "--control-iter", "2"]) == 0
    out = capsys.readouterr().out
    metrics = [json.loads(line) for line in (tmp_path / "env" / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2] and all("val_loss" in m for m in metrics)
    assert "training stopped after 2 of 4 iterations by --control-iter 2 (--save-tensors captures" in out

    cs = capture.open(root)
    assert cs.committed and cs.verify() == []
    assert fxquant_main(["capture", "verify", str(root)]) == 0
    summary_line = next(line for line in out.splitlines() if line.startswith("capture rank 0:"))
    assert f"{len(cs)} records" in summary_line and str(root) in summary_line
    # the spec asks for quantized copies of P.V's operands, which this scheme keeps in high precision
    assert re.search(r"; \d+ selected point\(s\) not in the compiled graphs", summary_line)
    assert {(r.iteration, r.micro_batch) for r in cs} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert cs.values("scheme") == [SCHEME] and len(cs.values("run_id")) == 1
    coords = {(r.rank, r.world_size, r.tp_rank, r.tp_size, r.pp_rank, r.pp_size, r.dp_rank, r.dp_size) for r in cs}
    assert coords == {(0, 1, 0, 1, 0, 1, 0, 1)}
    counts = _by_key(cs)
    assert set(counts.values()) == {1}  # one record per point: no validation forward, no duplicates
    for it in (0, 1):
        for mb in (0, 1):
            for layer in (0, 1):
                here = cs.query(iteration=it, micro_batch=mb, module=ATTN.format(layer), copy="hp")
                assert set(here.values("layer")) == {layer}
                assert set(here.query(direction="forward").values("role")) == ATTN_FORWARD
                assert set(here.query(direction="backward").values("role")) == ATTN_BACKWARD
                quantized = cs.query(iteration=it, micro_batch=mb, module=ATTN.format(layer), copy="quantized")
                assert {(r.role, r.gemm) for r in quantized} == {("query", "qk"), ("query", "dk"), ("key", "qk"),
                                                                  ("key", "dq")}
                assert quantized.values("format") == ["hifp8"]
                for kind, path in LINEARS.items():
                    linear = cs.query(iteration=it, micro_batch=mb, module=path.format(layer))
                    assert {(r.role, r.copy, r.gemm, r.direction) for r in linear} == LINEAR_POINTS
                    assert set(linear.values("kind")) == {kind} and set(linear.values("layer")) == {layer}
    assert set(cs.values("component")) == {"attention", "linear"}
    for it in (0, 1):
        _check_backward_micro_batches(cs, it)


def _check_backward_micro_batches(cs, iteration):
    """The host schedule runs forwards 0, 1 then backwards 1, 0; each backward record must carry its own
    micro-batch: the P.V GEMM's value gradient equals probs^T @ grad_output of the *same* micro-batch, and a
    linear's weight gradient is its quantized grad_output^T @ input (the wgrad GEMM) of the same micro-batch.
    `cs` holds one rank's records."""
    cs = cs.query(iteration=iteration)

    def load(**fields):
        (rec,) = cs.query(**fields)
        return cs.load(rec)

    attention = cs.query(component="attention").values("module")
    fc2s = cs.query(kind="fc2").values("module")
    assert attention and fc2s
    for module in attention:
        order = [(r.micro_batch, r.direction) for r in sorted(cs.query(role=["probs", "grad_value"], module=module),
                                                                key=lambda r: r.seq)]
        assert order == [(0, "forward"), (1, "forward"), (1, "backward"), (0, "backward")]  # GPipe on the host
        probs = {mb: load(micro_batch=mb, role="probs", module=module, copy="hp") for mb in (0, 1)}
        grad_out = {mb: load(micro_batch=mb, role="grad_output", module=module, copy="hp") for mb in (0, 1)}
        for mb in (0, 1):
            torch.testing.assert_close(load(micro_batch=mb, role="grad_value", module=module, copy="hp"),
                                       torch.bmm(probs[mb].transpose(1, 2), grad_out[mb]), rtol=1e-5, atol=1e-7)
        crossed = torch.bmm(probs[0].transpose(1, 2), grad_out[1])
        assert not torch.allclose(load(micro_batch=1, role="grad_value", module=module, copy="hp"), crossed,
                                  rtol=1e-3, atol=1e-5)
    for module in fc2s:
        grad_out = {mb: load(micro_batch=mb, role="grad_output", module=module, gemm="wgrad") for mb in (0, 1)}
        inputs = {mb: load(micro_batch=mb, role="input", module=module, gemm="wgrad") for mb in (0, 1)}
        for mb in (0, 1):
            torch.testing.assert_close(load(micro_batch=mb, role="grad_weight", module=module),
                                       grad_out[mb].t() @ inputs[mb], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(grad_out[1].t() @ inputs[0], grad_out[1].t() @ inputs[1], rtol=1e-3, atol=1e-5)


def test_interrupted_run_commits_what_it_captured(tmp_path):
    """KeyboardInterrupt in the middle of training: the interrupt propagates, the capture is drained and
    committed with the iterations before it, and nothing temporary is left under the capture root."""
    from fxquant import capture
    from fxquant.megatron_glue.run_config import CaptureConfig, CompileBackend
    from fxquant.megatron_glue.train import train

    root = tmp_path / "caps"
    run = _replace(_run(tmp_path, "interrupted", iters=6), scheme="bf16", backend=CompileBackend.EAGER,
                   capture=CaptureConfig(spec="linear_io", dir=str(root)))

    def interrupt(record):
        if record["iteration"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(run, progress=interrupt)
    cs = capture.open(root)
    assert cs.committed and cs.verify() == [] and cs.values("iteration") == [0, 1]
    assert (root / "rank-00000" / "COMMITTED").is_file()
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]
    assert set(cs.values("role")) == {"input", "grad_output"} and cs.values("micro_batch") == [0, 1]
    first_id = cs.values("run_id")[0]

    def interrupt_early(record):
        if record["iteration"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # the same run again, from iteration 0: its captures replace the old
        train(run, progress=interrupt_early)
    cs = capture.open(root)
    assert cs.committed and cs.verify() == [] and cs.values("iteration") == [0]
    assert first_id not in cs.values("run_id")


def test_capture_arguments_map_to_the_run(monkeypatch, tmp_path):
    """Flags win over the environment; --save-tensors defaults to 1 iteration and stops training there;
    --capture alone keeps the spec's windows and the run's control_iter; the windowed spec is what it says."""
    from fxquant.capture import load_spec
    from fxquant.megatron_glue.launch import build_parser, with_capture_args
    from fxquant.megatron_glue.training_capture import resolve_spec

    run = _run(tmp_path, "args", iters=8)
    parse = build_parser().parse_args
    for name in ("TENSOR_SAVE_ENABLED", "TENSOR_SAVE_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert with_capture_args(run, parse(["--config", "x"])) == run

    monkeypatch.setenv("TENSOR_SAVE_ENABLED", "1")
    monkeypatch.setenv("TENSOR_SAVE_DIR", str(tmp_path / "env_dir"))
    env_run = with_capture_args(run, parse(["--config", "x"]))
    assert (env_run.capture.spec, env_run.capture.dir, env_run.capture.iterations) == \
        ("predecessor", str(tmp_path / "env_dir"), 1)
    assert env_run.train.control_iter == 1
    flag_run = with_capture_args(run, parse(["--config", "x", "--tensor-save-dir", "flag_dir", "--control-iter", "3"]))
    assert (flag_run.capture.dir, flag_run.capture.iterations, flag_run.train.control_iter) == ("flag_dir", 3, 3)
    unlimited = with_capture_args(run, parse(["--config", "x", "--control-iter", "0"]))
    assert (unlimited.capture.iterations, unlimited.train.control_iter) == (0, None)
    monkeypatch.setenv("TENSOR_SAVE_ENABLED", "0")
    spec_run = with_capture_args(run, parse(["--config", "x", "--capture", "linear_io"]))
    assert (spec_run.capture.spec, spec_run.capture.dir, spec_run.capture.iterations) == ("linear_io", None, None)
    assert spec_run.train.control_iter is None and spec_run.capture.root(run.output_dir) == Path(run.output_dir) / "captures"
    monkeypatch.setenv("TENSOR_SAVE_ENABLED", "maybe")
    with pytest.raises(ValueError, match="TENSOR_SAVE_ENABLED"):
        with_capture_args(run, parse(["--config", "x"]))

    # a config that holds a capture (experiments resolved the environment into it, a directory per run) keeps it:
    # the environment every rank inherits replaced it (captures of several runs landed in one directory)
    monkeypatch.setenv("TENSOR_SAVE_ENABLED", "1")
    resolved = _replace(run, capture=_replace(env_run.capture, spec="stats_only", dir=str(tmp_path / "env_dir" / "s"),
                                              iterations=None))
    assert with_capture_args(resolved, parse(["--config", "x"])) == resolved
    assert with_capture_args(resolved, parse(["--config", "x", "--control-iter", "2"])).train.control_iter == 2

    windowed = resolve_spec(_replace(env_run.capture, iterations=2, micro_batches=1), start_iteration=5)
    base = load_spec("predecessor")
    assert [s.name for s in windowed.sections] == [s.name for s in base.sections]
    for section in windowed.sections:
        inside = {(i, m) for i in range(10) for m in range(4) if section.when.contains(i, m, 0)}
        assert inside == {(5, 0), (6, 0)}
    assert resolve_spec(spec_run.capture, start_iteration=5) == load_spec("linear_io")


def _replace(value, **changes):
    import dataclasses

    return dataclasses.replace(value, **changes)


def _torchrun_with_capture(tmp_path, run, nproc: int, root: Path) -> subprocess.CompletedProcess:
    """The training entry point under torchrun with the predecessor's --save-tensors into `root`; must succeed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for name in ("TENSOR_SAVE_ENABLED", "TENSOR_SAVE_DIR"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "fxquant.megatron_glue.launch", "--config", str(_config_file(tmp_path, run)), "--save-tensors",
           "--tensor-save-dir", str(root)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.dist
def test_data_and_pipeline_parallel_ranks_write_their_coordinates(tmp_path):
    """torchrun, 4 processes, DP=2 x PP=2 (gloo), predecessor flags: every rank's records carry its coordinates,
    layers are global (stage 1 holds layer 1), one run id, backward records of both micro-batches are
    attributed correctly on both stages, and the data-parallel ranks saw different samples."""
    from fxquant import capture
    from fxquant.megatron_glue.run_config import CompileBackend, ParallelLayout

    run = _replace(_run(tmp_path, "dp2pp2", iters=2, global_batch_size=8), layout=ParallelLayout(pp=2),
                   backend=CompileBackend.EAGER)  # fxquant's rewritten graph interpreted: less compile time
    root = tmp_path / "tensor_logs"
    proc = _torchrun_with_capture(tmp_path, run, 4, root)
    progress = [line for line in proc.stdout.splitlines() if line.startswith("iter ")]
    assert proc.stdout.count("capture rank ") == 4 and len(progress) == 1  # --control-iter 1
    cs = capture.open(root)
    assert cs.committed and cs.verify() == [] and len(cs.values("run_id")) == 1
    assert sorted(p.name for p in root.iterdir()) == [f"rank-0000{r}" for r in range(4)]
    coords = {}
    for rank in range(4):
        mine = cs.query(rank=rank)
        (c,) = {(r.world_size, r.tp_rank, r.tp_size, r.pp_rank, r.pp_size, r.dp_rank, r.dp_size) for r in mine}
        assert c[:3] == (4, 0, 1) and (c[4], c[6]) == (2, 2)
        coords[rank] = (c[3], c[5])  # (pp_rank, dp_rank)
        assert mine.values("layer") == [c[3]]  # global: stage 0 holds layer 0, stage 1 layer 1
        assert {(r.iteration, r.micro_batch) for r in mine} == {(0, 0), (0, 1)}
        assert set(mine.query(copy="hp", component="attention").values("role")) == ATTN_FORWARD | ATTN_BACKWARD
        assert {(r.role, r.copy, r.gemm, r.direction) for r in mine.query(kind="fc1")} == LINEAR_POINTS
        _check_backward_micro_batches(mine, 0)
    assert sorted(coords.values()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    by_coords = {v: k for k, v in coords.items()}
    (q0,), (q1,) = (cs.query(rank=by_coords[(0, dp)], role="query", micro_batch=0, copy="hp") for dp in (0, 1))
    assert not torch.equal(cs.load(q0), cs.load(q1))  # each data-parallel rank saw its own samples


@pytest.mark.dist
def test_tensor_parallel_ranks_capture_row_parallel_linears(tmp_path):
    """torchrun, TP=2: a RowParallelLinear's output is all-reduced in place after the capture's gradient tap
    (the tap then hands on a copy, not a view). Both ranks capture every linear point; the gradient arriving
    at a row-parallel linear's partial output is the full output's on both ranks, bit for bit."""
    from fxquant import capture
    from fxquant.megatron_glue.run_config import CompileBackend, ParallelLayout

    run = _replace(_run(tmp_path, "tp2", iters=1), layout=ParallelLayout(tp=2), backend=CompileBackend.EAGER)
    root = tmp_path / "tensor_logs"
    _torchrun_with_capture(tmp_path, run, 2, root)
    cs = capture.open(root)
    assert cs.committed and cs.verify() == []
    assert {(r.rank, r.tp_rank, r.tp_size) for r in cs} == {(0, 0, 2), (1, 1, 2)}
    for rank in (0, 1):
        for kind in ("proj", "fc2", "fc1"):
            assert {(r.role, r.copy, r.gemm, r.direction) for r in cs.query(rank=rank, kind=kind)} == LINEAR_POINTS
    for kind in ("proj", "fc2"):  # row-parallel
        for layer in (0, 1):
            for mb in (0, 1):
                (g0,), (g1,) = (cs.query(rank=rank, module=LINEARS[kind].format(layer), role="grad_output", copy="hp",
                                         micro_batch=mb) for rank in (0, 1))
                assert torch.equal(cs.load(g0), cs.load(g1))


def test_a_fresh_run_removes_stale_rank_directories_and_outputs(tmp_path):
    """At iteration 0 each rank removes its own earlier captures, and rank 0 those of ranks this run does not have
    (an earlier run with more processes): none of another run's records are mixed in. The logging rank removes
    an earlier run's TensorBoard events and non-finite report; a resumed run keeps them."""
    from fxquant.megatron_glue.parallel import ParallelInfo
    from fxquant.megatron_glue.sentinel import REPORT_FILE
    from fxquant.megatron_glue.train import TENSORBOARD_DIR, _remove_earlier_outputs
    from fxquant.megatron_glue.training_capture import stale_rank_dirs

    root = tmp_path / "captures"
    for r in (0, 1, 2):
        (root / f"rank-{r:05d}").mkdir(parents=True)
    (root / "rank-notes").mkdir()

    def info(rank: int, world: int) -> ParallelInfo:
        return ParallelInfo(rank, world, 0, 1, 0, 1, rank, world, torch.device("cpu"))

    assert [d.name for d in stale_rank_dirs(root, info(0, 1))] == ["rank-00000", "rank-00001", "rank-00002"]
    assert [d.name for d in stale_rank_dirs(root, info(1, 2))] == ["rank-00001"]
    assert [d.name for d in stale_rank_dirs(root, info(0, 2))] == ["rank-00000", "rank-00002"]

    run_dir = tmp_path / "run"
    for start, kept in ((5, True), (0, False)):
        (run_dir / TENSORBOARD_DIR).mkdir(parents=True, exist_ok=True)
        (run_dir / TENSORBOARD_DIR / "events.out").write_text("x")
        (run_dir / REPORT_FILE).write_text("{}")
        _remove_earlier_outputs(run_dir, start)
        assert (run_dir / TENSORBOARD_DIR).exists() == kept and (run_dir / REPORT_FILE).exists() == kept


def test_a_resumed_run_captures_the_iterations_after_its_checkpoint_once(tmp_path):
    """A run stopped after iteration 2 (control_iter 3) with a checkpoint after iteration 1 resumes at iteration 2
    and captures it again: the earlier records of iterations >= 2 move to superseded.jsonl (as the metrics are cut
    back to the checkpoint), their shards go, and every iteration is captured once, by the run that trained it."""
    from fxquant import capture
    from fxquant.capture import layout
    from fxquant.megatron_glue.run_config import CaptureConfig, CompileBackend
    from fxquant.megatron_glue.train import train

    spec = tmp_path / "every.yaml"
    spec.write_text("version: 1\nname: every\nsections:\n  - name: fc2\n    layers:\n      kinds: [fc2]\n"
                    "    points:\n      - component: linear\n        roles: [input]\n        copies: [hp]\n"
                    "    when:\n      iterations: {start: 0, every: 1}\n    what: both\n")
    root = tmp_path / "caps"
    run = _replace(_run(tmp_path, "resumed", iters=4, save_interval=2, eval_interval=0, control_iter=3),
                   scheme="bf16", backend=CompileBackend.EAGER, capture=CaptureConfig(spec=str(spec), dir=str(root)))
    train(run)
    first = capture.open(root)
    n = collections.Counter(r.iteration for r in first)
    assert sorted(n) == [0, 1, 2] and len(set(n.values())) == 1
    n = n[0]  # records per iteration
    (first_id,) = first.values("run_id")
    first.close()
    train(_replace(run, train=_replace(run.train, control_iter=None)))
    cs = capture.open(root)
    per_iteration = collections.Counter((r.iteration, r.run_id) for r in cs)
    assert sorted(it for it, _ in per_iteration) == [0, 1, 2, 3] and set(per_iteration.values()) == {n}
    assert {it for it, run_id in per_iteration if run_id == first_id} == {0, 1}
    assert cs.committed and cs.verify() == []
    rank = root / "rank-00000"
    moved = layout.superseded_records(rank)
    assert len(moved) == n and {r["iteration"] for r in moved} == {2} and {r["run_id"] for r in moved} == {first_id}
    kept_files = {r.file for r in cs}
    assert all((rank / r["file"]).exists() == (r["file"] in kept_files) for r in moved)  # a shard of theirs alone goes
    keys = [r.key for r in cs] + [r["key"] for r in moved]
    assert len(keys) == len(set(keys))  # no tensor key used twice in the rank directory
