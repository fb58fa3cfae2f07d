"""fxquant.formats: every number format as data, with the pure-torch reference that defines the truth.

    >>> from fxquant import formats
    >>> fmt = formats.get("mxfp8")                 # alias of mxfp8_e4m3
    >>> y = fmt.quantize(x, dim=-1)                # fake-quant: same shape, dtype, device
    >>> enc = fmt.encode(x); fmt.decode(enc)       # codes + scales; decode(encode(x)) == quantize(x)

The contract is ../shared/design/FORMATS.md; `fxquant formats` prints the table of all formats.
"""
from __future__ import annotations

from fxquant.formats.base import Encoded, Format
from fxquant.formats.element import BF16, E2M1, E2M3, E3M2, E4M3, E5M2, FP16, HIF8, INT8, ElementSpec
from fxquant.formats.legacy import TINY, LegacyClampFormat
from fxquant.formats.mx import MXFormat
from fxquant.formats.nvfp4 import NVFP4Format
from fxquant.formats.options import QuantOptions, Rounding, ScaleMode, Scaling, did_you_mean
from fxquant.formats.scalar import ElementFormat
from fxquant.formats import traced_ops  # noqa: F401,E402  (defines the ops traced quantizes record)

__all__ = [
    "Encoded",
    "ElementSpec",
    "Format",
    "QuantOptions",
    "Rounding",
    "ScaleMode",
    "Scaling",
    "aliases",
    "compat_names",
    "get",
    "names",
]

_FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        MXFormat("mxfp8_e4m3", E4M3, "MX: FP8 E4M3 elements, 32-element blocks, E8M0 scale"),
        MXFormat("mxfp8_e5m2", E5M2, "MX: FP8 E5M2 elements, 32-element blocks, E8M0 scale"),
        MXFormat("mxfp6_e3m2", E3M2, "MX: FP6 E3M2 elements, 32-element blocks, E8M0 scale"),
        MXFormat("mxfp6_e2m3", E2M3, "MX: FP6 E2M3 elements, 32-element blocks, E8M0 scale"),
        MXFormat("mxfp4_e2m1", E2M1, "MX: FP4 E2M1 elements, 32-element blocks, E8M0 scale"),
        MXFormat("mxint8", INT8, "MX: INT8 elements (x 2^-6), 32-element blocks, E8M0 scale"),
        NVFP4Format("nvfp4", "NVFP4: E2M1 elements, 16-element blocks, E4M3 block scale, fp32 tensor scale"),
        ElementFormat("hifp8", HIF8, "HiFloat8: tapered precision (3/2/1-bit mantissa), ties away"),
        ElementFormat("fp8_e4m3", E4M3, "OCP FP8 E4M3 element-wise, optional per-tensor scaling"),
        ElementFormat("fp8_e5m2", E5M2, "OCP FP8 E5M2 element-wise, optional per-tensor scaling"),
        ElementFormat("bf16", BF16, "bfloat16 cast (baseline)", allow_tensor_scaling=False, default_saturate=False),
        ElementFormat("fp16", FP16, "float16 cast (baseline)", allow_tensor_scaling=False, default_saturate=False),
    )
}

_ALIASES: dict[str, str] = {"mxfp8": "mxfp8_e4m3", "mxfp4": "mxfp4_e2m1", "hif8": "hifp8"}

# Compatibility formats (fxquant/formats/legacy.py): reachable by name, never a default, not in names().
_COMPAT: dict[str, Format] = {
    f.name: f
    for f in (
        LegacyClampFormat("hifp8_legacy_clamp", _FORMATS["hifp8"], TINY,
                          "HiFloat8 as the predecessor computed it: tiny non-zero values clamped up to +-2^-22"),
    )
}


def names() -> list[str]:
    """Canonical format names, in table order."""
    return list(_FORMATS)


def compat_names() -> list[str]:
    """Formats that reproduce a predecessor defect for comparison with old results (off by default)."""
    return list(_COMPAT)


def aliases() -> dict[str, str]:
    """Alias -> canonical name (kept from the predecessor system)."""
    return dict(_ALIASES)


def canonical_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"a format name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _FORMATS and key not in _COMPAT:
        known = names() + list(_ALIASES) + compat_names()
        raise ValueError(f"unknown format {name!r}{did_you_mean(key, known)}; known formats: {', '.join(known)}")
    return key


def get(name: str) -> Format:
    """The format called ``name`` (a canonical name or an alias); ValueError with a did-you-mean otherwise."""
    key = canonical_name(name)
    return _FORMATS[key] if key in _FORMATS else _COMPAT[key]
