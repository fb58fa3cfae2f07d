"""`fxquant formats`: print the table of every number format (FORMATS.md), or its JSON."""
from __future__ import annotations

import argparse
import json

from tabulate import tabulate


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("formats", help="list every number format: bits, block, limits, special codes, default rounding")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fxquant import formats
    from fxquant.formats.table import HEADERS, rows

    table = rows([formats.get(n) for n in formats.names()], formats.aliases())
    if args.json:
        print(json.dumps([dict(zip(HEADERS, r)) for r in table], indent=2))
    else:
        print(tabulate(table, headers=HEADERS))
    return 0
