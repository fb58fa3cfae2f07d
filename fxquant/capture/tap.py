"""A capture tap's identity: which tensor of which site, encoded as the string argument of the op.

The tap-insertion pass bakes the ``Tap``s of one tensor into the graph as the ``str`` argument of a single
``fxquant::capture`` call (``encode_taps``: one JSON object for one tap, a JSON list for several, e.g. the
shared input of q/k/v projections); the runtime decodes it (``decode_taps``, cached). Everything the
manifest needs about the site travels in the string, so graphs restored from a compile cache need no
side table.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from fxquant.capture.spec import Component, Copy, Direction, Gemm, ModuleKind, Phase, Role, ROLE_TABLE


@dataclass(frozen=True)
class Tap:
    component: Component
    role: Role
    module: str  # module path as in the model (``decoder.layers.0.self_attention.linear_qkv``)
    sections: tuple[int, ...]  # indices of the spec sections that selected this tap
    kind: ModuleKind | None = None
    layer: int | None = None  # global layer index (the compile pass numbers layers across pipeline stages)
    copy: Copy = Copy.HP
    gemm: Gemm | None = None  # for a quantized copy: the GEMM that consumed it
    qspec: str | None = None  # for a quantized copy: TensorQuant.spec() of its format
    dim: int | None = None  # for a quantized copy: the blocked (reduction) dim
    shard_dim: int | None = None  # tensor-parallel split dim of this tensor, if any
    placement: str | None = None  # CaptureSpec.placement_digest() of the spec whose section indices ``sections`` are

    def __post_init__(self) -> None:
        if self.role not in ROLE_TABLE[self.component]:
            raise ValueError(f"role={self.role.value!r} is not a {self.component.value} role")
        if (self.copy is Copy.QUANTIZED) != (self.qspec is not None):
            raise ValueError("a quantized copy needs qspec (its format), and only a quantized copy has one")

    @property
    def phase(self) -> Phase:
        return ROLE_TABLE[self.component][self.role][0]

    @property
    def direction(self) -> Direction:
        return ROLE_TABLE[self.component][self.role][1]

    def encode(self) -> str:
        return json.dumps(self._fields(), separators=(",", ":"), sort_keys=True)

    def _fields(self) -> dict:
        return {
            "c": self.component.value, "r": self.role.value, "m": self.module, "s": list(self.sections),
            "k": None if self.kind is None else self.kind.value, "l": self.layer, "cp": self.copy.value,
            "g": None if self.gemm is None else self.gemm.value, "q": self.qspec, "d": self.dim, "sd": self.shard_dim,
            "p": self.placement,
        }


def encode_taps(taps: tuple[Tap, ...] | list[Tap]) -> str:
    """The op's string for the taps of one tensor: ``Tap.encode()`` for one tap, a JSON list for several."""
    if not taps:
        raise ValueError("encode_taps needs at least one tap")
    if len(taps) == 1:
        return taps[0].encode()
    return json.dumps([t._fields() for t in taps], separators=(",", ":"), sort_keys=True)


@functools.lru_cache(maxsize=4096)
def decode_taps(text: str) -> tuple[Tap, ...]:
    """The taps of one ``fxquant::capture`` call (either form ``encode_taps`` writes)."""
    try:
        d = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"malformed capture tap string {text[:200]!r}: {exc}") from None
    return tuple(_tap(x, text) for x in d) if isinstance(d, list) else (_tap(d, text),)


def decode_tap(text: str) -> Tap:
    """The single tap of ``text`` (a string holding several is an error)."""
    taps = decode_taps(text)
    if len(taps) != 1:
        raise ValueError(f"capture tap string holds {len(taps)} taps, expected one: {text[:200]!r}")
    return taps[0]


def _tap(d: object, text: str) -> Tap:
    try:
        return Tap(
            component=Component(d["c"]), role=Role(d["r"]), module=str(d["m"]), sections=tuple(d["s"]),
            kind=None if d["k"] is None else ModuleKind(d["k"]), layer=d["l"], copy=Copy(d["cp"]),
            gemm=None if d["g"] is None else Gemm(d["g"]), qspec=d["q"], dim=d["d"], shard_dim=d["sd"],
            placement=d.get("p"),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"malformed capture tap string {text[:200]!r}: {exc}") from None
