"""Which dataset an indexed dataset (`PREFIX.bin/.idx`) belongs to: its label, `PREFIX.dataset.json`.

`fxquant prepare-data --dataset NAME` writes the label beside the files it builds (dataset name, tokenizer,
vocabulary, counts, inputs); `fxquant prepare-data --label NAME -o PREFIX` labels an indexed dataset built
elsewhere (Megatron's `preprocess_data.py`, the predecessor's data). The launcher reads the label of every
prefix a run would read (`check`): a prefix labelled for another dataset, or not labelled at all, is refused,
so the `dolma` run cannot read the `wikipedia` files (the predecessor's dolma scripts did). No Megatron
import here: dry runs check labels without building anything.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUFFIX = ".dataset.json"
BYTE = "byte"


@dataclass(frozen=True)
class DatasetLabel:
    dataset: str
    tokenizer: str | None = None   # 'byte', a tokenizer directory, or None when unknown (labelled afterwards)
    vocab_size: int | None = None
    documents: int | None = None
    tokens: int | None = None
    inputs: tuple[str, ...] = field(default_factory=tuple)

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


def check(dataset: str, prefix: str | Path, tokenizer: str) -> DatasetLabel:
    """The label of `prefix`, which must name `dataset` and a tokenizer of the same kind as `tokenizer`."""
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
    return label
