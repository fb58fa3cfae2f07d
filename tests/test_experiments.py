"""experiments/: faithful published configs, dry runs for 3 models x 2 datasets x 10 schemes, refusals, a real run."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core", reason="needs megatron-core")


def test_published_architectures():
    from experiments.catalog import MODELS

    l8, l1, ds = MODELS["llama31-8b"], MODELS["llama32-1b"], MODELS["deepseek2_lite"]
    assert (l8.num_layers, l8.hidden_size, l8.ffn_hidden_size, l8.num_attention_heads, l8.query_groups,
            l8.rotary_base, l8.vocab_size, l8.tie_embeddings) == (32, 4096, 14336, 32, 8, 500000.0, 128256, False)
    assert (l1.num_layers, l1.hidden_size, l1.ffn_hidden_size, l1.num_attention_heads, l1.query_groups,
            l1.head_dim, l1.tie_embeddings, l1.vocab_size) == (16, 2048, 8192, 32, 8, 64, True, 128256)
    assert (ds.num_layers, ds.hidden_size, ds.num_attention_heads, ds.vocab_size, ds.ffn_hidden_size) == \
        (27, 2048, 16, 102400, 10944)
    assert (ds.mla.kv_lora_rank, ds.mla.q_lora_rank, ds.mla.qk_head_dim, ds.mla.qk_pos_emb_head_dim,
            ds.mla.v_head_dim) == (512, None, 128, 64, 128)
    assert (ds.moe.num_experts, ds.moe.top_k, ds.moe.expert_ffn_hidden_size, ds.moe.shared_expert_ffn_hidden_size,
            ds.moe.first_k_dense) == (64, 6, 1408, 2 * 1408, 1)
    # Parameter counts of the model cards: 8.0B, 1.24B, 15.7B.
    assert round(l8.num_parameters() / 1e9, 2) == 8.03
    assert round(l1.num_parameters() / 1e9, 2) == 1.24
    assert round(ds.num_parameters() / 1e9, 1) == 15.7


@pytest.mark.parametrize("name", ["llama31-8b", "llama32-1b"])
def test_tiny_llamas_keep_the_published_embedding_tie(name):
    """The tiny variants keep the published tie (Llama 3.2 1B tied, Llama 3.1 8B not), and the built Megatron
    model follows it: a tied model has no LM-head weight of its own (it reads the embedding)."""
    from experiments.catalog import MODELS, TINY
    from fxquant.megatron_glue.model import build_gpt_model
    from fxquant.megatron_glue.parallel import initialize_parallel

    tiny = TINY[name]
    assert tiny.tie_embeddings == MODELS[name].tie_embeddings == (name == "llama32-1b")
    initialize_parallel()
    model = build_gpt_model(tiny, seed=1)
    assert model.share_embeddings_and_output_weights == tiny.tie_embeddings
    assert (model.output_layer.weight is None) == tiny.tie_embeddings


def test_predecessor_schemes_are_presets():
    from experiments.catalog import PREDECESSOR_SCHEMES, scheme_names

    assert len(PREDECESSOR_SCHEMES) == 10 and set(PREDECESSOR_SCHEMES) <= set(scheme_names())


@pytest.fixture(scope="module")
def data_prefixes(tmp_path_factory):
    """Per dataset, an indexed-dataset prefix labelled with its name (dry runs check the files and the label)."""
    from fxquant.megatron_glue import dataset_label

    out = {}
    for name in ("wikipedia", "dolma"):
        prefix = tmp_path_factory.mktemp("data") / name
        for suffix in (".bin", ".idx"):
            prefix.with_suffix(suffix).write_bytes(b"")
        dataset_label.write(prefix, dataset_label.DatasetLabel(name))
        out[name] = str(prefix)
    return out


@pytest.mark.parametrize("model", ["llama31-8b", "llama32-1b", "deepseek2_lite"])
@pytest.mark.parametrize("dataset", ["wikipedia", "dolma"])
def test_dry_run_every_scheme(model, dataset, data_prefixes, tmp_path, capsys):
    from experiments.__main__ import main
    from experiments.catalog import PREDECESSOR_SCHEMES

    import torch

    tok = tmp_path / "tokenizer"
    tok.mkdir()
    # MLA/MoE tensor parallelism needs CUDA (test_tensor_and_expert_parallel_mla_moe_refused_before_launch)
    tp = 1 if model == "deepseek2_lite" and not torch.cuda.is_available() else 2
    for scheme in PREDECESSOR_SCHEMES:
        assert main(["run", "--model", model, "--dataset", dataset, "--scheme", scheme, "--variant", "full",
                     "--config", "standard", "--tokenizer", str(tok), "--data-prefix", data_prefixes[dataset],
                     "--nproc", "8", "--tp", str(tp), "--pp", "1", "--out", str(tmp_path), "--dry-run"]) == 0
        out = capsys.readouterr().out
        command, _, config = out.partition("\n")
        assert "torch.distributed.run" in command and "--nproc-per-node=8" in command
        resolved = json.loads(config)
        assert resolved["scheme"] == scheme and resolved["model"]["name"] == model
        assert resolved["layout"] == {"tp": tp, "pp": 1, "ep": 1}
        assert resolved["data"]["prefixes"] == [data_prefixes[dataset]] and resolved["train"]["seq_length"] == 8192


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama31-8b", "--tp", "3", "--nproc", "3"], "tp=3 does not divide num_attention_heads"),
    (["--model", "llama32-1b", "--pp", "4", "--nproc", "4"], "pp=4 does not divide num_layers=2"),
    (["--model", "llama31-8b", "--variant", "full"], "needs --tokenizer"),
    (["--model", "llama31-8b", "--dataset", "dolma", "--data-prefix", "/nonexistent/x"], "x.bin not found"),
    (["--model", "lama31-8b"], "did you mean 'llama31-8b'"),
    (["--model", "llama31-8b", "--scheme", "FA_hifp"], "did you mean 'FA_hifp8'"),
    (["--model", "llama31-8b", "--nproc", "3"], "global batch 8 is not divisible"),
    (["--model", "llama31-8b", "--tp", "0"], "--tp 0: parallel sizes must be integers >= 1"),
    (["--model", "llama31-8b", "--tp", "2", "--nproc", "3"], "--nproc 3 must be a positive multiple of tp*pp"),
    (["--model", "llama31-8b", "--backend", "none", "--scheme", "FA_mxfp8"], "--backend none runs the model uncompiled"),
    (["--model", "llama31-8b", "--backend", "none", "--kernels", "inductor"],
     "--kernels inductor has no effect with --backend none"),
    (["--model", "llama31-8b", "--eval-interval", "0", "--eval-iters", "9"], "--eval-iters 9 has no effect"),
    (["--model", "llama31-8b", "--scheme", "nowhere/mine.yaml"], "'nowhere/mine.yaml': no such scheme file"),
    (["--model", "llama31-8b", "--capture", "predecesor"], "did you mean 'predecessor'"),
    (["--model", "llama31-8b", "--tensor-save-dir", "D"],
     "--tensor-save-dir 'D' says where captures go: it needs --save-tensors (or TENSOR_SAVE_ENABLED=1) or --capture"),
])
def test_impossible_combinations_are_refused(argv, message, capsys):
    from experiments.__main__ import main

    assert main(["run", *argv, "--dry-run"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_matrix_runs_supervised_and_compares_with_bf16(tmp_path, capsys):
    from experiments.__main__ import main

    code = main(["matrix", "--models", "llama31-8b", "--datasets", "mock", "--schemes", "bf16", "linear_hifp8",
                 "--iters", "3", "--out", str(tmp_path), "--backend", "aot_eager", "--timeout", "300", "--last-n", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    # each cell's iterations are shown as they run, named by the cell (and nothing else of the ranks' output)
    assert "  llama31-8b/mock/linear_hifp8 iter      3/3 | loss" in out and "FXQUANT_RESULT" not in out
    summary = json.loads((tmp_path / "matrix_summary.json").read_text())
    assert [r["status"] for r in summary["runs"]] == ["ok", "ok"]
    mre = summary["loss_vs_bf16"]["llama31-8b/mock/linear_hifp8"]
    assert 0 < mre["mre_all"] < 0.2 and mre["mre_last"] is not None


def _dry(argv, capsys):
    from experiments.__main__ import main

    code = main(["run", *argv, "--dry-run"])
    out, err = capsys.readouterr()
    command, _, config = out.partition("\n")
    return code, command, (json.loads(config) if code == 0 else None), err


def test_nproc_defaults_to_the_parallel_sizes_and_dry_run_writes_nothing(tmp_path, capsys, monkeypatch):
    from experiments.__main__ import main

    monkeypatch.delenv("CUSTOM_QUANT_TYPE", raising=False)
    out = tmp_path / "runs"
    code, command, config, _ = _dry(["--model", "llama32-1b", "--tp", "2", "--pp", "2", "--out", str(out),
                                     "--save-tensors", "--tensor-save-dir", str(tmp_path / "D")], capsys)
    assert code == 0 and "--nproc-per-node=4" in command
    assert config["layout"] == {"tp": 2, "pp": 2, "ep": 1}
    assert main(["matrix", "--models", "llama32-1b", "--schemes", "bf16", "FA_mxfp8", "--out", str(out),
                 "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "2 run(s) resolved, 0 refused" in printed
    assert "each command reads its run's launch.json, which the matrix writes when it runs the cell" in printed
    assert list(tmp_path.iterdir()) == []  # neither the run directory, launch.json, captures nor a summary


def test_relative_data_and_tokenizer_paths_are_resolved_where_they_were_given(data_prefixes, tmp_path, capsys,
                                                                              monkeypatch):
    """The ranks run in the repository, not the caller's directory: a relative --data-prefix, --tokenizer and
    --out reach them as the absolute paths the caller meant (they pointed into the repository, or nowhere)."""
    prefix = Path(data_prefixes["wikipedia"])
    (tmp_path / "tokenizer").mkdir()
    monkeypatch.chdir(prefix.parent)
    code, _, config, _ = _dry(["--model", "llama32-1b", "--dataset", "wikipedia", "--data-prefix", prefix.name,
                               "--tokenizer", str(Path("..") / tmp_path.name / "tokenizer"), "--out", "runs"], capsys)
    assert code == 0
    assert config["data"]["prefixes"] == [str(prefix)]
    assert config["tokenizer"] == str((tmp_path / "tokenizer").resolve())
    assert Path(config["data"]["cache_dir"]).parent == prefix.parent / "runs" / ".data-cache"


def test_a_cell_given_twice_is_refused(tmp_path, capsys):
    from experiments.__main__ import main

    assert main(["matrix", "--models", "llama32-1b", "--schemes", "bf16", "bf16", "--out", str(tmp_path)]) == 2
    assert "run(s) given more than once: llama32-1b/mock/bf16" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_two_schemes_of_one_name_are_refused_before_running(tmp_path, capsys):
    """Two scheme files named alike in different directories resolve to one run directory: the second run
    overwrote the first's, and both cells reported the last run's numbers; refused before anything runs."""
    from experiments.__main__ import main

    for sub, fmt in (("a", "hifp8"), ("b", "mxfp4_e2m1")):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "myscheme.yaml").write_text(f"rules:\n  - linear: {fmt}\n")
    out = tmp_path / "runs"
    argv = ["matrix", "--models", "llama32-1b", "--schemes", "bf16", str(tmp_path / "a" / "myscheme.yaml"),
            str(tmp_path / "b" / "myscheme.yaml"), "--iters", "2", "--out", str(out)]
    for extra in (["--dry-run"], []):
        assert main(argv + extra) == 1
        captured = capsys.readouterr()
        assert "[start]" not in captured.out and not out.exists()
        assert captured.out.count("[refused]") == 1 and "resolve to one run directory" in captured.out
        assert "give the schemes distinct names" in captured.out


def test_matrix_refuses_every_bad_cell_before_running_any(tmp_path, capsys):
    """One mistyped model in a matrix: the command stops before the first run (nothing trained, nothing written),
    naming each refused cell."""
    from experiments.__main__ import main

    out = tmp_path / "runs"
    assert main(["matrix", "--models", "llama32-1b", "llama99", "--schemes", "bf16", "FA_mxfp9", "--iters", "2",
                 "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "[start]" not in captured.out and not out.exists()
    assert captured.out.count("[refused]") == 3  # llama99 x 2 schemes, and llama32-1b x FA_mxfp9
    assert "3 of 4 run(s) refused (above); nothing was run" in captured.err
    with pytest.raises(SystemExit):
        main(["matrix", "--models", "llama32-1b", "--last-n", "0", "--out", str(out)])


def test_tensor_and_expert_parallel_mla_moe_refused_before_launch():
    from experiments.launcher import resolve

    with pytest.raises(ValueError, match=r"\(MLA \+ MoE\) with tp=2, ep=1 cannot run on cpu"):
        resolve(model="deepseek2_lite", dataset="mock", scheme="bf16", tp=2, device="cpu")
    assert resolve(model="deepseek2_lite", dataset="mock", scheme="bf16", tp=2, device="cuda").nproc == 2
    assert resolve(model="deepseek2_lite", dataset="mock", scheme="bf16", pp=2, device="cpu").nproc == 2


def test_scheme_yaml_is_accepted_and_recorded_whole(tmp_path, capsys, monkeypatch):
    from fxquant.megatron_glue.run_config import RunConfig

    monkeypatch.delenv("CUSTOM_QUANT_TYPE", raising=False)
    path = tmp_path / "my_scheme.yaml"
    path.write_text("rules:\n  - match: {kinds: [fc1, fc2]}\n    linear: hifp8\n")
    code, _, config, err = _dry(["--model", "llama32-1b", "--scheme", str(path), "--out", str(tmp_path / "r")], capsys)
    assert code == 0, err
    assert config["scheme"] == "my_scheme" and config["scheme_yaml"] == path.read_text()
    assert config["output_dir"].endswith("llama32-1b-tiny/mock/my_scheme")
    scheme = RunConfig.from_dict(config).compile_scheme()  # what the ranks compile with, file or no file
    path.unlink()
    assert scheme.name == "my_scheme" and [k.value for k in scheme.rules[0].selector.kinds] == ["fc1", "fc2"]

    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - match: {kinds: [fc9]}\n    linear: hifp8\n")
    code, _, _, err = _dry(["--model", "llama32-1b", "--scheme", str(bad)], capsys)
    assert code == 2 and "bad.yaml:2" in err and "fc9" in err and "Traceback" not in err
    clash = tmp_path / "bf16.yaml"
    clash.write_text("rules:\n  - linear: hifp8\n")
    code, _, _, err = _dry(["--model", "llama32-1b", "--scheme", str(clash)], capsys)
    assert code == 2 and "named 'bf16', like a preset" in err


def test_custom_quant_type_is_honoured_and_an_overriding_flag_said(tmp_path, capsys, monkeypatch):
    from experiments.__main__ import main

    monkeypatch.setenv("CUSTOM_QUANT_TYPE", "hifp8")  # the predecessor's quant type: linear and attention
    code, _, config, err = _dry(["--model", "llama32-1b", "--out", str(tmp_path)], capsys)
    assert code == 0 and config["scheme"] == "FA_linear_hifp8" and "from CUSTOM_QUANT_TYPE=hifp8" in err
    monkeypatch.setenv("CUSTOM_QUANT_TYPE", "FA_PV_mxfp8")
    code, _, config, _ = _dry(["--model", "llama32-1b", "--out", str(tmp_path)], capsys)
    assert code == 0 and config["scheme"] == "FA_PV_mxfp8"
    code, _, config, err = _dry(["--model", "llama32-1b", "--scheme", "bf16", "--out", str(tmp_path)], capsys)
    assert code == 0 and config["scheme"] == "bf16"
    assert "note: --scheme bf16 given; CUSTOM_QUANT_TYPE=FA_PV_mxfp8 is not used" in err
    monkeypatch.setenv("CUSTOM_QUANT_TYPE", "hifp9")
    code, _, _, err = _dry(["--model", "llama32-1b"], capsys)
    assert code == 2 and "did you mean 'hifp8'" in err
    assert main(["matrix", "--models", "llama32-1b", "--schemes", "bf16", "--dry-run", "--out", str(tmp_path)]) == 0
    assert "note: a matrix runs --schemes; CUSTOM_QUANT_TYPE=hifp9 is not used" in capsys.readouterr().err


def test_runs_pointed_at_one_capture_dir_keep_each_others_captures(tmp_path, capsys, monkeypatch):
    """--tensor-save-dir D: each run writes D/<scheme> (the predecessor's {save_dir}/{quant_type}); a matrix
    D/<model>/<dataset>/<scheme>; a run that would replace earlier captures says so on the console."""
    from experiments.__main__ import _replacing_note
    from experiments.launcher import resolve
    from fxquant.megatron_glue.run_config import CaptureConfig

    monkeypatch.delenv("CUSTOM_QUANT_TYPE", raising=False)
    root = tmp_path / "D"
    roots = []
    for scheme in ("FA_linear_hifp8", "bf16"):
        launch = resolve(model="llama32-1b", dataset="mock", scheme=scheme, out=str(tmp_path / "runs"),
                         capture=CaptureConfig(dir=str(root), iterations=1))
        roots.append(launch.run.capture.root(launch.run.output_dir))
    assert roots == [root.resolve() / "FA_linear_hifp8", root.resolve() / "bf16"]
    matrix = resolve(model="llama32-1b", dataset="mock", scheme="bf16", capture=CaptureConfig(dir=str(root)),
                     capture_per_run=True)
    # keyed as the run directory: the tiny variant's name, so a full sweep into D keeps the tiny sweep's captures
    assert matrix.run.capture.root(matrix.run.output_dir) == root.resolve() / "llama32-1b-tiny" / "mock" / "bf16"
    assert Path(matrix.run.output_dir).relative_to(Path("runs").resolve()).parts == ("llama32-1b-tiny", "mock", "bf16")
    full = resolve(model="llama32-1b", dataset="mock", scheme="bf16", capture=CaptureConfig(dir=str(root)),
                   capture_per_run=True, variant="full", tokenizer=str(tmp_path))
    assert full.run.capture.root(full.run.output_dir) == root.resolve() / "llama32-1b" / "mock" / "bf16"
    assert _replacing_note(launch) is None
    (roots[1] / "rank-00000").mkdir(parents=True)
    assert f"note: {roots[1]} holds an earlier run's captures (1 rank(s)); this run replaces them" in \
        _replacing_note(launch)


def test_first_error_of_a_failing_rank():
    from experiments.launcher import first_error

    log = """*****************************************
[rank1]: Traceback (most recent call last):
[rank1]:   File "/x/launch.py", line 82, in main
[rank1]:     raise ValueError(f"model {cfg.name!r} cannot run")
[rank1]: ValueError: model 'deepseek2_lite-tiny' (MLA + MoE) with tp=2 cannot run on cpu
[rank0]: ValueError: model 'deepseek2_lite-tiny' (MLA + MoE) with tp=2 cannot run on cpu
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
""".splitlines(keepends=True)
    assert first_error(log) == "rank 1: ValueError: model 'deepseek2_lite-tiny' (MLA + MoE) with tp=2 cannot run on cpu"
    assert first_error(log[-1:]) == "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"
    assert first_error(["iter 1/3 | loss 5.0\n"]) is None
    rules = ["[rank0]: ValueError: scheme rules match no site of the model (scheme s, s.yaml):\n",
             "[rank0]:   rule 1 (layers=7): matched no site: the model's layers are 0..1\n",
             "[rank0]:   rule 2 (kinds=router): matched no site\n", "[rank1]:   other rank\n", "[rank0]: done\n"]
    assert first_error(rules) == ("rank 0: ValueError: scheme rules match no site of the model (scheme s, s.yaml): "
                                  "rule 1 (layers=7): matched no site: the model's layers are 0..1; "
                                  "rule 2 (kinds=router): matched no site")
    interleaved = [rules[0], "[rank1]: ValueError: scheme rules match no site of the model (scheme s, s.yaml):\n",
                   rules[1], "[rank1]:   rule 1 (layers=7): matched no site: the model's layers are 0..1\n"]
    assert first_error(interleaved) == ("rank 0: ValueError: scheme rules match no site of the model (scheme s, "
                                        "s.yaml): rule 1 (layers=7): matched no site: the model's layers are 0..1")
    wrapped = ["[rank0]: torch._dynamo.exc.BackendCompilerFailed: backend='FxquantBackend' raised:\n",
               "[rank0]: ValueError: kernels='triton' needs the Triton kernels registered for 'cpu'\n",
               "[rank0]: \n"]
    assert first_error(wrapped) == ("rank 0: torch._dynamo.exc.BackendCompilerFailed: backend='FxquantBackend' "
                                    "raised: ValueError: kernels='triton' needs the Triton kernels registered for 'cpu'")


def test_a_failing_run_prints_the_ranks_error_line(tmp_path, capsys, monkeypatch):
    """A real torchrun failure inside the rank (a tokenizer directory holding no tokenizer): the console gets
    the rank's first error line and the log path, and no metrics path (there is no metrics file)."""
    from experiments.__main__ import main

    monkeypatch.delenv("CUSTOM_QUANT_TYPE", raising=False)
    tok = tmp_path / "tok"
    tok.mkdir()
    argv = ["run", "--model", "llama32-1b", "--tokenizer", str(tok), "--out", str(tmp_path / "runs"), "--iters", "1"]
    _, _, config, _ = _dry(argv[1:], capsys)
    stale = Path(config["output_dir"]) / "metrics.jsonl"  # an earlier run's: not this failed run's metrics
    stale.parent.mkdir(parents=True)
    stale.write_text('{"iteration": 1, "loss": 5.0}\n')
    os.utime(stale, (stale.stat().st_atime - 3600, stale.stat().st_mtime - 3600))
    code = main([*argv, "--timeout", "300"])
    out, err = capsys.readouterr()
    assert code == 1 and out.startswith("failed in ") and "metrics" not in out
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert line.startswith("error: rank 0: ") and "Error" in line and "train.log" in line


@pytest.mark.parametrize("flag", ["--iters", "--eval-iters"])
def test_zero_iterations_are_refused_not_replaced_by_the_config_default(flag, capsys):
    from experiments.__main__ import main
    from experiments.launcher import resolve

    assert main(["run", "--model", "llama32-1b", flag, "0", "--dry-run"]) == 2
    assert f"{flag} 0: must be an integer >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"{flag} 0: must be an integer >= 1"):
        resolve(model="llama32-1b", dataset="mock", scheme="bf16", **{flag[2:].replace("-", "_"): 0})
    code, _, config, _ = _dry(["--model", "llama32-1b", flag, "2"], capsys)
    assert code == 0 and config["train"][{"--iters": "train_iters", "--eval-iters": "eval_iters"}[flag]] == 2


def test_refusals_before_launch_for_byte_tokenizer_full_and_triton_on_cpu(capsys):
    """Settings that could only fail inside the training processes are refused by the launcher, before torchrun."""
    from experiments.__main__ import main

    assert main(["run", "--model", "llama32-1b", "--variant", "full", "--tokenizer", "byte", "--dry-run"]) == 2
    assert "built-in byte tokenizer only fits --variant tiny" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["run", "--model", "llama32-1b", "--kernels", "triton", "--dry-run"]) == 2
        assert "--kernels triton: the training processes run on the CPU" in capsys.readouterr().err


