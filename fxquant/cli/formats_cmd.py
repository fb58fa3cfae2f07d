"""`fxquant formats`: print the table of every number format (FORMATS.md), or its JSON."""
from __future__ import annotations

import argparse
import json

from tabulate import tabulate


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("formats", help="list every number format: bits, block, limits, special codes, default rounding "
                       "(and the compatibility formats)",
                       description="Print the table of every number format fxquant implements (FORMATS.md): its bits, "
                       "scale layout, largest normal, smallest normal and subnormal, special codes, default options and "
                       "a description, then the compatibility formats (which reproduce a predecessor defect and are "
                       "used only where a scheme names them). --json prints the same as a list of objects, the format's "
                       "canonical name under \"format\" and its other names under \"aliases\".")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fxquant import formats
    from fxquant.formats.table import HEADERS, aliases_of, rows

    compat = rows([formats.get(n) for n in formats.compat_names()], {})
    if args.json:  # names as formats.get takes them: the canonical one, and its aliases apart
        by_target = aliases_of(formats.aliases())
        plain = rows([formats.get(n) for n in formats.names()], {})
        print(json.dumps([{**dict(zip(HEADERS, r)), "aliases": by_target.get(r[0], [])} for r in plain]
                         + [{**dict(zip(HEADERS, r)), "aliases": [], "compatibility": True} for r in compat], indent=2))
    else:
        table = rows([formats.get(n) for n in formats.names()], formats.aliases())
        print(tabulate(table, headers=HEADERS))
        print("\ncompatibility formats (reproduce a predecessor defect; used only when a scheme names them):")
        print(tabulate(compat, headers=HEADERS))
    return 0
