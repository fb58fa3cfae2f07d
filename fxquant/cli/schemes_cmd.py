"""`fxquant schemes`: the preset families (patterns over the format names), the predecessor's names, and
with `--all` every preset with its description; `fxquant schemes NAME|FILE.yaml` describes one scheme."""
from __future__ import annotations

import argparse

from tabulate import tabulate

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schemes", help="list the preset schemes (patterns and names), or describe one",
                       description=__doc__)
    p.add_argument("scheme", nargs="?", default=None, help="a preset name or scheme YAML path to describe")
    p.add_argument("--all", action="store_true", help="every preset name with its description")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fxquant import schemes
    from fxquant.schemes.presets import _PREFIXES, PREDECESSOR_NAMES, _describe, format_names

    if args.scheme is not None:
        print(schemes.get(args.scheme).describe())
        return 0
    if args.all:
        print(tabulate([(n, schemes.get(n).description) for n in schemes.names()], headers=["scheme", "quantizes"]))
        return 0
    families = [("bf16", schemes.get("bf16").description)] + [(f"{p}_X", _describe(p, "X")) for p in _PREFIXES]
    families.append(("legacy_<predecessor name>", "what the predecessor effectively computed for that name"))
    print(tabulate(families, headers=["preset", "quantizes"]))
    print(f"\nX: {', '.join(format_names())}")
    print(f"the predecessor's names: {', '.join(PREDECESSOR_NAMES)}")
    print(f"{len(schemes.names())} presets (--all lists them); a scheme YAML path works wherever a name does "
          f"(docs/schemes.md)")
    return 0