def test_a_run_without_capture_notes_an_earlier_runs_captures(tmp_path):
    from experiments.__main__ import _replacing_note
    from experiments.launcher import resolve

    launch = resolve(model="llama32-1b", dataset="mock", scheme="bf16", out=str(tmp_path))
    assert _replacing_note(launch) is None
    (Path(launch.run.output_dir) / "captures" / "rank-00000").mkdir(parents=True)
    assert "captures nothing and leaves them" in _replacing_note(launch)


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (zombies have none)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:  # ended while we looked
            continue
    return [pid for pid in found if pid != os.getpid()]


@pytest.mark.skipif(not Path("/proc/self/cmdline").is_file(), reason="finds the job's processes through /proc")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_an_interrupted_run_stops_its_training_job(tmp_path, sig):
    """SIGTERM or Ctrl-C (SIGINT) to `experiments run`: the torchrun job (its own process group) is stopped with
    it, not left training in the background; one line says so, no traceback, exit status 128 + signal."""
    import signal
    import subprocess
    import sys
    import time

    signum = getattr(signal, sig)
    out = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if k not in ("CUSTOM_QUANT_TYPE", "TENSOR_SAVE_ENABLED")}
    env["OMP_NUM_THREADS"] = "1"
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "experiments", "run", "--model", "llama32-1b", "--backend", "none",
                             "--eval-interval", "0", "--iters", "2000", "--out", str(out), "--timeout", "300"],
                            cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor alone, as here
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics = out / "llama32-1b-tiny" / "mock" / "bf16" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        assert _processes_mentioning(str(out))  # torchrun and its rank are running
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signum, stdout + stderr
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
        assert f"experiments run: interrupted by {sig}: its training job was stopped (log " in stderr
        assert _processes_mentioning(str(out)) == []
        size = metrics.stat().st_size
        time.sleep(1.5)
        assert metrics.stat().st_size == size  # nothing trains on
    finally:
        for pid in [proc.pid, *_processes_mentioning(str(out))]:  # this test's processes, should it fail
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()


