"""Quantization options as enums and one frozen dataclass (FORMATS.md, "Rounding modes", "MX block formats").

Strings are accepted only at the boundary (``parse_enum``) and become enum members at once.
"""
from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass
from typing import TypeVar


class Rounding(str, enum.Enum):
    RNE = "rne"  # nearest, ties to even
    TA = "ta"  # nearest, ties away from zero
    SR = "sr"  # stochastic, unbiased
    RZ = "rz"  # toward zero


class ScaleMode(str, enum.Enum):
    FLOOR = "floor"  # OCP default: floor(log2 amax) - emax_elem
    RCEIL = "rceil"  # NVIDIA: ceil(log2(amax / max_normal)), never clips
    CEIL = "ceil"  # ceil(log2 amax) - emax_elem
    EVEN = "even"  # amax rounded (RNE) to the element's mantissa width, then floor


class Scaling(str, enum.Enum):
    NONE = "none"  # element values as they are
    TENSOR = "tensor"  # one power-of-two scale per tensor, amax placed just under a target


E = TypeVar("E", bound=enum.Enum)


def did_you_mean(value: str, choices: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_enum(cls: type[E], value: object, argument: str) -> E:
    """Turn ``value`` (a member or its string value) into a member of ``cls``, or raise ValueError."""
    if isinstance(value, cls):
        return value
    # A lookup, not a loop over the members: Dynamo on torch 2.11 cannot iterate an Enum class, and formats
    # are called from code that torch.compile traces with fullgraph=True.
    member = cls._value2member_map_.get(value.lower()) if isinstance(value, str) else None
    if member is not None:
        return member
    allowed = [m.value for m in cls]
    raise ValueError(
        f"{argument}={value!r} is not allowed; choose one of {allowed}{did_you_mean(str(value), allowed)}"
    )


@dataclass(frozen=True)
class QuantOptions:
    """Fully resolved options of one quantize call; every field has its final value."""

    rounding: Rounding
    saturate: bool
    scale_mode: ScaleMode | None = None  # MX formats only
    scaling: Scaling = Scaling.NONE  # element formats with optional per-tensor scaling
    scale_target: float | None = None  # with scaling=TENSOR: amax * 2**k lands at or just under this
    block_2d: bool = False  # NVFP4: one scale per 16x16 tile of a 2-D tensor (NVIDIA's recipe for weights)

    def describe(self) -> str:
        parts = [f"rounding={self.rounding.value}", f"saturate={self.saturate}"]
        if self.scale_mode is not None:
            parts.append(f"scale_mode={self.scale_mode.value}")
        if self.block_2d:
            parts.append("block_2d=True")
        if self.scaling is not Scaling.NONE:
            parts.append(f"scaling={self.scaling.value}(target={self.scale_target:g})")
        return ", ".join(parts)
