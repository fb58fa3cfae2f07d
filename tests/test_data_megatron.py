"""Data preparation and reading on Megatron-core: WikiText -> JSONL -> indexed dataset -> GPTDataset batches."""
from __future__ import annotations

import gzip
import json
from dataclasses import replace

import numpy
import pytest

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core", reason="needs megatron-core")


@pytest.fixture(scope="module")
def single_process():
    from fxquant.megatron_glue import parallel

    return parallel.initialize_parallel()


@pytest.fixture(scope="module")
def wikitext_jsonl(wikitext_dir, tmp_path_factory):
    """valid.txt as JSONL.gz, one article per record (the predecessor's input format)."""
    from fxquant.megatron_glue.data import read_documents, write_jsonl

    path = tmp_path_factory.mktemp("wikitext") / "valid.jsonl.gz"
    count = write_jsonl(read_documents(wikitext_dir / "valid.txt", "wikitext"), path)
    return path, count


def test_wikitext_articles_are_split_at_titles(wikitext_jsonl):
    path, count = wikitext_jsonl
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    assert len(records) == count == 60  # WikiText-2 validation has 60 articles
    assert records[0]["text"].startswith("= Homarus gammarus =")
    assert all(r["text"].lstrip().startswith("= ") and not r["text"].lstrip().startswith("= =") for r in records)