def test_the_dataset_index_cache_follows_the_dataset_files(tmp_path, caplog):
    """Megatron's index cache key does not cover the dataset's contents: a dataset rebuilt at the same prefix
    gets a cache directory of its own under OUT/.data-cache (else old indexes: wrong samples, or a crash). A run
    of it removes the directories of the prefix's earlier files (they stayed there forever), and nothing else:
    not another prefix's cache, nor a directory without fxquant's marker."""
    from experiments.launcher import resolve, supervise
    from fxquant.megatron_glue import dataset_label

    prefix = tmp_path / "data" / "wiki"
    prefix.parent.mkdir()

    def launch(at=prefix):
        return resolve(model="llama32-1b", dataset="wikipedia", scheme="bf16", data_prefix=str(at),
                       out=str(tmp_path / "runs"))

    def cache_dir() -> str:
        return launch().run.data.cache_dir

    def build(size: int, at=prefix) -> None:
        for suffix in (".bin", ".idx"):
            at.with_suffix(suffix).write_bytes(b"\0" * size)
            os.utime(at.with_suffix(suffix), ns=(1, 1))  # one modification time: the size tells them apart
        dataset_label.write(at, dataset_label.DatasetLabel("wikipedia"))

    def run(at=prefix) -> Path:  # a supervised run whose ranks build indexes in the cache directory, as Megatron's
        started = launch(at)
        cache = Path(started.run.data.cache_dir)
        script = (f"import os; os.makedirs({str(cache)!r}, exist_ok=True); "
                  f"open({str(cache / 'x-document_index.npy')!r}, 'wb').write(bytes(64))")
        assert supervise(_scripted(started, script), timeout=60).status == "ok"
        return cache

    build(64)
    first = cache_dir()
    assert Path(first).parent == (tmp_path / "runs" / ".data-cache").resolve()
    assert cache_dir() == first  # the same files: the same cache
    assert not (tmp_path / "runs").exists()  # resolving writes nothing
    assert run() == Path(first)
    other = tmp_path / "data" / "other"
    build(16, at=other)
    kept = [run(other), Path(first).parent / "0123456789abcdef", Path(first).parent / "notes"]
    for unmarked in kept[1:]:  # no marker: not fxquant's to remove
        unmarked.mkdir(parents=True)
        (unmarked / "x-document_index.npy").write_bytes(b"")
    build(32)  # rebuilt at the same prefix
    rebuilt = cache_dir()
    assert rebuilt != first
    with caplog.at_level("INFO", logger="experiments.launcher"):
        run()
    assert not Path(first).exists()
    assert (Path(rebuilt) / "x-document_index.npy").is_file()
    assert f"removed {first}: the dataset indexes of {prefix.resolve()}" in caplog.text
    assert all((d / "x-document_index.npy").is_file() for d in kept)
    marker = json.loads((Path(rebuilt) / "fxquant_prefixes.json").read_text())  # what the cache holds indexes of
    assert marker == {"prefixes": [str(prefix.resolve())]}
    os.utime(prefix.with_suffix(".bin"))  # rewritten in place, same size: a new modification time
    assert cache_dir() not in (first, rebuilt)


