"""Tokenizers for data preparation and training: a built-in byte-level one, and HuggingFace from a local directory.

Both expose what Megatron's GPTDataset reads from a tokenizer (`vocab_size`, `eod`, `unique_identifiers`)
plus `tokenize(text) -> list[int]` / `detokenize(ids) -> str`. `load_tokenizer("byte")` or
`load_tokenizer("/path/to/hf-tokenizer-dir")`. The HuggingFace path needs the `tokenizers` package (or
`transformers`); neither is a dependency of fxquant, and a clear error says what to install.
`tokenize_all(texts, tokenizer, workers=N)` tokenizes in N worker processes, in order.
"""
from __future__ import annotations

import importlib.util
import json
import multiprocessing
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

BYTE = "byte"


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, end-of-document 256. Vocabulary 257; needs no files."""

    vocab_size = 257
    eod = 256

    def __init__(self) -> None:
        self.unique_identifiers = OrderedDict(class_=type(self).__name__)
        self.name = BYTE

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A HuggingFace tokenizer loaded from a local directory (tokenizer.json), never from the network."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"tokenizer directory {str(directory)!r} does not exist; give a local "
                                    f"HuggingFace tokenizer directory or {BYTE!r}")
        self.name = str(directory)
        if importlib.util.find_spec("tokenizers") is not None and (directory / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
            self._encode = lambda text: self._tok.encode(text, add_special_tokens=False).ids
            self._decode = lambda ids: self._tok.decode(list(ids))
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            self.eod = self._find_eod(self._tok.get_vocab(with_added_tokens=True), directory)
        elif importlib.util.find_spec("transformers") is not None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            self._encode = lambda text: self._tok(text, add_special_tokens=False)["input_ids"]
            self._decode = lambda ids: self._tok.decode(list(ids))
            self.vocab_size = len(self._tok)
            self.eod = self._tok.eos_token_id if self._tok.eos_token_id is not None else \
                self._find_eod(self._tok.get_vocab(), directory)
        else:
            raise ValueError(
                f"tokenizer={str(directory)!r} needs the HuggingFace 'tokenizers' package (with tokenizer.json "
                f"in that directory) or 'transformers'; neither is installed. Install one "
                f"(pip install tokenizers) or use tokenizer={BYTE!r}")
        self.unique_identifiers = OrderedDict(class_=type(self).__name__, path=str(directory))

    @staticmethod
    def _find_eod(vocab: dict[str, int], directory: Path) -> int:
        config = directory / "tokenizer_config.json"
        if config.is_file():
            eos = json.loads(config.read_text()).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if eos in vocab:
                return vocab[eos]
        for candidate in ("<|end_of_text|>", "<|endoftext|>", "</s>", "<｜end▁of▁sentence｜>", "<eos>"):
            if candidate in vocab:
                return vocab[candidate]
        raise ValueError(f"cannot find an end-of-document token in the tokenizer at {str(directory)!r}; "
                         f"set eos_token in its tokenizer_config.json")

    def tokenize(self, text: str) -> list[int]:
        return list(self._encode(text))

    def detokenize(self, ids) -> str:
        return self._decode([int(i) for i in ids])


def load_tokenizer(spec: str | Path) -> ByteTokenizer | HFTokenizer:
    """`"byte"` -> ByteTokenizer; a directory path -> HFTokenizer."""
    if str(spec) == BYTE:
        return ByteTokenizer()
    return HFTokenizer(spec)


# -- worker processes of `fxquant prepare-data --workers N` ------------------------------------------------------
_WORKER_TOKENIZER: ByteTokenizer | HFTokenizer | None = None


def _init_worker(spec: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = load_tokenizer(spec)


def _tokenize_in_worker(text: str) -> list[int]:
    return _WORKER_TOKENIZER.tokenize(text)


def tokenize_all(documents: Iterable[str], tokenizer: ByteTokenizer | HFTokenizer, workers: int = 1,
                 chunksize: int = 8) -> Iterator[list[int]]:
    """`tokenizer.tokenize` of each document, in order; with `workers > 1` in that many processes, each
    loading the tokenizer by its name (`load_tokenizer(tokenizer.name)`)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r}: must be an integer >= 1")
    if workers == 1:
        for text in documents:
            yield tokenizer.tokenize(text)
        return
    with multiprocessing.get_context().Pool(workers, initializer=_init_worker, initargs=(tokenizer.name,)) as pool:
        yield from pool.imap(_tokenize_in_worker, documents, chunksize)
