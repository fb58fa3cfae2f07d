"""TensorQuant: how one tensor is quantized (a format plus its options), as one frozen value.

Schemes are built from TensorQuants; the ``fxquant::quantize`` op carries one as a canonical spec string
(``"mxfp8_e4m3:rounding=rne,scale_mode=floor"``), the only place a TensorQuant is a string.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fxquant.formats.options import QuantOptions, did_you_mean

_OPTION_KEYS = ("rounding", "scale_mode", "saturate", "scaling", "scale_target", "block_2d")


@dataclass(frozen=True)
class TensorQuant:
    """A format name and explicit options (None = the format's default). Validated on construction."""

    format: str
    rounding: str | None = field(default=None, compare=False)
    scale_mode: str | None = field(default=None, compare=False)
    saturate: bool | None = field(default=None, compare=False)
    scaling: str | None = field(default=None, compare=False)
    scale_target: float | None = field(default=None, compare=False)
    block_2d: bool | None = field(default=None, compare=False)
    # Equality and hashing use the format and the resolved options, not how they were spelled.
    options: QuantOptions = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from fxquant import formats

        object.__setattr__(self, "format", formats.canonical_name(self.format))
        fmt = formats.get(self.format)
        extra = {}
        if self.scaling is not None:
            extra["scaling"] = self.scaling
        if self.scale_target is not None:
            extra["scale_target"] = self.scale_target
        if self.block_2d is not None:
            extra["block_2d"] = self.block_2d
        problem = fmt.inapplicable_option(extra)
        if problem is not None:
            raise ValueError(problem)
        opts = fmt.resolve(rounding=self.rounding, scale_mode=self.scale_mode, saturate=self.saturate, **extra)
        object.__setattr__(self, "options", opts)

    @property
    def fmt(self):
        from fxquant import formats

        return formats.get(self.format)

    def quantize(self, x: torch.Tensor, dim: int = -1, seed: int | None = None) -> torch.Tensor:
        """The pure-torch reference quantization of ``x`` along ``dim``."""
        return self.fmt.quantize(x, dim, seed=seed, **self._kwargs())

    def _kwargs(self) -> dict:
        return {k: getattr(self, k) for k in _OPTION_KEYS if getattr(self, k) is not None}

    def spec(self) -> str:
        """Canonical string form, with every resolved option spelled out (stable across defaults)."""
        o = self.options
        parts = [f"rounding={o.rounding.value}"]
        if o.scale_mode is not None:
            parts.append(f"scale_mode={o.scale_mode.value}")
        parts.append(f"saturate={int(o.saturate)}")
        if o.scale_target is not None:
            parts.append(f"scaling={o.scaling.value}")
            parts.append(f"scale_target={o.scale_target!r}")
        if o.block_2d:
            parts.append("block_2d=1")
        return f"{self.format}:{','.join(parts)}"

    @classmethod
    def from_spec(cls, spec: str) -> "TensorQuant":
        """Parse ``"fmt"`` or ``"fmt:key=value,..."`` (the form ``spec()`` writes)."""
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"a quantization spec must be a non-empty string, got {spec!r}")
        name, _, rest = spec.strip().partition(":")
        kwargs: dict = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq and key in _OPTION_KEYS:
                raise ValueError(f"option {key!r} in spec {spec!r} needs a value: {key}=VALUE")
            if not eq or key not in _OPTION_KEYS:
                raise ValueError(
                    f"bad option {item!r} in spec {spec!r}; options are {list(_OPTION_KEYS)}"
                    f"{did_you_mean(key, _OPTION_KEYS)}"
                )
            value = value.strip()
            if key in kwargs:
                raise ValueError(f"option {key!r} is given twice in spec {spec!r}; give each option once")
            if key in ("saturate", "block_2d"):
                if value.lower() not in ("0", "1", "true", "false"):
                    raise ValueError(f"{key}={value!r} in spec {spec!r}: allowed 0, 1, true, false")
                kwargs[key] = value.lower() in ("1", "true")
            elif key == "scale_target":
                try:
                    kwargs[key] = float(value)
                except ValueError:
                    raise ValueError(f"scale_target={value!r} in spec {spec!r}: must be a number") from None
            else:
                kwargs[key] = value
        return cls(name, **kwargs)

    def __str__(self) -> str:
        return self.spec()
