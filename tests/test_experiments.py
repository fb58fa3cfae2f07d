"""experiments/: faithful published configs, dry runs for 3 models x 2 datasets x 10 schemes, refusals, a real run."""
from __future__ import annotations

import json

import pytest

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

    tok = tmp_path / "tokenizer"
    tok.mkdir()
    for scheme in PREDECESSOR_SCHEMES:
        assert main(["run", "--model", model, "--dataset", dataset, "--scheme", scheme, "--variant", "full",
                     "--config", "standard", "--tokenizer", str(tok), "--data-prefix", data_prefixes[dataset],
                     "--nproc", "8", "--tp", "2", "--pp", "1", "--out", str(tmp_path), "--dry-run"]) == 0
        out = capsys.readouterr().out
        command, _, config = out.partition("\n")
        assert "torch.distributed.run" in command and "--nproc-per-node=8" in command
        resolved = json.loads(config)
        assert resolved["scheme"] == scheme and resolved["model"]["name"] == model
        assert resolved["layout"] == {"tp": 2, "pp": 1, "ep": 1}
        assert resolved["data"]["prefixes"] == [data_prefixes[dataset]] and resolved["train"]["seq_length"] == 8192


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama31-8b", "--tp", "3", "--nproc", "3"], "tp=3 does not divide num_attention_heads"),
    (["--model", "llama32-1b", "--pp", "4", "--nproc", "4"], "pp=4 does not divide num_layers=2"),
    (["--model", "llama31-8b", "--variant", "full"], "needs --tokenizer"),
    (["--model", "llama31-8b", "--dataset", "dolma", "--data-prefix", "/nonexistent/x"], "x.bin not found"),
    (["--model", "lama31-8b"], "did you mean 'llama31-8b'"),
    (["--model", "llama31-8b", "--scheme", "FA_hifp"], "did you mean 'FA_hifp8'"),
    (["--model", "llama31-8b", "--nproc", "3"], "global batch 8 is not divisible"),
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
    assert code == 0, capsys.readouterr().out
    summary = json.loads((tmp_path / "matrix_summary.json").read_text())
    assert [r["status"] for r in summary["runs"]] == ["ok", "ok"]
    mre = summary["loss_vs_bf16"]["llama31-8b/mock/linear_hifp8"]
    assert 0 < mre["mre_all"] < 0.2 and mre["mre_last"] is not None
