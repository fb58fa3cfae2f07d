"""The table of all formats shown by `fxquant formats` (data read from the format objects, nothing retyped)."""
from __future__ import annotations

import math
from fractions import Fraction

from fxquant.formats.base import Format
from fxquant.formats.element import ElementSpec, FixedPoint, MiniFloat

HEADERS = ["format", "bits", "scale", "max normal", "min normal", "min subnormal", "special codes", "defaults", "description"]


def exact(v: float) -> str:
    """A float written exactly: an integer, 2^k, a short fraction, or %g for very large values."""
    m, e = math.frexp(v)
    if m == 0.5:
        return f"2^{e - 1}" if not (0 <= e - 1 <= 10) else str(int(v))
    if v.is_integer() and v < 1e9:
        return str(int(v))
    frac = Fraction(v)
    return f"{frac.numerator}/{frac.denominator}" if 1 < frac.denominator <= 1024 else f"{v:.6g}"


def special_codes(e: ElementSpec) -> str:
    if not isinstance(e, MiniFloat):
        return "0x00 zero, 0x80 NaN, 0x6F/0xEF +-Inf" if e.has_inf else "none (two's complement, -128 unused)"
    return {
        "fn": "S.1..1.1..1 NaN, no Inf",
        "ieee": "S.1..1.0..0 Inf, S.1..1.x NaN",
        "none": "none",
    }[e.nan_style]


def aliases_of(aliases: dict[str, str]) -> dict[str, list[str]]:
    """Format name -> its aliases."""
    by_target: dict[str, list[str]] = {}
    for alias, target in aliases.items():
        by_target.setdefault(target, []).append(alias)
    return by_target


def rows(formats: list[Format], aliases: dict[str, str]) -> list[list[object]]:
    """One table row per format (``HEADERS``); the first cell is its name with its aliases in parentheses."""
    by_target = aliases_of(aliases)
    out = []
    for f in formats:
        e = f.element
        name = f.name + (f" ({', '.join(by_target[f.name])})" if f.name in by_target else "")
        out.append([
            name,
            e.bits,
            f.scale_layout,
            exact(e.max_normal),
            "-" if isinstance(e, FixedPoint) else exact(e.min_normal),  # no exponent: no normal range (FORMATS.md)
            exact(e.min_subnormal),
            special_codes(e),
            f.resolve().describe(),
            f.description,
        ])
    return out