def _scripted(launch, script: str):
    """`launch` with its ranks replaced by one Python script: `supervise` without torchrun."""
    import sys
    from dataclasses import dataclass

    from experiments.launcher import Launch

    @dataclass(frozen=True)
    class Scripted(Launch):
        def command(self) -> list[str]:
            return [sys.executable, "-c", script]

    return Scripted(run=launch.run, nproc=launch.nproc, config_path=launch.config_path)


def test_rank_warnings_and_resumes_reach_the_console(tmp_path, capsys):
    """The console shows fxquant's WARNING lines and the resume line of the ranks (Megatron's mock-dataset
    warnings stay in train.log)."""
    from experiments.launcher import resolve, supervise

    lines = ["WARNING megatron.core.datasets.gpt_dataset: Unable to save MockGPTDataset indexes",
             "resumed from iteration 4 (/x/checkpoints)",
             "WARNING fxquant.megatron_glue.checkpoint: the checkpoint's lr schedule differs",
             "iter      5/6 | loss 5.0"]
    launch = resolve(model="llama32-1b", dataset="mock", scheme="bf16", out=str(tmp_path))
    outcome = supervise(_scripted(launch, f"print({chr(10).join(lines)!r})"), timeout=60)
    assert outcome.status == "ok"
    assert capsys.readouterr().out.splitlines() == lines[1:]
    assert outcome.log.read_text().splitlines() == lines


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_a_timeout_must_be_positive(value, capsys):
    from experiments.__main__ import main

    for cmd in (["run", "--model", "llama32-1b"], ["matrix", "--models", "llama32-1b"]):
        with pytest.raises(SystemExit) as exc:
            main([*cmd, "--timeout", value, "--dry-run"])
        assert exc.value.code == 2
        assert f"--timeout: {value}: must be a finite number of seconds > 0" in capsys.readouterr().err


