"""Training data on Megatron-core: JSONL -> indexed dataset (.bin/.idx), GPTDataset / MockGPTDataset, batches.

- `read_documents(path, InputFormat)` yields document texts from JSONL / JSONL.gz (a `text` field) or
  raw WikiText (articles start at ` = Title = ` lines).
- `write_indexed_dataset(docs, prefix, tokenizer)` tokenizes (optionally in worker processes, with a progress
  bar) and writes Megatron's `.bin/.idx` pair with `megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`
  (an end-of-document token after each document), atomically: both files appear under their final names only
  when complete; then the dataset label (`dataset_label.py`) when one is given.
- `DataConfig` + `build_datasets(...)` build the train/valid splits through Megatron's
  `BlendedMegatronDatasetBuilder` (GPTDataset over indexed prefixes, or MockGPTDataset).
- `PretrainingSampler` hands each data-parallel rank its micro-batches from a consumed-samples count,
  so a resumed run reads exactly the batches an uninterrupted one would, as long as the train split is built for
  the same number of samples (Megatron's shuffle depends on it once the data is read for more than one epoch: a
  resume with a larger --iters warns).
"""
from __future__ import annotations

import enum
import gzip
import json
import logging
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Iterator

import numpy
import torch
from tqdm import tqdm
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from fxquant.megatron_glue import dataset_label
from fxquant.megatron_glue.dataset_label import DatasetLabel
from fxquant.megatron_glue.run_config import DataConfig, DataKind
from fxquant.megatron_glue.tokenizer import tokenize_all

log = logging.getLogger(__name__)


class InputFormat(enum.Enum):
    JSONL = "jsonl"        # one JSON object per line, .jsonl or .jsonl.gz
    WIKITEXT = "wikitext"  # raw WikiText-2/103 .txt, split into articles

    @classmethod
    def parse(cls, value: "InputFormat | str") -> "InputFormat":
        if isinstance(value, cls):
            return value
        for member in cls:
            if str(value).lower() == member.value:
                return member
        raise ValueError(f"input format {value!r} is not valid; allowed: {[m.value for m in cls]}")


_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")


def read_documents(path: str | Path, fmt: InputFormat | str = InputFormat.JSONL,
                   text_key: str = "text") -> Iterator[str]:
    """Yield the non-empty documents of `path`."""
    path = Path(path)
    fmt = InputFormat.parse(fmt)
    if not path.is_file():
        raise FileNotFoundError(f"input file {str(path)!r} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        if fmt is InputFormat.WIKITEXT:
            yield from _wikitext_articles(handle)
            return
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or text_key not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}:{lineno}: no {text_key!r} field (found {keys})")
            text = record[text_key]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field {text_key!r} must be a string, got {type(text).__name__}")
            if text.strip():
                yield text


def _wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
    article: list[str] = []
    for line in lines:
        if _WIKITEXT_TITLE.match(line.rstrip("\n")) and any(l.strip() for l in article):
            yield "".join(article).strip() + "\n"
            article = []
        article.append(line)
    if any(l.strip() for l in article):
        yield "".join(article).strip() + "\n"


