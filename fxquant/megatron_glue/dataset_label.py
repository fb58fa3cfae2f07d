"""Which dataset an indexed dataset (`PREFIX.bin/.idx`) belongs to: its label, `PREFIX.dataset.json`.

`fxquant prepare-data --dataset NAME` writes the label beside the files it builds (dataset name, tokenizer,
vocabulary, counts, inputs); `fxquant prepare-data --label NAME -o PREFIX` labels an indexed dataset built
elsewhere (Megatron's `preprocess_data.py`, the predecessor's data). The launcher reads the label of every
prefix a run would read (`check`): a prefix labelled for another dataset, or not labelled at all, is refused,
so the `dolma` run cannot read the `wikipedia` files (the predecessor's dolma scripts did), and data whose token
ids the model cannot embed (a label's `max_token_id`, found by `--label` in one pass over `PREFIX.bin`, at or above
the model's vocabulary, or its tokenizer's `vocab_size` above it). No Megatron import here: dry runs check labels without
building anything (the `.idx` header is read as Megatron writes it).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

SUFFIX = ".dataset.json"
BYTE = "byte"
# Megatron's indexed dataset (megatron.core.datasets.indexed_dataset): the .idx starts with this header, a
# little-endian uint64 version and one byte naming the .bin's token dtype (its DType codes)
_INDEX_HEADER = b"MMIDIDX\x00\x00"
_TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                 8: np.uint16}
_SCAN_TOKENS = 1 << 26  # tokens per step of max_token_id's pass over the .bin


@dataclass(frozen=True)
class DatasetLabel:
    dataset: str
    tokenizer: str | None = None   # 'byte', a tokenizer directory, or None when unknown (labelled afterwards)
    vocab_size: int | None = None
    documents: int | None = None
    tokens: int | None = None
    inputs: tuple[str, ...] = field(default_factory=tuple)
    max_token_id: int | None = None  # the largest token id in PREFIX.bin (None: not scanned; -1: no tokens)

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str) or not self.dataset:
            raise ValueError(f"DatasetLabel.dataset must be a dataset name, got {self.dataset!r}")


def path(prefix: str | Path) -> Path:
    return Path(f"{prefix}{SUFFIX}")


def write(prefix: str | Path, label: DatasetLabel) -> Path:
    """Write the label of `prefix` atomically; returns its path."""
    target = path(prefix)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({**asdict(label), "inputs": list(label.inputs)}, indent=2) + "\n")
    os.replace(tmp, target)
    return target


def read(prefix: str | Path) -> DatasetLabel | None:
    """The label of `prefix`, or None when it has none."""
    p = path(prefix)
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
        return DatasetLabel(**{**data, "inputs": tuple(data.get("inputs", ()))})
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"{p}: not a dataset label ({exc}); rewrite it with `fxquant prepare-data --label NAME "
                         f"-o {prefix}`") from None


def token_dtype(prefix: str | Path) -> np.dtype:
    """The dtype of the token ids in `PREFIX.bin`, from the header of `PREFIX.idx`."""
    idx = Path(f"{prefix}.idx")
    with open(idx, "rb") as f:
        head = f.read(len(_INDEX_HEADER) + 9)
    if len(head) < len(_INDEX_HEADER) + 9 or not head.startswith(_INDEX_HEADER) or head[-1] not in _TOKEN_DTYPES:
        raise ValueError(f"{idx}: not a Megatron indexed dataset index (no MMIDIDX header with a known dtype)")
    return np.dtype(_TOKEN_DTYPES[head[-1]])


def max_token_id(prefix: str | Path, progress: bool = False) -> int:
    """The largest token id in `PREFIX.bin` (-1 when it holds none): one pass over the file, memory-mapped."""
    from tqdm import tqdm

    dtype = token_dtype(prefix)
    tokens = np.memmap(f"{prefix}.bin", dtype=dtype, mode="r") if os.path.getsize(f"{prefix}.bin") else []
    top = -1
    steps = range(0, len(tokens), _SCAN_TOKENS)
    for i in tqdm(steps, desc="token ids", unit="step", disable=not progress or len(steps) < 2):
        top = max(top, int(tokens[i:i + _SCAN_TOKENS].max()))
    return top


def check(dataset: str, prefix: str | Path, tokenizer: str, vocab_size: int | None = None) -> DatasetLabel:
    """The label of `prefix`, which must name `dataset` and a tokenizer of the same kind as `tokenizer`, and (given
    the model's `vocab_size`) hold no token id the model cannot embed."""
    label = read(prefix)
    if label is None:
        raise ValueError(f"dataset {dataset!r}: {prefix} has no dataset label ({path(prefix).name}); build it with "
                         f"`fxquant prepare-data ... --dataset {dataset} -o {prefix}`, or label an indexed dataset "
                         f"built elsewhere with `fxquant prepare-data --label {dataset} -o {prefix}`")
    if label.dataset != dataset:
        raise ValueError(f"dataset {dataset!r}: {prefix} holds the {label.dataset!r} dataset ({path(prefix)}); give "
                         f"the {dataset} data (--data-prefix {dataset}=PREFIX), never another dataset's")
    if label.tokenizer is not None and (label.tokenizer == BYTE) != (str(tokenizer) == BYTE):
        raise ValueError(f"dataset {dataset!r}: {prefix} was tokenized with {label.tokenizer!r}, the run uses "
                         f"--tokenizer {tokenizer!r}; rebuild the data with the run's tokenizer or use its own")
    if vocab_size is not None:
        if label.max_token_id is not None and label.max_token_id >= vocab_size:
            found = f"holds token ids up to {label.max_token_id}"
        elif label.max_token_id is None and label.vocab_size is not None and label.vocab_size > vocab_size:
            found = f"was tokenized with a vocabulary of {label.vocab_size}"
        else:
            return label
        raise ValueError(f"dataset {dataset!r}: {prefix} {found} ({path(prefix).name}), but the model's vocabulary "
                         f"is {vocab_size}: its embedding cannot take them; train a model whose vocabulary covers the "
                         f"data's tokenizer (e.g. --variant full --tokenizer DIR), or on data tokenized for this model")
    return label
