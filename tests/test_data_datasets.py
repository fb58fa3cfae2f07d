"""Raw text -> the `wikipedia` and `dolma` indexed datasets (`prepare-data --dataset`, worker processes, progress
bar, labels) and the rule that each dataset reads only its own data (`--data-prefix NAME=PREFIX`, labels)."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core", reason="needs megatron-core")


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture
def labelled(tmp_path):
    """A small labelled prefix per dataset, built by the CLI (byte tokenizer)."""
    from fxquant.cli import main

    out = {}
    for name in ("wikipedia", "dolma"):
        src = _jsonl(tmp_path / f"{name}.jsonl", [f"{name} document {i} " * 20 for i in range(12)])
        prefix = tmp_path / name / f"{name}_text_document"
        assert main(["prepare-data", str(src), "--dataset", name, "-o", str(prefix), "-q"]) == 0
        out[name] = str(prefix)
    return out


def test_wikitext_to_wikipedia_with_workers_progress_and_label(wikitext_dir, tmp_path, capsys, monkeypatch):
    """WikiText-2 (raw) -> the wikipedia dataset at its default prefix; 2 worker processes write the same bytes
    as one; the label records what was built; a progress bar goes to stderr."""
    from fxquant.cli import main
    from fxquant.megatron_glue import dataset_label

    inputs = [str(wikitext_dir / "valid.txt"), str(wikitext_dir / "test.txt")]
    default = tmp_path / "wiki" / "wikipedia_text_document"
    monkeypatch.setenv("FXQUANT_WIKIPEDIA_PREFIX", str(default))
    assert main(["prepare-data", *inputs, "--format", "wikitext", "--dataset", "wikipedia", "-j", "2", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["prefix"] == str(default) and result["workers"] == 2 and result["dataset"] == "wikipedia"
    assert result["documents"] == 60 + 62  # WikiText-2 valid + test articles
    assert "prepare-data wikipedia_text_document" in captured.err and " doc" in captured.err  # the tqdm bar

    one = tmp_path / "one" / "w"
    assert main(["prepare-data", *inputs, "--format", "wikitext", "-o", str(one), "-q"]) == 0
    for suffix in (".bin", ".idx"):  # documents in input order whatever the worker count
        assert (default.parent / f"{default.name}{suffix}").read_bytes() == one.with_name(f"w{suffix}").read_bytes()
    label = dataset_label.read(default)
    assert (label.dataset, label.tokenizer, label.vocab_size, label.documents, label.tokens, label.inputs) == \
        ("wikipedia", "byte", 257, 122, result["tokens"], tuple(inputs))
    assert dataset_label.read(one) is None  # built without --dataset: no label, so no run will read it
    assert "no dataset label: add --dataset NAME" in capsys.readouterr().out


def test_each_dataset_reads_only_its_own_data(labelled, tmp_path, capsys):
    from experiments.__main__ import main

    run = ["run", "--model", "llama32-1b", "--scheme", "bf16", "--out", str(tmp_path / "runs"), "--dry-run"]

    def config(argv):
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out.partition("\n")[2])

    assert config([*run, "--dataset", "dolma", "--data-prefix", labelled["dolma"]])["data"]["prefixes"] == \
        [labelled["dolma"]]
    assert config([*run, "--dataset", "dolma", "--data-prefix", f"dolma={labelled['dolma']}"])["data"]["prefixes"] == \
        [labelled["dolma"]]
    refusals = [
        (["--dataset", "dolma", "--data-prefix", labelled["wikipedia"]], "holds the 'wikipedia' dataset"),
        (["--dataset", "dolma", "--data-prefix", f"wikipedia={labelled['wikipedia']}"], "not among the run's datasets"),
        (["--dataset", "mock", "--data-prefix", labelled["dolma"]], "needs exactly one indexed dataset"),
        (["--dataset", "dolma", "--data-prefix", f"dolmaa={labelled['dolma']}"], "did you mean 'dolma'"),
        (["--dataset", "wikipedia", "--data-prefix", labelled["wikipedia"], "--tokenizer", str(tmp_path)],
         "tokenized with 'byte'"),
    ]
    for argv, message in refusals:
        assert main([*run, *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv

    matrix = ["matrix", "--models", "llama32-1b", "--schemes", "bf16", "--out", str(tmp_path / "m"), "--dry-run"]
    assert main([*matrix, "--datasets", "wikipedia", "dolma", "--data-prefix", f"wikipedia={labelled['wikipedia']}",
                 f"dolma={labelled['dolma']}"]) == 0
    assert capsys.readouterr().out.count("torch.distributed.run") == 2
    for argv, message in [
        (["--datasets", "wikipedia", "dolma", "--data-prefix", labelled["wikipedia"]], "name each"),
        (["--datasets", "wikipedia", "dolma", "--data-prefix", f"wikipedia={labelled['wikipedia']}",
          f"dolma={labelled['wikipedia']}"], "one prefix for several datasets"),
        (["--datasets", "wikipedia", "--data-prefix", f"wikipedia={labelled['wikipedia']}",
          f"wikipedia={labelled['dolma']}"], "given twice"),
    ]:
        assert main([*matrix, *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_matrix_gives_each_dataset_its_prefix(labelled, tmp_path, capsys, monkeypatch):
    """A prefix named for one dataset never reaches the other: dolma's default ($FXQUANT_DOLMA_PREFIX) is used."""
    import experiments.__main__ as cli
    from experiments.__main__ import main

    monkeypatch.setenv("FXQUANT_DOLMA_PREFIX", labelled["dolma"])
    seen = {}
    real = cli.resolve

    def spy(**kw):
        launch = real(**kw)
        seen[kw["dataset"]] = list(launch.run.data.prefixes)
        return launch

    monkeypatch.setattr(cli, "resolve", spy)
    assert main(["matrix", "--models", "llama32-1b", "--schemes", "bf16", "--datasets", "wikipedia", "dolma",
                 "--data-prefix", f"wikipedia={labelled['wikipedia']}", "--out", str(tmp_path), "--dry-run"]) == 0
    assert seen == {"wikipedia": [labelled["wikipedia"]], "dolma": [labelled["dolma"]]}
    capsys.readouterr()
    monkeypatch.setenv("FXQUANT_DOLMA_PREFIX", labelled["wikipedia"])  # the predecessor's mistake
    assert main(["matrix", "--models", "llama32-1b", "--schemes", "bf16", "--datasets", "dolma",
                 "--out", str(tmp_path), "--dry-run"]) == 1
    assert "holds the 'wikipedia' dataset" in capsys.readouterr().out


