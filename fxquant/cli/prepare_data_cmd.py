"""`fxquant prepare-data`: JSONL / JSONL.gz (or raw WikiText) -> a Megatron indexed dataset (.bin/.idx) + its label.

Thin over `fxquant.megatron_glue.data`; the tokenizer is the built-in byte-level one (`--tokenizer byte`,
the default) or a local HuggingFace tokenizer directory. `--dataset wikipedia|dolma` writes the dataset's
label (`PREFIX.dataset.json`, which `experiments run|matrix` require) and, without `-o`, builds the prefix that
dataset reads by default. `--label NAME -o PREFIX` labels an indexed dataset built elsewhere.

    fxquant prepare-data ../shared/data/wikitext-2/*.txt --format wikitext --dataset wikipedia -j 2
    fxquant prepare-data dolma/*.jsonl.gz --dataset dolma -o data/dolma/dolma_text_document --tokenizer HF_DIR
    fxquant prepare-data --label wikipedia -o dataset/wikipedia_processed/wikipedia_processed_text_document
"""
from __future__ import annotations

import argparse
import json
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare-data", help="tokenize JSONL or WikiText into a Megatron indexed dataset (.bin/.idx)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", help="input files: .jsonl, .jsonl.gz, or WikiText .txt with --format wikitext")
    p.add_argument("--output-prefix", "-o", default=None, metavar="PREFIX",
                   help="output path without suffix; writes PREFIX.bin/.idx (default with --dataset: the prefix the "
                        "dataset reads, $FXQUANT_<DATASET>_PREFIX or data/<dataset>/<dataset>_text_document)")
    p.add_argument("--dataset", default=None, metavar="NAME",
                   help="wikipedia | dolma: the dataset these files are, written to PREFIX.dataset.json (default: no "
                        "label; `experiments run` then refuses the prefix)")
    p.add_argument("--label", default=None, metavar="NAME",
                   help="label the existing indexed dataset -o PREFIX as dataset NAME (no inputs; e.g. data built by "
                        "Megatron's preprocess_data.py)")
    p.add_argument("--tokenizer", default=None,
                   help="'byte' (built-in, vocab 257) or a local HuggingFace tokenizer dir (default byte; with --label: "
                        "recorded as given, unknown when absent)")
    p.add_argument("--format", default="jsonl", choices=["jsonl", "wikitext"], help="input format (default jsonl)")
    p.add_argument("--text-key", default="text", help="JSON field holding the document text (default text)")
    p.add_argument("--no-eod", action="store_true", help="do not append an end-of-document token to each document")
    p.add_argument("-j", "--workers", type=int, default=1, metavar="N", help="tokenizer processes (default 1)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar (default: a bar on stderr)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (default: one line)")
    p.set_defaults(func=run)


def _dataset(name: str, flag: str) -> str:
    from experiments import catalog
    from fxquant.formats.options import did_you_mean

    allowed = [n for n, d in catalog.DATASETS.items() if d.env is not None]
    if name not in allowed:
        raise ValueError(f"{flag} {name!r}{did_you_mean(name, allowed)}: allowed: {', '.join(allowed)} (mock reads "
                         f"no files)")
    return name


def _label_existing(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fxquant.megatron_glue import dataset_label

    if args.inputs or args.dataset:
        raise ValueError("--label NAME labels an existing indexed dataset: give only -o PREFIX, no inputs or --dataset")
    if args.output_prefix is None:
        raise ValueError("--label NAME needs -o PREFIX (the indexed dataset to label)")
    prefix = args.output_prefix
    missing = [s for s in (".bin", ".idx") if not Path(f"{prefix}{s}").is_file()]
    if missing:
        raise FileNotFoundError(f"--label: {prefix}{missing[0]} not found; -o names an existing indexed dataset "
                                f"(PREFIX.bin / PREFIX.idx)")
    name = _dataset(args.label, "--label")  # before the pass over the data: a misspelt name fails at once
    top = dataset_label.max_token_id(prefix, progress=not args.quiet)  # the run refuses ids its model cannot embed
    label = dataset_label.DatasetLabel(name, tokenizer=args.tokenizer, max_token_id=top)
    print(f"labelled {prefix} as dataset {label.dataset!r} (token ids up to {top}): {dataset_label.write(prefix, label)}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.label is not None:
        return _label_existing(args)
    from experiments import catalog
    from fxquant.megatron_glue import data
    from fxquant.megatron_glue.dataset_label import DatasetLabel
    from fxquant.megatron_glue.tokenizer import load_tokenizer

    if not args.inputs:
        raise ValueError("no input files: give .jsonl / .jsonl.gz files (or WikiText .txt with --format wikitext)")
    dataset = None if args.dataset is None else _dataset(args.dataset, "--dataset")
    prefix = args.output_prefix or (dataset and catalog.dataset_prefix(dataset))
    if prefix is None:
        raise ValueError("give -o PREFIX, or --dataset wikipedia|dolma to build the prefix that dataset reads")
    tokenizer = load_tokenizer(args.tokenizer or "byte")
    fmt = data.InputFormat.parse(args.format)

    def documents():
        for path in args.inputs:
            yield from data.read_documents(path, fmt, text_key=args.text_key)

    label = None if dataset is None else DatasetLabel(dataset, tokenizer=tokenizer.name,
                                                      vocab_size=tokenizer.vocab_size, inputs=tuple(args.inputs))
    start = time.perf_counter()
    stats = data.write_indexed_dataset(documents(), prefix, tokenizer, append_eod=not args.no_eod,
                                       workers=args.workers, progress=not args.quiet, label=label)
    seconds = time.perf_counter() - start
    result = {"prefix": stats.prefix, "bin": f"{stats.prefix}.bin", "idx": f"{stats.prefix}.idx",
              "dataset": dataset, "documents": stats.documents, "tokens": stats.tokens, "dtype": stats.dtype,
              "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "workers": args.workers,
              "seconds": round(seconds, 3)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"wrote {result['bin']} and {result['idx']}: {stats.documents} documents, {stats.tokens} tokens "
              f"({stats.dtype}, tokenizer {tokenizer.name}, vocab {tokenizer.vocab_size}) in {seconds:.1f}s"
              + (f"; dataset {dataset!r} (use it with --dataset {dataset})" if dataset else
                 "; no dataset label: add --dataset NAME to train on it"))
    return 0
