"""Command-line pieces shared by several verbs: ``--where FIELD=V1,V2`` conditions and their help text, an
integer >= 1 and a positive-seconds argparse type, the check that every capture DIR is a directory, and the error
when the DIRs gave nothing to work on."""
from __future__ import annotations

import argparse
import math
from pathlib import Path


WHERE_HELP = ("records whose manifest FIELD equals VALUE (a number matches it stored as a number or as text: "
              "run_id=4711 matches \"4711\"; FIELD=V1,V2: any of those values). Repeatable: conditions on different "
              "FIELDs must all hold, values given for the same FIELD add up (--where role=input --where role=weight "
              "is --where role=input,weight); default: every record")


def where_conditions(items: list[str]) -> dict:
    """``--where`` items -> CaptureSet.query conditions: ``FIELD=VALUE`` (integers as integers, those written with
    a leading zero as text, ``None`` as None;
    the query matches an integer with the same digits stored as a string) or ``FIELD=V1,V2`` (any of those values). Items for different fields must all hold; the values of items for one
    field add up (``["role=input", "role=weight"]`` is ``["role=input,weight"]``)."""
    values: dict[str, list] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--where {item!r}: expected FIELD=VALUE or FIELD=V1,V2")
        # an integer only where it reads back the same: "0042" stays text (a run id "0042" stored as a string)
        vals = [int(v) if v.lstrip("-").isdigit() and str(int(v)) == v else (None if v == "None" else v)
                for v in value.split(",")]
        seen = values.setdefault(key, [])
        seen += [v for v in vals if v not in seen]
    return {key: vals if len(vals) > 1 else vals[0] for key, vals in values.items()}


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def positive_seconds(text: str) -> float:
    """argparse ``type=`` of --timeout: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds > 0") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number of seconds > 0")
    return value


def check_dirs(dirs: list[str]) -> None:
    """Every DIR must be an existing directory: a mistyped path is an error, not an empty result."""
    missing = [d for d in dirs if not Path(d).exists()]
    if missing:
        raise FileNotFoundError(f"capture director{'y' if len(missing) == 1 else 'ies'} not found: {', '.join(missing)}")
    files = [d for d in dirs if not Path(d).is_dir()]
    if files:
        raise NotADirectoryError(f"not a directory (give capture directories): {', '.join(files)}")


def nothing_found(found: int, problems: list[str], dirs: list[str], where: list[str],
                  what: str = "capture records") -> str | None:
    """The error when the DIRs gave ``found == 0`` of ``what``: the ``--where`` filter matched nothing, or the
    DIRs were empty or skipped (the warnings printed before say why)."""
    if not dirs or found:
        return None
    text = f"no {what} in {', '.join(dirs)}"
    if where:
        text += f" match --where {' '.join(where)}"
    if problems:
        text += " (see the warnings above)"
    return text
