"""`fxquant prepare-data`: JSONL / JSONL.gz (or raw WikiText) -> a Megatron indexed dataset (.bin/.idx).

Thin over `fxquant.megatron_glue.data`; the tokenizer is the built-in byte-level one (`--tokenizer byte`,
the default) or a local HuggingFace tokenizer directory.
"""
from __future__ import annotations

import argparse
import json
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare-data", help="tokenize JSONL (`text` field) into a Megatron indexed dataset (.bin/.idx)")
    p.add_argument("inputs", nargs="+", help="input files: .jsonl, .jsonl.gz, or WikiText .txt with --format wikitext")
    p.add_argument("--output-prefix", "-o", required=True, help="output path without suffix; writes PREFIX.bin/.idx")
    p.add_argument("--tokenizer", default="byte", help="'byte' (built-in, vocab 257) or a local HuggingFace tokenizer dir")
    p.add_argument("--format", default="jsonl", choices=["jsonl", "wikitext"], help="input format (default jsonl)")
    p.add_argument("--text-key", default="text", help="JSON field holding the document text (default text)")
    p.add_argument("--no-eod", action="store_true", help="do not append an end-of-document token to each document")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fxquant.megatron_glue import data
    from fxquant.megatron_glue.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    fmt = data.InputFormat.parse(args.format)

    def documents():
        for path in args.inputs:
            yield from data.read_documents(path, fmt, text_key=args.text_key)

    start = time.perf_counter()
    stats = data.write_indexed_dataset(documents(), args.output_prefix, tokenizer, append_eod=not args.no_eod)
    seconds = time.perf_counter() - start
    result = {"prefix": stats.prefix, "bin": f"{stats.prefix}.bin", "idx": f"{stats.prefix}.idx",
              "documents": stats.documents, "tokens": stats.tokens, "dtype": stats.dtype,
              "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "seconds": round(seconds, 3)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"wrote {result['bin']} and {result['idx']}: {stats.documents} documents, {stats.tokens} tokens "
              f"({stats.dtype}, tokenizer {tokenizer.name}, vocab {tokenizer.vocab_size}) in {seconds:.1f}s")
    return 0