def test_prepare_data_cli_round_trip(wikitext_jsonl, tmp_path, capsys, single_process):
    from fxquant.cli import main
    from fxquant.megatron_glue.data import read_documents, read_indexed_dataset
    from fxquant.megatron_glue.tokenizer import ByteTokenizer

    path, count = wikitext_jsonl
    prefix = tmp_path / "wiki" / "valid"
    assert main(["prepare-data", str(path), "-o", str(prefix), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["documents"] == count and result["dtype"] == "uint16"
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["valid.bin", "valid.idx"]  # no temp files left

    dataset = read_indexed_dataset(prefix)
    tok = ByteTokenizer()
    docs = list(read_documents(path))
    assert len(dataset) == len(docs)
    total = 0
    for doc, ids in zip(docs, (dataset[i] for i in range(len(dataset)))):
        assert ids[-1] == tok.eod
        assert tok.detokenize(ids[:-1]) == doc
        total += len(ids)
    assert total == result["tokens"]


def test_gpt_dataset_samples_are_windows_of_the_token_stream(wikitext_jsonl, tmp_path, single_process):
    from fxquant.megatron_glue.data import (DataConfig, DataKind, PretrainingSampler, batch_iterator,
                                            build_datasets, read_documents, write_indexed_dataset)
    from fxquant.megatron_glue.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    path, _ = wikitext_jsonl
    stats = write_indexed_dataset(read_documents(path), tmp_path / "valid", tok)
    config = DataConfig(DataKind.INDEXED, (stats.prefix,), split="90,10,0", cache_dir=str(tmp_path / "cache"))
    train, valid = build_datasets(config, tok, seq_length=64, train_samples=200, valid_samples=20, seed=3)
    assert len(train) >= 200 and len(valid) >= 20
    stream = numpy.concatenate([ids for ids in _all_documents(stats.prefix)])
    text = bytes(stream[stream < 256].astype(numpy.uint8))
    for i in (0, 17, 199):
        sample = train[i]
        tokens, labels = sample["tokens"].numpy(), sample["labels"].numpy()
        assert tokens.shape == labels.shape == (64,)
        numpy.testing.assert_array_equal(tokens[1:], labels[:-1])  # labels are the next tokens
        chunk = bytes(t for t in tokens[:16] if t < 256)
        assert chunk in text  # every sample is real text from the corpus
    sampler = PretrainingSampler(len(train), consumed_samples=8, micro_batch_size=4, dp_rank=0, dp_size=1)
    batch = next(batch_iterator(train, sampler))
    assert batch["tokens"].shape == (4, 64)
    numpy.testing.assert_array_equal(batch["tokens"][0].numpy(), train[8]["tokens"].numpy())


def _all_documents(prefix):
    from fxquant.megatron_glue.data import read_indexed_dataset

    dataset = read_indexed_dataset(prefix)
    return [numpy.array(dataset[i]) for i in range(len(dataset))]  # copies: the mmap closes with dataset


def test_mock_dataset_needs_no_files(single_process):
    from fxquant.megatron_glue.data import DataConfig, build_datasets
    from fxquant.megatron_glue.tokenizer import ByteTokenizer

    train, _ = build_datasets(DataConfig(), ByteTokenizer(), seq_length=32, train_samples=10)
    assert train[0]["tokens"].shape == (32,)
    assert int(train[0]["tokens"].max()) < ByteTokenizer.vocab_size


def test_sampler_splits_data_parallel_ranks_and_resumes():
    from fxquant.megatron_glue.data import PretrainingSampler

    ranks = [list(PretrainingSampler(24, 0, 2, r, 3)) for r in range(3)]
    assert ranks[0][:2] == [[0, 1], [6, 7]] and ranks[2][0] == [4, 5]
    seen = sorted(i for batches in ranks for b in batches for i in b)
    assert seen == list(range(24))
    assert list(PretrainingSampler(24, 12, 2, 1, 3)) == ranks[1][2:]


def test_bad_inputs_name_the_line_and_the_field(tmp_path):
    from fxquant.megatron_glue.data import DataConfig, DataKind, read_documents
    from fxquant.megatron_glue.tokenizer import load_tokenizer

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no 'text' field \(found \['body'\]\)"):
        list(read_documents(bad))
    bad.write_text('{"text": "ok"}\n\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not valid JSON"):
        list(read_documents(bad))
    with pytest.raises(ValueError, match="input format 'csv'"):
        list(read_documents(bad, "csv"))
    with pytest.raises(FileNotFoundError, match="missing"):
        DataConfig(DataKind.INDEXED, (str(tmp_path / "nothing"),))
    with pytest.raises(ValueError, match="at least one"):
        DataConfig(DataKind.INDEXED)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "no-such-tokenizer")


def test_hf_tokenizer_without_the_package_is_a_clear_error(tmp_path):
    import importlib.util

    from fxquant.megatron_glue.tokenizer import load_tokenizer

    if importlib.util.find_spec("tokenizers") or importlib.util.find_spec("transformers"):
        pytest.skip("a HuggingFace tokenizer package is installed; the missing-package error cannot occur")
    with pytest.raises(ValueError, match="pip install tokenizers"):
        load_tokenizer(tmp_path)


def test_empty_input_writes_nothing(tmp_path):
    from fxquant.megatron_glue.data import write_indexed_dataset
    from fxquant.megatron_glue.tokenizer import ByteTokenizer

    with pytest.raises(ValueError, match="empty"):
        write_indexed_dataset([], tmp_path / "empty", ByteTokenizer())
    assert list(tmp_path.iterdir()) == []


def test_a_sampled_split_without_documents_is_refused(tmp_path, single_process):
    """Two documents split 98,2,0 leave the validation split none: Megatron looped forever looking for epochs of
    zero tokens (the rank spun, its log empty); refused with the counts, and fine without validation."""
    from fxquant.megatron_glue.data import DataConfig, DataKind, build_datasets, write_indexed_dataset
    from fxquant.megatron_glue.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    stats = write_indexed_dataset(["first document " * 200, "second document " * 200], tmp_path / "two", tok)
    config = DataConfig(DataKind.INDEXED, (stats.prefix,), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"the validation split of .* holds no document: split '98,2,0' of its 2 "
                                         r"document\(s\) gives it documents 2\.\.2"):
        build_datasets(config, tok, seq_length=32, train_samples=8, valid_samples=4)
    train, _ = build_datasets(config, tok, seq_length=32, train_samples=8)  # no validation: nothing to refuse
    assert len(train) >= 8
    with pytest.raises(ValueError, match="the train split"):
        build_datasets(replace(config, split="0,100,0"), tok, seq_length=32, train_samples=8)