def test_an_out_that_is_a_file_is_an_error_line(tmp_path, capsys, monkeypatch):
    from experiments.__main__ import main

    monkeypatch.delenv("CUSTOM_QUANT_TYPE", raising=False)
    afile = tmp_path / "afile"
    afile.write_text("")
    for extra in (["--dry-run"], ["--iters", "1"]):
        assert main(["run", "--model", "llama32-1b", "--out", str(afile), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"experiments run: error: --out {str(afile)!r}: {afile} is not a directory")


def _scheme_file(tmp_path) -> Path:
    scheme = tmp_path / "schemes" / "my_scheme.yaml"
    scheme.parent.mkdir()
    scheme.write_text("rules:\n  - linear: hifp8\n")
    return scheme


def _trained(launch):
    """What a supervised run leaves, for a matrix whose `supervise` is replaced: two iterations of metrics."""
    from experiments.launcher import Outcome

    run_dir = Path(launch.run.output_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"iteration": 1, "loss": 5.0}\n{"iteration": 2, "loss": 4.0}\n')
    return Outcome("ok", 0, 1.0, run_dir / "train.log")


def test_matrix_names_scheme_files_by_name_and_goes_on_past_a_cell_it_cannot_write(tmp_path, capsys, monkeypatch):
    """A cell whose run directory cannot be written (OSError) fails and the sweep goes on to a summary (it
    aborted without one); a scheme YAML's cell is named by the scheme's name, as its run directory, in the
    summary and the loss curves (it was the file's path)."""
    import experiments.__main__ as cli

    monkeypatch.delenv("CUSTOM_QUANT_TYPE", raising=False)
    scheme = _scheme_file(tmp_path)

    def supervise(launch, timeout, **kwargs):
        if launch.run.scheme == "bf16":
            raise OSError(28, "No space left on device")
        return _trained(launch)

    monkeypatch.setattr(cli, "supervise", supervise)
    out = tmp_path / "runs"
    assert cli.main(["matrix", "--models", "llama32-1b", "--schemes", "bf16", str(scheme), "--out", str(out)]) == 1
    summary = json.loads((out / "matrix_summary.json").read_text())
    assert [(r["run"], r["status"]) for r in summary["runs"]] == [("llama32-1b/mock/bf16", "failed"),
                                                                   ("llama32-1b/mock/my_scheme", "ok")]
    assert "No space left on device" in summary["runs"][0]["error"]
    assert summary["runs"][1]["scheme"] == "my_scheme" and summary["runs"][1]["scheme_file"] == str(scheme)
    assert str(scheme) not in (out / "matrix_summary.txt").read_text()
    svg = (out / "loss_curves.svg").read_text()
    assert "my_scheme" in svg and str(scheme) not in svg
    assert "[failed] llama32-1b/mock/bf16: [Errno 28] No space left on device" in capsys.readouterr().out


def test_an_interrupted_matrix_summarises_the_cells_run(tmp_path, capsys, monkeypatch):
    """Interrupted, a matrix writes the summary of the cells run so far, the interrupted one marked, and exits
    with 128 + signal after one line."""
    import signal

    import experiments.__main__ as cli
    from experiments.launcher import Interrupted

    monkeypatch.delenv("CUSTOM_QUANT_TYPE", raising=False)

    def supervise(launch, timeout, **kwargs):
        if launch.run.scheme == "bf16":
            return _trained(launch)
        raise Interrupted(signal.SIGINT, Path(launch.run.output_dir) / "train.log")

    monkeypatch.setattr(cli, "supervise", supervise)
    out = tmp_path / "runs"
    with pytest.raises(SystemExit) as exc:
        cli.main(["matrix", "--models", "llama32-1b", "--schemes", "bf16", "FA_mxfp8", "linear_mxfp8", "--out", str(out)])
    assert exc.value.code == 130
    runs = json.loads((out / "matrix_summary.json").read_text())["runs"]
    assert [(r["run"], r["status"]) for r in runs] == [("llama32-1b/mock/bf16", "ok"),
                                                       ("llama32-1b/mock/FA_mxfp8", "interrupted")]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "experiments matrix: interrupted by SIGINT: its training job was stopped (log " in err


def test_a_cell_killed_mid_line_leaves_the_sweep_going(tmp_path, capsys, monkeypatch, caplog):
    """A cell killed at its timeout while writing a metrics line (torn last line) is summarised with the losses
    before it, and the sweep goes on (json.loads' error aborted the matrix: exit 2, no summary, cells skipped)."""
    import experiments.__main__ as cli
    from experiments.launcher import Outcome

    monkeypatch.delenv("CUSTOM_QUANT_TYPE", raising=False)

    def supervise(launch, timeout, **kwargs):
        run_dir = Path(launch.run.output_dir)
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text('{"iteration": 1, "loss": 5.0}\n{"iteration": 2, "loss": 4.9}\n{"iter')
        return Outcome("timeout", -9, 5.0, run_dir / "train.log")

    monkeypatch.setattr(cli, "supervise", supervise)
    out = tmp_path / "runs"
    with caplog.at_level("WARNING"):
        status = cli.main(["matrix", "--models", "llama32-1b", "--schemes", "bf16", "FA_mxfp8", "--out", str(out)])
    assert status == 1  # cells timed out
    runs = json.loads((out / "matrix_summary.json").read_text())["runs"]
    assert [(r["run"], r["status"]) for r in runs] == [("llama32-1b/mock/bf16", "timeout"),
                                                       ("llama32-1b/mock/FA_mxfp8", "timeout")]
    assert "line(s) are not JSON and were skipped" in caplog.text


def test_written_since_names_only_files_that_hold_something(tmp_path):
    """The console names metrics.jsonl only when it holds something (a fresh run that failed before its first
    iteration leaves it empty)."""
    import time

    from experiments.__main__ import written_since

    started = time.time()
    metrics = tmp_path / "metrics.jsonl"
    assert written_since(metrics, started) is None
    metrics.write_text("")
    assert written_since(metrics, started) is None
    metrics.write_text('{"iteration": 1}\n')
    assert written_since(metrics, started) == metrics


def test_a_run_config_refuses_wrongly_typed_values_naming_the_key(tmp_path):
    """A hand-edited run config (docs/megatron.md: `distributed_optimizer: true` is set there) with a value of the
    wrong type is refused, naming its dotted key: a quoted "false" is no bool (it was true: tied embeddings, a
    resumed run), 6.5 no int, "abc" no list of prefixes (it was three one-letter prefixes). The rank's entry point
    prints the error in one line."""
    import copy
    import subprocess
    import sys

    from experiments.launcher import resolve
    from fxquant.megatron_glue.run_config import RunConfig

    run = resolve(model="llama31-8b", dataset="mock", scheme="bf16", out=str(tmp_path / "runs")).run
    plain = run.to_dict()
    assert RunConfig.from_dict(copy.deepcopy(plain)) == run
    cases = [("model.tie_embeddings", "false", "expected true or false, got str 'false'"),
             ("resume", "false", "expected true or false"),
             ("train.optim.distributed_optimizer", 0, "expected true or false, got int 0"),
             ("train.train_iters", 6.5, "expected an integer, got float 6.5"),
             ("train.train_iters", "6", "expected an integer, got str '6'"),
             ("train.eval_interval", True, "expected an integer, got bool True"),
             ("train.optim.lr", "3e-3", "expected a number, got str"),
             ("data.prefixes", "abc", "expected a list, got str 'abc'"),
             ("model.extras", [1], "expected a mapping"),
             ("train.precision", "fp8", "is not one of"),
             ("scheme", 3, "expected a string")]
    for key, value, message in cases:
        data = copy.deepcopy(plain)
        *parents, last = key.split(".")
        node = data
        for k in parents:
            node = node[k]
        node[last] = value
        with pytest.raises((TypeError, ValueError), match=f"^run\\.{key.replace('.', '[.]')}: .*{message}"):
            RunConfig.from_dict(data)
    data = copy.deepcopy(plain)
    data["train"]["optim"]["lr"] = 3  # an integer where a float is wanted is that number
    assert RunConfig.from_dict(data).train.optim.lr == 3.0
    data["train"]["optim"]["lr"] = 3e-3
    hidden = data["model"].pop("hidden_size")
    with pytest.raises(ValueError, match=r"^run\.model: missing keys \['hidden_size'\] for ModelConfig"):
        RunConfig.from_dict(data)
    data["model"]["hidden_size"] = hidden
    data["train"]["seq_length"] = 64.0
    config = tmp_path / "bad.json"
    config.write_text(json.dumps(data))
    done = subprocess.run([sys.executable, "-m", "fxquant.megatron_glue.launch", "--config", str(config)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"run config {config}: run.train.seq_length: expected an integer, got float 64.0" in done.stderr


def test_matrix_reruns_count_finished_runs_and_compare_like_the_report(tmp_path, capsys, monkeypatch):
    """A cell whose run finished earlier (its checkpoint at train_iters) is reported from its metrics, not launched
    again (it failed with "nothing to train", and the bf16 reference with it); a cell is compared with the bf16 run
    beside its directory when the matrix has none; the error follows fxquant report's rules (a diverged run: inf,
    not NaN) and the summary is strict JSON."""
    import experiments.__main__ as cli
    from experiments import compare, launcher

    monkeypatch.delenv("CUSTOM_QUANT_TYPE", raising=False)
    out = tmp_path / "runs"
    losses = {"bf16": [5.0, 4.0, 3.0], "linear_mxfp8": [5.5, 4.0, float("nan")], "linear_hifp8": [5.0, 4.4, 3.3]}
    for scheme, values in losses.items():
        run_dir = out / "llama31-8b-tiny" / "mock" / scheme
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "checkpoints" / "latest").write_text("3\n")
        (run_dir / "metrics.jsonl").write_text("".join(
            json.dumps({"iteration": i + 1, "loss": v, **({"val_loss": 9.0} if i == 2 else {})}) + "\n"
            for i, v in enumerate(values)))

    def never(*args, **kwargs):
        raise AssertionError("a finished run was launched again")

    monkeypatch.setattr(cli, "supervise", never)
    monkeypatch.setattr(launcher, "supervise", never)
    code = cli.main(["matrix", "--models", "llama31-8b", "--datasets", "mock", "--schemes", "linear_mxfp8",
                     "linear_hifp8", "--iters", "3", "--out", str(out), "--last-n", "2"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "[done] llama31-8b/mock/linear_mxfp8: finished earlier (its checkpoint is at iteration 3)" in text
    raw = (out / "matrix_summary.json").read_text()
    summary = json.loads(raw, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert [(r["status"], r["finished_earlier"], r["iterations"]) for r in summary["runs"]] == [("ok", True, 3)] * 2
    assert summary["runs"][1]["final_loss"] == 3.3 and summary["runs"][1]["final_val_loss"] == 9.0
    hifp8 = summary["loss_vs_bf16"]["llama31-8b/mock/linear_hifp8"]
    assert hifp8["reference"] == str(out / "llama31-8b-tiny" / "mock" / "bf16")
    assert hifp8["mre_all"] == pytest.approx((0 + 0.1 + 0.1) / 3) and hifp8["mre_last"] == pytest.approx(0.1)
    mxfp8 = summary["loss_vs_bf16"]["llama31-8b/mock/linear_mxfp8"]
    assert (mxfp8["mre_all"], mxfp8["mre_last"], mxfp8["nonfinite_loss"]) == ("inf", "inf", 1)
    assert summary["runs"][0]["final_loss"] is None  # NaN, written as fxquant report's JSON writes it
    failed = [{"run": "m/d/bf16", "model": "m", "dataset": "d", "scheme": "bf16", "status": "failed",
               "run_dir": str(out / "llama31-8b-tiny" / "mock" / "bf16")},
              {"run": "m/d/linear_hifp8", "model": "m", "dataset": "d", "scheme": "linear_hifp8", "status": "ok",
               "run_dir": str(out / "llama31-8b-tiny" / "mock" / "linear_hifp8")}]
    assert compare.against_bf16(failed, last_n=2) == {}  # a failed bf16 cell's directory holds no reference of this matrix


def test_matrix_refuses_a_cell_whose_checkpoint_is_of_another_layout_or_other_settings(tmp_path, capsys, monkeypatch):
    """A finished one-process fp32 cell's checkpoint is the cell's result when rerun as it was ([done]); rerun with
    --tp 2 or --precision bf16 it is another experiment's (a resume would refuse it): the cell is refused before
    anything runs, naming the difference, instead of reported as finished with the other run's metrics."""
    import experiments.__main__ as cli
    from experiments import launcher
    from fxquant.megatron_glue import checkpoint

    monkeypatch.delenv("CUSTOM_QUANT_TYPE", raising=False)
    out = tmp_path / "runs"
    args = dict(model="llama32-1b", dataset="mock", scheme="bf16", iters=2, out=str(out), save_interval=2)
    launch = launcher.resolve(**args)
    ckpt = Path(launch.run.output_dir) / "checkpoints"
    (ckpt / "iter_0000002").mkdir(parents=True)
    torch.save({"iteration": 2, "layout": checkpoint.expected_layout(1, 1, 1),
                "settings": checkpoint.run_settings(launch.run, False)}, ckpt / "iter_0000002" / "rank_00000.pt")
    (ckpt / "latest").write_text("2\n")
    (Path(launch.run.output_dir) / "metrics.jsonl").write_text('{"iteration": 1, "loss": 5.0}\n'
                                                              '{"iteration": 2, "loss": 4.0}\n')

    def never(*a, **k):
        raise AssertionError("no cell may run")

    monkeypatch.setattr(cli, "supervise", never)
    base = ["matrix", "--models", "llama32-1b", "--datasets", "mock", "--schemes", "bf16", "--iters", "2",
            "--out", str(out), "--save-interval", "2"]
    assert cli.main(base) == 0
    assert "[done] llama32-1b/mock/bf16: finished earlier" in capsys.readouterr().out
    for extra, why in ((["--tp", "2"], "layout: checkpoint 1 processes, tp=1, pp=1, dp=1, ep=1, cp=1, this run 2 "
                                       "processes, tp=2, pp=1, dp=1, ep=1, cp=1"),
                       (["--precision", "bf16"], "precision: checkpoint 'fp32', this run 'bf16'")):
        assert cli.main(base + extra) == 1
        text = capsys.readouterr()
        assert f"[refused] llama32-1b/mock/bf16: its run directory's checkpoint ({ckpt}) is of another run ({why})" \
            in text.out
        assert "nothing was run" in text.err


def test_save_interval_sets_the_config_and_is_checked():
    from experiments import launcher

    assert launcher.resolve(model="llama32-1b", dataset="mock", scheme="bf16").run.train.save_interval == 0
    assert launcher.resolve(model="llama32-1b", dataset="mock", scheme="bf16",
                            save_interval=5).run.train.save_interval == 5
    with pytest.raises(ValueError, match=r"--save-interval -1: must be an integer >= 0"):
        launcher.resolve(model="llama32-1b", dataset="mock", scheme="bf16", save_interval=-1)


def test_tensor_parallel_shards_that_split_mx_blocks_are_named(caplog):
    """The tiny llama31-8b's FFN of 224 is 112 per rank at TP 2: fc2's reduction dim ends in a short block and a
    fc1 dgrad block spans gate and up rows; llama32-1b's shards are multiples of 32. The launcher warns for a
    quantized scheme only."""
    import logging

    from experiments import catalog, launcher

    assert catalog.TINY["llama32-1b"].tp_block_splits(2) == [] and catalog.TINY["llama31-8b"].tp_block_splits(1) == []
    splits = catalog.TINY["llama31-8b"].tp_block_splits(2)
    assert splits == ["linear_fc2 fprop (its input columns): 112 per rank, not a multiple of 32",
                      "linear_fc1 dgrad: a block spans the end of the gate rows and the start of the up rows (112 of "
                      "each per rank)"]
    # MoE experts are split by expert tensor parallelism (Megatron's default: the TP size): tiny DeepSeek's expert
    # FFN of 32 is 16 per rank; its dense layer's 256 and its MLA projections are multiples of 32 per rank
    assert catalog.TINY["deepseek2_lite"].tp_block_splits(2) == [
        "experts' linear_fc2 fprop (its input columns): 16 per rank, not a multiple of 32",
        "experts' linear_fc1 dgrad: a block spans the end of the gate rows and the start of the up rows (16 of each "
        "per rank)"]
    assert catalog.TINY["llama31-8b"].tp_block_splits(2, 16) == []  # 112 per rank: seven NVFP4 blocks
    with caplog.at_level(logging.WARNING, logger="experiments.launcher"):
        for scheme in ("bf16", "FA_linear_hifp8", "linear_nvfp4"):  # no blocks, or blocks of 16 that fit
            launcher.resolve(model="llama31-8b", dataset="mock", scheme=scheme, tp=2)
        assert caplog.records == []
        launcher.resolve(model="llama31-8b", dataset="mock", scheme="FA_linear_mxfp8", tp=2)
    assert [r.getMessage().split(": ", 1)[1].split("; the scheme's 32-element")[0] for r in caplog.records] == splits
