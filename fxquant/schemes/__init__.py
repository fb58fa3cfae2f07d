"""fxquant.schemes: declarative quantization schemes (which GEMM operand, which format, at which site).

    >>> from fxquant import schemes
    >>> s = schemes.get("FA_linear_hifp8")          # a preset name, or a path to a scheme YAML
    >>> s.linear_for(Site.from_path("decoder.layers.0.mlp.linear_fc1"))   # LinearQuant | None
    >>> print(s.describe())

docs/schemes.md is the user guide (preset table, YAML reference).
"""
from __future__ import annotations

import functools
from pathlib import Path

from fxquant.formats.options import did_you_mean
from fxquant.schemes.model import (
    AttentionQuant,
    Component,
    GemmQuant,
    LinearQuant,
    MatmulQuant,
    Site,
    SiteKind,
    site_kind_for,
)
from fxquant.schemes.presets import PREDECESSOR_NAMES, all_names, generate
from fxquant.schemes.rules import LayerSpan, Rule, Selector, UnmatchedRule
from fxquant.schemes.scheme import Scheme
from fxquant.schemes.yaml_io import SchemeError

__all__ = [
    "AttentionQuant", "Component", "GemmQuant", "LayerSpan", "LinearQuant", "MatmulQuant", "Rule", "Scheme",
    "SchemeError", "Selector", "Site", "SiteKind", "UnmatchedRule", "get", "names", "preset_dir", "site_kind_for",
]


def preset_dir() -> Path:
    """The folder of the shipped preset YAML files."""
    return Path(__file__).resolve().parent / "presets"


def names() -> list[str]:
    """Every preset name (``get`` accepts these, case-insensitively)."""
    return all_names()


@functools.lru_cache(maxsize=None)
def _by_lower() -> dict[str, str]:
    return {n.lower(): n for n in all_names()}


@functools.lru_cache(maxsize=256)
def _preset(name: str) -> Scheme:
    path = preset_dir() / f"{name}.yaml"
    if path.is_file():
        return Scheme.from_yaml(path)
    scheme = generate(name)
    assert scheme is not None, name  # names come from all_names(), which generate() covers
    return scheme


def get(name_or_path: "str | Path | Scheme") -> Scheme:
    """A preset by name (case-insensitive), or a scheme YAML file by path; a Scheme is returned as it is.

    A string ending in .yaml/.yml or holding a "/" is a path; otherwise a preset name wins over a file of that name
    in the working directory (``./NAME`` reads the file). Unknown names raise ValueError with a did-you-mean and
    the list of preset families."""
    if isinstance(name_or_path, Scheme):
        return name_or_path
    if isinstance(name_or_path, Path):
        return Scheme.from_yaml(name_or_path)
    if not isinstance(name_or_path, str):
        raise TypeError(f"scheme must be a preset name, a YAML path or a Scheme, got {type(name_or_path).__name__}")
    key = name_or_path.strip()
    if key.endswith((".yaml", ".yml")) or "/" in key:
        return Scheme.from_yaml(key)
    canonical = _by_lower().get(key.lower())
    if canonical is None and Path(key).is_file():
        return Scheme.from_yaml(key)
    if canonical is None:
        known = all_names()
        raise ValueError(
            f"unknown scheme {name_or_path!r}{did_you_mean(key, known)}; presets: bf16, linear_X, FA_X, FA_QK_X, "
            f"FA_PV_X, FA_QKPV_X, FA_linear_X (X a format name, see `fxquant formats`), legacy_<predecessor name>; "
            f"or a path to a scheme YAML. The predecessor's names: {', '.join(PREDECESSOR_NAMES)}"
        )
    return _preset(canonical)
