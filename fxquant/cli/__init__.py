"""The `fxquant` command line.

Each verb lives in its own module of this package and exposes ``register(subparsers)``, which adds
its parser and sets ``func`` to a callable taking the parsed namespace and returning an exit code.
Printing is allowed here (and only here, in the library).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Modules of fxquant.cli that provide verbs; add a new verb by adding its module here.
_VERB_MODULES: tuple[str, ...] = ("formats_cmd", "prepare_data_cmd", "check_spec_cmd", "capture_cmd", "explain_cmd", "report_cmd",
                                  "collect_cmd", "draw_cmd", "what_if_cmd")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxquant",
        description="Quantized-GEMM emulation, tensor capture and analysis for low-precision training research.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for name in _VERB_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"fxquant {args.verb}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