def write_jsonl(documents: Iterable[str], path: str | Path, text_key: str = "text") -> int:
    """Write documents as JSONL (gzip when the name ends in .gz); returns the number written."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    count = 0
    with opener(path, "wt", encoding="utf-8") as handle:
        for doc in documents:
            handle.write(json.dumps({text_key: doc}, ensure_ascii=False) + "\n")
            count += 1
    return count


@dataclass(frozen=True)
class PrepareStats:
    prefix: str
    documents: int
    tokens: int
    dtype: str


def write_indexed_dataset(documents: Iterable[str], output_prefix: str | Path, tokenizer,
                          append_eod: bool = True, *, workers: int = 1, progress: bool = False,
                          label: DatasetLabel | None = None) -> PrepareStats:
    """Tokenize `documents` into `{output_prefix}.bin/.idx` (atomically); returns counts.

    workers: tokenizer processes (`tokenizer.tokenize_all`); the order of the documents is kept.
    progress: a tqdm bar of documents and tokens on stderr.
    label: written as `{output_prefix}.dataset.json` with the final counts (`dataset_label`)."""
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    tmp = prefix.with_name(f".{prefix.name}.tmp{os.getpid()}")
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
    n_docs = n_tokens = 0
    bar = tqdm(unit=" doc", desc=f"prepare-data {prefix.name}", disable=not progress, mininterval=0.5)
    try:
        for ids in tokenize_all(documents, tokenizer, workers):
            bar.update(1)
            if append_eod:
                ids.append(tokenizer.eod)
            if not ids:
                continue
            builder.add_item(torch.tensor(ids, dtype=torch.int64))
            builder.end_document()
            n_docs += 1
            n_tokens += len(ids)
            if n_docs % 256 == 0:
                bar.set_postfix(tokens=n_tokens, refresh=False)
        bar.set_postfix(tokens=n_tokens)
        builder.finalize(f"{tmp}.idx")
        if n_docs == 0:
            raise ValueError(f"no documents to write for {str(prefix)!r}: the input is empty")
        for suffix in (".bin", ".idx"):
            with open(f"{tmp}{suffix}", "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(f"{tmp}{suffix}", f"{prefix}{suffix}")
    finally:
        bar.close()
        for suffix in (".bin", ".idx"):
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)
    if label is not None:
        dataset_label.write(prefix, replace(label, documents=n_docs, tokens=n_tokens))
    elif dataset_label.path(prefix).is_file():  # the files were replaced: an earlier label no longer describes them
        dataset_label.path(prefix).unlink()
    log.info("wrote %s.{bin,idx}: %d documents, %d tokens", prefix, n_docs, n_tokens)
    return PrepareStats(prefix=str(prefix), documents=n_docs, tokens=n_tokens, dtype=numpy.dtype(dtype).name)


def read_indexed_dataset(prefix: str | Path) -> IndexedDataset:
    return IndexedDataset(str(prefix), mmap=True)


def build_datasets(data: DataConfig, tokenizer, *, seq_length: int, train_samples: int, valid_samples: int = 0,
                   seed: int = 1234):
    """(train, valid) Megatron datasets of `seq_length`-token samples (valid may be None)."""
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, tokenizer=tokenizer,
        blend=(list(data.prefixes), None) if data.kind is DataKind.INDEXED else None,
        split=data.split if data.kind is DataKind.INDEXED else None,
        path_to_cache=data.cache_dir, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, mmap_bin_files=True,
    )
    if data.kind is DataKind.INDEXED:
        check_splits(data, config.split_matrix, (train_samples, valid_samples))
    cls = MockGPTDataset if data.kind is DataKind.MOCK else GPTDataset
    train, valid, _ = BlendedMegatronDatasetBuilder(
        cls, [train_samples, valid_samples or None, None], lambda: True, config).build()
    if train is None:
        raise ValueError(f"the train split of {data} is empty (split={data.split!r})")
    return train, valid


def check_splits(data: DataConfig, split_matrix, samples: tuple[int, int]) -> None:
    """ValueError when a split that is sampled (train; valid when ``samples[1]``) holds no document of a prefix:
    Megatron would loop forever looking for epochs of zero tokens (``_get_num_epochs``), the rank spinning
    with nothing in its log. Megatron's own split bounds: documents round(lo * n) .. round(hi * n)."""
    for prefix in data.prefixes:
        documents = read_indexed_dataset(prefix).document_indices.shape[0] - 1
        for name, wanted, bounds in zip(("train", "validation"), samples, split_matrix):
            if not wanted or bounds is None:
                continue
            lo, hi = (int(round(b * float(documents))) for b in bounds)
            if hi <= lo:
                raise ValueError(f"the {name} split of {prefix} holds no document: split {data.split!r} of its "
                                 f"{documents} document(s) gives it documents {lo}..{hi}; give the dataset more "
                                 f"documents (or DataConfig.split another split)"
                                 + (", or run without validation (--eval-interval 0)" if name == "validation" else ""))


class PretrainingSampler:
    """Micro-batches of sample indices for one data-parallel rank, starting after `consumed_samples`.

    Each step of `micro_batch_size * dp_size` consecutive samples is cut into per-rank slices, as in
    Megatron-LM's MegatronPretrainingSampler; iteration ends when a full step no longer fits.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int) -> None:
        if micro_batch_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad sampler arguments micro_batch_size={micro_batch_size}, "
                             f"dp_rank={dp_rank}, dp_size={dp_size}")
        self.total, self.consumed = total_samples, consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self) -> Iterator[list[int]]:
        step = self.mbs * self.dp_size
        for start in range(self.consumed, self.total - step + 1, step):
            first = start + self.dp_rank * self.mbs
            yield list(range(first, first + self.mbs))

    def __len__(self) -> int:
        return max(0, (self.total - self.consumed) // (self.mbs * self.dp_size))


def batch_iterator(dataset, sampler: PretrainingSampler, num_workers: int = 0) -> Iterator[dict]:
    """Batches (dicts of stacked tensors) from a Megatron dataset in the sampler's order. The loader has a generator
    of its own: without one, starting it draws its base seed from torch's global generator, which stochastic
    rounding draws its seeds from, so a resumed run (its loader started after the restored RNG state) or a
    validation would shift every later SR seed."""
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         pin_memory=torch.cuda.is_available(), generator=torch.Generator())
    return iter(loader)