def test_label_data_built_elsewhere(tmp_path, capsys):
    from experiments.__main__ import main as experiments_main
    from fxquant.cli import main
    from fxquant.megatron_glue import dataset_label

    src = _jsonl(tmp_path / "d.jsonl", ["some text " * 30] * 4)
    prefix = tmp_path / "megatron_built"
    assert main(["prepare-data", str(src), "-o", str(prefix), "-q"]) == 0  # stands in for preprocess_data.py
    run = ["run", "--model", "llama32-1b", "--dataset", "dolma", "--data-prefix", str(prefix), "--dry-run",
           "--out", str(tmp_path / "runs")]
    capsys.readouterr()
    assert experiments_main(run) == 2
    assert f"fxquant prepare-data --label dolma -o {prefix}" in capsys.readouterr().err
    assert main(["prepare-data", "--label", "dolma", "-o", str(prefix)]) == 0
    top = dataset_label.max_token_id(prefix)
    assert 0 < top < 257  # byte ids
    # tokenizer unknown (not checked), the largest token id found in the .bin
    assert dataset_label.read(prefix) == dataset_label.DatasetLabel("dolma", max_token_id=top)
    assert experiments_main(run) == 0
    assert main(["prepare-data", "--label", "wikipedai", "-o", str(prefix)]) == 2
    assert "did you mean 'wikipedia'" in capsys.readouterr().err
    assert main(["prepare-data", "--label", "dolma", "-o", str(tmp_path / "absent")]) == 2
    assert "absent.bin not found" in capsys.readouterr().err
    # rebuilding the files without --dataset drops the stale label
    assert main(["prepare-data", str(src), "-o", str(prefix), "-q"]) == 0
    assert dataset_label.read(prefix) is None


def test_data_with_token_ids_the_model_cannot_embed_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    """An indexed dataset built elsewhere with a large vocabulary (as preprocess_data.py writes it with a Llama-3
    tokenizer: int32 ids up to 128255), labelled without --tokenizer, was accepted for a byte-vocabulary tiny model
    and failed inside the rank (IndexError in the embedding). The label records the largest id; the launcher
    refuses ids at or above the model's vocabulary, and a label's tokenizer vocabulary above it."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from experiments.__main__ import main as experiments_main
    from fxquant.cli import main
    from fxquant.megatron_glue import dataset_label

    def build(prefix, top):
        rng = numpy.random.default_rng(0)
        b = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(top + 1))
        for _ in range(40):
            ids = rng.integers(0, top, size=int(rng.integers(60, 200)))
            ids[0] = top  # the largest id, once per document
            b.add_item(torch.tensor(ids, dtype=torch.int64))
            b.end_document()
        b.finalize(f"{prefix}.idx")

    run = ["run", "--model", "llama31-8b", "--dataset", "wikipedia", "--dry-run", "--out", str(tmp_path / "runs")]
    big, small = tmp_path / "llama_text_document", tmp_path / "bytes_text_document"
    build(big, 128255)
    build(small, 256)
    assert dataset_label.token_dtype(big) == numpy.int32 and dataset_label.token_dtype(small) == numpy.uint16
    for prefix, top in ((big, 128255), (small, 256)):
        assert main(["prepare-data", "--label", "wikipedia", "-o", str(prefix), "-q"]) == 0
        assert f"token ids up to {top}" in capsys.readouterr().out
        assert dataset_label.read(prefix).max_token_id == top
    assert experiments_main([*run, "--data-prefix", str(big)]) == 2
    err = capsys.readouterr().err
    assert "holds token ids up to 128255" in err and "the model's vocabulary is 257" in err and "Traceback" not in err
    assert experiments_main([*run, "--data-prefix", str(small)]) == 0  # byte ids: the tiny model embeds them
    capsys.readouterr()
    dataset_label.write(small, dataset_label.DatasetLabel("wikipedia", tokenizer="/tok/gpt2", vocab_size=50257))
    assert experiments_main([*run, "--data-prefix", str(small), "--tokenizer", str(tmp_path)]) == 2
    assert "was tokenized with a vocabulary of 50257" in capsys.readouterr().err
    with monkeypatch.context() as m:  # a misspelt name is refused before the pass over the data
        m.setattr(dataset_label, "max_token_id", lambda *a, **k: pytest.fail("read the data for a misspelt name"))
        assert main(["prepare-data", "--label", "wikipedai", "-o", str(big), "-q"]) == 2
        assert "did you mean 'wikipedia'" in capsys.readouterr().err
    (tmp_path / "broken.idx").write_bytes(b"not an index")
    (tmp_path / "broken.bin").write_bytes(b"")
    assert main(["prepare-data", "--label", "wikipedia", "-o", str(tmp_path / "broken"), "-q"]) == 2
    assert "not a Megatron indexed dataset index" in capsys.readouterr().err
