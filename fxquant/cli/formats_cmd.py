"""`fxquant formats`: print the table of every number format (FORMATS.md), or its JSON."""
from __future__ import annotations

import argparse
import json

from tabulate import tabulate


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("formats", help="list every number format: bits, block, limits, special codes, default rounding "
                       "(and the compatibility formats)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fxquant import formats
    from fxquant.formats.table import HEADERS, rows

    table = rows([formats.get(n) for n in formats.names()], formats.aliases())
    compat = rows([formats.get(n) for n in formats.compat_names()], {})
    if args.json:
        print(json.dumps([dict(zip(HEADERS, r)) for r in table]
                         + [{**dict(zip(HEADERS, r)), "compatibility": True} for r in compat], indent=2))
    else:
        print(tabulate(table, headers=HEADERS))
        print("\ncompatibility formats (reproduce a predecessor defect; used only when a scheme names them):")
        print(tabulate(compat, headers=HEADERS))
    return 0
