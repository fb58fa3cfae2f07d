"""`fxquant check-spec FILE...`: validate capture placement specs, reporting every problem at once.

Every FILE is checked, whatever the earlier ones gave (a missing or unreadable file is one more problem);
the exit status is 1 when any FILE has a problem."""
from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check-spec", help="validate capture spec YAML file(s) (all problems, with file:line)")
    p.add_argument("files", nargs="+", help="spec YAML files, or shipped spec names (predecessor, linear_io, ...)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing when a spec is valid (default: a "
                   "summary of each valid spec)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fxquant.capture.spec import SpecError, load_spec

    status = 0
    for f in args.files:
        try:
            spec = load_spec(f)
        except SpecError as exc:
            n = len(exc.problems)
            print(f"{f}: {n} problem{'s' * (n != 1)}:\n  " + "\n  ".join(exc.problems), file=sys.stderr)
            status = 1
            continue
        except OSError as exc:  # missing, a directory, unreadable: said, and the other files are still checked
            print(f"{f}: error: {exc}", file=sys.stderr)
            status = 1
            continue
        if not args.quiet:
            npts = sum(len(s.points) for s in spec.sections)
            print(f"{f}: ok: spec {spec.name!r}, {len(spec.sections)} section(s), {npts} point(s)")
            for s in spec.sections:
                pts = ", ".join(f"{p.component.value}.{p.role.value}" + ("[q]" if p.copy.value == "quantized" else "")
                                for p in s.points)
                print(f"  {s.name}: what={s.what.value} iterations={s.when.iterations.describe()} "
                      f"micro_batches={s.when.micro_batches.describe()}: {pts}")
    return status
