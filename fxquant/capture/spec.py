"""The capture placement spec: YAML -> frozen dataclasses, validated (issue 4, deliverable 1).

A spec is a list of sections; each says *where* (``layers``: module-path regex, module kinds, layer
indices/ranges), *which tensors* (``points``: component x phase x direction x roles, high-precision
and/or the quantized copy a GEMM consumed), *when* (iterations, micro-batches, ranks), *what* (full
tensors, statistics, both) and optional row sampling. A top-level ``budget`` (bytes, files, tensors)
stops capture cleanly; ``on_error`` says what an I/O error does (stop capturing, or abort training).
Every problem is reported at once with ``file:line``, the dotted path and a did-you-mean
(``fxquant check-spec FILE``). The schema is documented in docs/capture.md.
"""
from __future__ import annotations

import enum
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from fxquant.capture._yaml import Problems, SpecError, did_you_mean, join, load_with_lines, read_text

__all__ = [
    "Budget", "CapturePoint", "CaptureSpec", "Component", "Copy", "Direction", "ErrorPolicy", "Gemm",
    "LayerSelector", "ModuleKind", "Phase", "Role", "Sampling", "SamplingMode", "Section", "Span", "SpecError",
    "What", "Window", "default_spec_path", "load_spec", "parse_spec", "shipped_specs",
]


class Component(str, enum.Enum):
    ATTENTION = "attention"
    LINEAR = "linear"


class Phase(str, enum.Enum):
    PRE = "pre"
    POST = "post"


class Direction(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class Role(str, enum.Enum):
    # attention
    QUERY = "query"
    KEY = "key"
    VALUE = "value"
    PROBS = "probs"
    SCORES = "scores"  # S = scale * Q K^T before the mask and the softmax (where a site materialises it)
    GRAD_QUERY = "grad_query"
    GRAD_KEY = "grad_key"
    GRAD_VALUE = "grad_value"
    GRAD_PROBS = "grad_probs"
    GRAD_SCORES = "grad_scores"  # dS = dL/d(QK^T): the operand of the dQ and dK GEMMs
    # linear
    INPUT = "input"
    WEIGHT = "weight"
    GRAD_INPUT = "grad_input"
    GRAD_WEIGHT = "grad_weight"
    # both
    OUTPUT = "output"
    GRAD_OUTPUT = "grad_output"


class Copy(str, enum.Enum):
    HP = "hp"  # the high-precision tensor as the model computed it
    QUANTIZED = "quantized"  # a GEMM operand exactly as the quantized GEMM consumed it


class Gemm(str, enum.Enum):
    """The GEMM that consumed a quantized operand (its blocking follows that GEMM's reduction dim)."""

    FPROP = "fprop"  # Y = X W^T
    DGRAD = "dgrad"  # dX = dY W
    WGRAD = "wgrad"  # dW = dY^T X
    QK = "qk"  # S = Q K^T
    PV = "pv"  # O = P V
    DP = "dp"  # dP = dO V^T
    DV = "dv"  # dV = P^T dO
    DQ = "dq"  # dQ = dS K
    DK = "dk"  # dK = dS^T Q


class ModuleKind(str, enum.Enum):
    """A site's kind, as scheme rules name it (``fxquant.schemes.SiteKind``: the same values)."""

    QKV = "qkv"
    PROJ = "proj"
    FC1 = "fc1"
    FC2 = "fc2"
    LM_HEAD = "lm_head"
    EMBEDDING = "embedding"
    ROUTER = "router"
    LINEAR = "linear"
    ATTENTION = "attention"

    @property
    def component(self) -> "Component":
        """The component of a site of this kind (attention sites are of kind ``attention``, every other is linear)."""
        return Component.ATTENTION if self is ModuleKind.ATTENTION else Component.LINEAR


class What(str, enum.Enum):
    FULL = "full"
    STATS = "stats"
    BOTH = "both"

    @property
    def tensors(self) -> bool:
        return self is not What.STATS

    @property
    def stats(self) -> bool:
        return self is not What.FULL


class SamplingMode(str, enum.Enum):
    FIRST_ROWS = "first_rows"
    RANDOM_ROWS = "random_rows"


class ErrorPolicy(str, enum.Enum):
    STOP = "stop"  # an I/O error stops capture (recorded); training goes on
    ABORT = "abort"  # an I/O error is raised in the training process at the next tap or at close


# (phase, direction) of every role, per component. Phase is relative to the op: "pre" tensors enter it
# (forward inputs, the incoming gradient), "post" tensors leave it (forward results, produced gradients).
ROLE_TABLE: dict[Component, dict[Role, tuple[Phase, Direction]]] = {
    Component.ATTENTION: {
        Role.QUERY: (Phase.PRE, Direction.FORWARD),
        Role.KEY: (Phase.PRE, Direction.FORWARD),
        Role.VALUE: (Phase.PRE, Direction.FORWARD),
        Role.SCORES: (Phase.POST, Direction.FORWARD),
        Role.PROBS: (Phase.POST, Direction.FORWARD),
        Role.OUTPUT: (Phase.POST, Direction.FORWARD),
        Role.GRAD_OUTPUT: (Phase.PRE, Direction.BACKWARD),
        Role.GRAD_PROBS: (Phase.POST, Direction.BACKWARD),
        Role.GRAD_SCORES: (Phase.POST, Direction.BACKWARD),
        Role.GRAD_QUERY: (Phase.POST, Direction.BACKWARD),
        Role.GRAD_KEY: (Phase.POST, Direction.BACKWARD),
        Role.GRAD_VALUE: (Phase.POST, Direction.BACKWARD),
    },
    Component.LINEAR: {
        Role.INPUT: (Phase.PRE, Direction.FORWARD),
        Role.WEIGHT: (Phase.PRE, Direction.FORWARD),
        Role.OUTPUT: (Phase.POST, Direction.FORWARD),
        Role.GRAD_OUTPUT: (Phase.PRE, Direction.BACKWARD),
        Role.GRAD_INPUT: (Phase.POST, Direction.BACKWARD),
        Role.GRAD_WEIGHT: (Phase.POST, Direction.BACKWARD),
    },
}

# Which GEMMs consume each role as an operand (only these roles have quantized copies).
GEMM_OPERANDS: dict[Component, dict[Role, tuple[Gemm, ...]]] = {
    Component.LINEAR: {
        Role.INPUT: (Gemm.FPROP, Gemm.WGRAD),
        Role.WEIGHT: (Gemm.FPROP, Gemm.DGRAD),
        Role.GRAD_OUTPUT: (Gemm.DGRAD, Gemm.WGRAD),
    },
    Component.ATTENTION: {
        Role.QUERY: (Gemm.QK, Gemm.DK),
        Role.KEY: (Gemm.QK, Gemm.DQ),
        Role.VALUE: (Gemm.PV, Gemm.DP),
        Role.PROBS: (Gemm.PV, Gemm.DV),
        Role.GRAD_OUTPUT: (Gemm.DP, Gemm.DV),
        Role.GRAD_SCORES: (Gemm.DQ, Gemm.DK),
    },
}


@dataclass(frozen=True)
class CapturePoint:
    """One tensor around one op: component, role (which fixes phase and direction), copy."""

    component: Component
    role: Role
    copy: Copy = Copy.HP

    def __post_init__(self) -> None:
        if self.role not in ROLE_TABLE[self.component]:
            allowed = [r.value for r in ROLE_TABLE[self.component]]
            raise ValueError(f"role={self.role.value!r} is not a {self.component.value} role; allowed: {allowed}")
        if self.copy is Copy.QUANTIZED and self.role not in GEMM_OPERANDS[self.component]:
            allowed = [r.value for r in GEMM_OPERANDS[self.component]]
            raise ValueError(f"role={self.role.value!r} is no GEMM operand, so it has no quantized copy; allowed: {allowed}")

    @property
    def phase(self) -> Phase:
        return ROLE_TABLE[self.component][self.role][0]

    @property
    def direction(self) -> Direction:
        return ROLE_TABLE[self.component][self.role][1]


@dataclass(frozen=True)
class Span:
    """Integers ``start <= i < end`` (end None: unbounded) with ``(i - start) % every == 0``, or an explicit set."""

    start: int = 0
    end: int | None = None
    every: int = 1
    values: frozenset[int] | None = None

    def __contains__(self, i: int) -> bool:
        if self.values is not None:
            return i in self.values
        return i >= self.start and (self.end is None or i < self.end) and (i - self.start) % self.every == 0

    def describe(self) -> str:
        if self.values is not None:
            return "{" + ", ".join(map(str, sorted(self.values))) + "}"
        end = "inf" if self.end is None else str(self.end)
        return f"[{self.start}, {end})" + (f" every {self.every}" if self.every != 1 else "")


ALL = Span()


@dataclass(frozen=True)
class LayerSelector:
    """Which sites: module-path regex (``re.search``), module kinds, layer indices (None: any)."""

    module: str | None = None
    kinds: frozenset[ModuleKind] | None = None
    layers: frozenset[int] | None = None

    def matches(self, module_path: str, kind: ModuleKind | None, layer: int | None) -> bool:
        if self.module is not None and re.search(self.module, module_path) is None:
            return False
        if self.kinds is not None and kind not in self.kinds:
            return False
        if self.layers is not None and layer not in self.layers:
            return False
        return True


@dataclass(frozen=True)
class Window:
    iterations: Span = ALL
    micro_batches: Span = ALL
    ranks: frozenset[int] | None = None  # None: every rank

    def contains(self, iteration: int, micro_batch: int, rank: int) -> bool:
        return iteration in self.iterations and micro_batch in self.micro_batches and (
            self.ranks is None or rank in self.ranks
        )


@dataclass(frozen=True)
class Sampling:
    mode: SamplingMode
    rows: int
    seed: int = 0


@dataclass(frozen=True)
class Section:
    name: str
    layers: LayerSelector
    points: tuple[CapturePoint, ...]
    when: Window = Window()
    what: What = What.BOTH
    sampling: Sampling | None = None


@dataclass(frozen=True)
class Budget:
    """Capture stops (cleanly, with the reason recorded) once one limit would be exceeded; None: no limit."""

    bytes: int | None = None
    files: int | None = None  # shard files
    tensors: int | None = None  # manifest records


@dataclass(frozen=True)
class CaptureSpec:
    sections: tuple[Section, ...]
    budget: Budget = Budget()
    on_error: ErrorPolicy = ErrorPolicy.STOP
    name: str = "capture"
    source: str = field(default="<memory>", compare=False)
    text: str = field(default="", compare=False, repr=False)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "CaptureSpec":
        return load_spec(path)

    def sections_for(self, module_path: str, kind: ModuleKind | None, layer: int | None) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.sections) if s.layers.matches(module_path, kind, layer))

    def placement_digest(self) -> str:
        """16 hex digits over what decides the taps a compile inserts: each section's name, layer selector and
        points, in order. A tap carries it, so a session whose spec would read the tap's section indices as other
        sections is refused; the window, ``what`` and ``sampling`` apply at run time and may differ."""
        parts = [[s.name, s.layers.module,
                  None if s.layers.kinds is None else sorted(k.value for k in s.layers.kinds),
                  None if s.layers.layers is None else sorted(s.layers.layers),
                  [[p.component.value, p.role.value, p.copy.value] for p in s.points]] for s in self.sections]
        return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ parsing
_TOP_KEYS = ("version", "name", "sections", "budget", "on_error")
_SECTION_KEYS = ("name", "layers", "points", "when", "what", "sampling")
_LAYER_KEYS = ("module", "kinds", "indices")
_POINT_KEYS = ("component", "phase", "direction", "roles", "copies")
_WHEN_KEYS = ("iterations", "micro_batches", "ranks")
_SPAN_KEYS = ("start", "end", "every")
_BUDGET_KEYS = ("bytes", "files", "tensors")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _check_keys(obj: dict, allowed: tuple[str, ...], path: str, probs: Problems) -> None:
    for key in obj:
        if key not in allowed:
            probs.add(join(path, key), f"unknown key {key!r}; allowed: {list(allowed)}{did_you_mean(key, allowed)}")


def _mapping(obj: object, path: str, probs: Problems) -> dict | None:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        probs.add(path, f"expected a mapping, got {type(obj).__name__} {obj!r}")
        return None
    return obj


def _enum(cls, value: object, path: str, probs: Problems):
    allowed = [m.value for m in cls]
    if isinstance(value, str) and value.strip().lower() in allowed:
        return cls(value.strip().lower())
    probs.add(path, f"{value!r} is not allowed; choose one of {allowed}{did_you_mean(value, allowed)}")
    return None


def _enum_list(cls, value: object, path: str, probs: Problems) -> list | None:
    items = value if isinstance(value, list) else [value]
    out = [_enum(cls, v, join(path, i) if isinstance(value, list) else path, probs) for i, v in enumerate(items)]
    return None if any(o is None for o in out) else out


def _int(value: object, path: str, probs: Problems, minimum: int = 0) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        probs.add(path, f"expected an integer >= {minimum}, got {value!r}")
        return None
    return value


def _size(value: object, path: str, probs: Problems) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value)) if isinstance(value, str) else None
    if m and m.group(2).lower() in _UNITS and int(float(m.group(1)) * _UNITS[m.group(2).lower()]) > 0:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    units = [u for u in _UNITS if u]
    probs.add(path, f"expected a positive size (bytes, or a string like '2GiB'; units {units}), got {value!r}")
    return None


def _empty(value: object, path: str, probs: Problems, what: str) -> bool:
    """``value`` is an empty list, which would select nothing: a problem (leaving the key out selects every one)."""
    if isinstance(value, list) and not value:
        probs.add(path, f"an empty list selects no {what}, so nothing would be captured; name at least one, or "
                  f"leave the key out to select every {what}")
        return True
    return False


def _int_set(value: object, path: str, probs: Problems, what: str) -> frozenset[int] | None:
    """A list of ints and inclusive ``"a-b"`` ranges (or one of them)."""
    if _empty(value, path, probs, what):
        return None
    items = value if isinstance(value, list) else [value]
    out: set[int] = set()
    ok = True
    for i, item in enumerate(items):
        p = join(path, i) if isinstance(value, list) else path
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            out.add(item)
            continue
        m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", item) if isinstance(item, str) else None
        if m and int(m.group(1)) <= int(m.group(2)):
            out.update(range(int(m.group(1)), int(m.group(2)) + 1))
            continue
        probs.add(p, f"expected a {what} (integer >= 0) or an inclusive range like '4-7', got {item!r}")
        ok = False
    return frozenset(out) if ok else None


def _span(value: object, path: str, probs: Problems) -> Span | None:
    if value is None or value == "all":
        return ALL
    if isinstance(value, (list, int, str)) and not isinstance(value, bool):  # a str: one range, '0-5'
        vals = _int_set(value, path, probs, "index")
        return None if vals is None else Span(values=vals)
    m = _mapping(value, path, probs)
    if m is None:
        return None
    _check_keys(m, _SPAN_KEYS, path, probs)
    start = _int(m.get("start", 0), join(path, "start"), probs)
    end = None if m.get("end") is None else _int(m["end"], join(path, "end"), probs)
    every = _int(m.get("every", 1), join(path, "every"), probs, minimum=1)
    if start is not None and end is not None and end <= start:
        probs.add(join(path, "end"), f"end ({end}) must be greater than start ({start}); end is exclusive")
        return None
    if start is None or every is None or (m.get("end") is not None and end is None):
        return None
    return Span(start, end, every)


def _layers(value: object, path: str, probs: Problems) -> tuple[LayerSelector | None, frozenset[ModuleKind] | None]:
    """The section's layer selector (None where any of its keys is bad), and its ``kinds`` when they parse (the
    points are checked against them even where ``module`` or ``indices`` is bad)."""
    m = _mapping(value, path, probs)
    if m is None:
        return None, None
    _check_keys(m, _LAYER_KEYS, path, probs)
    module, ok = m.get("module"), True
    if module is not None and not isinstance(module, str):  # reported; kinds and indices are still checked
        hint = (f"; for any of several paths write one regex with '|', e.g. {'|'.join(map(str, module))!r}"
                if isinstance(module, list) and module else "")
        probs.add(join(path, "module"), f"expected a regular expression (a string), got {type(module).__name__} "
                  f"{module!r}{hint}")
        ok = False
    elif module is not None:
        try:
            re.compile(module)
        except re.error as exc:  # reported; kinds and indices are still checked
            probs.add(join(path, "module"), f"invalid regular expression {module!r}: {exc}")
            ok = False
    kinds = None
    if m.get("kinds") is not None:
        k = None if _empty(m["kinds"], join(path, "kinds"), probs, "module kind") else \
            _enum_list(ModuleKind, m["kinds"], join(path, "kinds"), probs)
        kinds = None if k is None else frozenset(k)
        ok = ok and k is not None
    indices = None
    if m.get("indices") is not None:
        indices = _int_set(m["indices"], join(path, "indices"), probs, "layer index")
        ok = ok and indices is not None
    return (LayerSelector(module, kinds, indices) if ok else None), kinds


def _points(value: object, path: str, probs: Problems,
            kinds: frozenset[ModuleKind] | None = None) -> list[CapturePoint] | None:
    """The points of a section; ``kinds`` (the section's ``layers.kinds``): a point whose component no site of those
    kinds has could never capture anything, a problem."""
    if not isinstance(value, list) or not value:
        probs.add(path, f"expected a non-empty list of points, got {value!r}")
        return None
    out: list[CapturePoint] = []
    for i, item in enumerate(value):
        p = join(path, i)
        m = _mapping(item, p, probs)
        if m is None:
            continue
        _check_keys(m, _POINT_KEYS, p, probs)
        if "component" not in m:
            probs.add(p, f"missing 'component'; choose one of {[c.value for c in Component]}")
            _check_any_role(m.get("roles"), join(p, "roles"), probs)
            continue
        comp = _enum(Component, m["component"], join(p, "component"), probs)
        if comp is not None and kinds and all(k.component is not comp for k in kinds):
            names = sorted(k.value for k in kinds)
            other = sorted({k.component.value for k in kinds})
            probs.add(join(p, "component"), f"component {comp.value!r} never matches: the section's layers.kinds "
                      f"{names} are {' and '.join(other)} sites ({comp.value} sites are of kind "
                      f"{_kinds_of(comp)}); drop the point, or give the kinds of {comp.value} sites")
        lists = []
        for key, kind, default, what in (("phase", Phase, [x.value for x in Phase], "phase"),
                                          ("direction", Direction, [x.value for x in Direction], "direction"),
                                          ("copies", Copy, ["hp"], "copy")):
            value = m.get(key, default)
            lists.append(None if _empty(value, join(p, key), probs, what) else
                         _enum_list(kind, value, join(p, key), probs))
        phases, dirs, copies = lists
        if comp is None:  # the roles are still checked, against every component's
            _check_any_role(m.get("roles"), join(p, "roles"), probs)
            continue
        bad = phases is None or dirs is None or copies is None
        phases, dirs, copies = phases or list(Phase), dirs or list(Direction), copies or [Copy.HP]
        table = ROLE_TABLE[comp]
        if "roles" in m:
            names = m["roles"] if isinstance(m["roles"], list) else [m["roles"]]
            roles = []
            if _empty(m["roles"], join(p, "roles"), probs, f"{comp.value} role"):
                continue
            for j, r in enumerate(names):
                rp = join(join(p, "roles"), j) if isinstance(m["roles"], list) else join(p, "roles")
                allowed = [x.value for x in table]
                if not isinstance(r, str) or r not in allowed:
                    probs.add(rp, f"{r!r} is not a {comp.value} role; allowed: {allowed}{did_you_mean(r, allowed)}")
                    continue
                role = Role(r)
                ph, di = table[role]
                if ph not in phases or di not in dirs:
                    probs.add(rp, f"role {r!r} is a {di.value} {ph.value} tensor, excluded by this point's "
                              f"phase {[x.value for x in phases]} / direction {[x.value for x in dirs]}")
                    continue
                roles.append(role)
        else:
            roles = [r for r, (ph, di) in table.items() if ph in phases and di in dirs]
        if bad:
            continue
        if Copy.QUANTIZED in copies and roles and not any(r in GEMM_OPERANDS[comp] for r in roles):
            allowed = [x.value for x in GEMM_OPERANDS[comp]]
            probs.add(join(p, "copies"), f"none of roles {[r.value for r in roles]} is a GEMM operand, so none has "
                      f"a quantized copy; quantized copies exist for {allowed}")
        for copy in copies:
            for role in roles:
                if copy is Copy.QUANTIZED and role not in GEMM_OPERANDS[comp]:
                    continue  # quantized copies exist only for GEMM operands
                pt = CapturePoint(comp, role, copy)
                if pt not in out:
                    out.append(pt)
    return out


def _kinds_of(component: Component) -> str:
    return " | ".join(k.value for k in ModuleKind if k.component is component)


def _check_any_role(value: object, path: str, probs: Problems) -> None:
    """Report role names that no component has (the point's component is itself wrong)."""
    if value is None:
        return
    names = value if isinstance(value, list) else [value]
    allowed = sorted({r.value for table in ROLE_TABLE.values() for r in table})
    for j, r in enumerate(names):
        if not isinstance(r, str) or r not in allowed:
            rp = join(path, j) if isinstance(value, list) else path
            probs.add(rp, f"{r!r} is not a role of any component; allowed: {allowed}{did_you_mean(r, allowed)}")


def _when(value: object, path: str, probs: Problems) -> Window | None:
    m = _mapping(value, path, probs)
    if m is None:
        return None
    _check_keys(m, _WHEN_KEYS, path, probs)
    it = _span(m.get("iterations"), join(path, "iterations"), probs)
    mb = _span(m.get("micro_batches"), join(path, "micro_batches"), probs)
    ranks = None
    if m.get("ranks", "all") != "all":
        ranks = _int_set(m["ranks"], join(path, "ranks"), probs, "rank")
        if ranks is None:
            return None
    return None if it is None or mb is None else Window(it, mb, ranks)


def _sampling(value: object, path: str, probs: Problems) -> Sampling | None:
    m = _mapping(value, path, probs)
    if m is None:
        return None
    modes = [x.value for x in SamplingMode]
    _check_keys(m, (*modes, "seed"), path, probs)
    given = [k for k in modes if k in m]
    if len(given) != 1:
        probs.add(path, f"give exactly one of {modes}, got {given or 'none'}")
        return None
    rows = _int(m[given[0]], join(path, given[0]), probs, minimum=1)
    seed = _int(m.get("seed", 0), join(path, "seed"), probs)
    if "seed" in m and given[0] == SamplingMode.FIRST_ROWS.value:
        probs.add(join(path, "seed"), "seed only applies to random_rows")
    return None if rows is None or seed is None else Sampling(SamplingMode(given[0]), rows, seed)


def _section(value: object, path: str, index: int, probs: Problems) -> Section | None:
    m = _mapping(value, path, probs)
    if m is None:
        return None
    _check_keys(m, _SECTION_KEYS, path, probs)
    name = m.get("name", f"section{index}")
    if not isinstance(name, str) or not name:
        probs.add(join(path, "name"), f"expected a non-empty string, got {name!r}")
    layers, kinds = _layers(m.get("layers"), join(path, "layers"), probs)
    if "points" not in m:
        probs.add(path, "missing 'points' (which tensors to capture)")
    points = _points(m.get("points"), join(path, "points"), probs, kinds) if "points" in m else None
    when = _when(m.get("when"), join(path, "when"), probs)
    what = _enum(What, m.get("what", "both"), join(path, "what"), probs)
    sampling = None if m.get("sampling") is None else _sampling(m["sampling"], join(path, "sampling"), probs)
    if m.get("sampling") is not None and what is What.STATS:  # whatever else is wrong with the section
        probs.add(join(path, "sampling"), "sampling chooses stored rows; with what: stats nothing is stored")
    if None in (layers, points, when, what) or (m.get("sampling") is not None and sampling is None):
        return None
    return Section(str(name), layers, tuple(points), when, what, sampling)


def parse_spec(data: object, probs: Problems, text: str = "") -> CaptureSpec:
    top = _mapping(data, "", probs)
    if top is None:
        probs.raise_if_any()
    _check_keys(top, _TOP_KEYS, "", probs)
    version = top.get("version", 1)
    if isinstance(version, bool) or version != 1:  # true == 1 in Python
        probs.add("version", f"unsupported version {version!r}; allowed: [1]")
    secs = top.get("sections")
    sections: list[Section] = []
    if not isinstance(secs, list) or not secs:
        probs.add("sections" if "sections" in top else "", f"expected a non-empty list 'sections', got {secs!r}")
    else:
        names: dict[str, int] = {}
        for i, s in enumerate(secs):
            sec = _section(s, join("sections", i), i, probs)
            name = s.get("name", f"section{i}") if isinstance(s, dict) else None  # checked even where sec is None
            if isinstance(name, str) and name:
                if name in names:
                    probs.add(join(join("sections", i), "name"),
                              f"duplicate section name {name!r} (first at sections[{names[name]}])")
                names.setdefault(name, i)
            if sec is not None:
                sections.append(sec)
    budget = Budget()
    b = _mapping(top.get("budget"), "budget", probs)
    if b:
        _check_keys(b, _BUDGET_KEYS, "budget", probs)
        budget = Budget(
            bytes=None if b.get("bytes") is None else _size(b["bytes"], "budget.bytes", probs),
            files=None if b.get("files") is None else _int(b["files"], "budget.files", probs, minimum=1),
            tensors=None if b.get("tensors") is None else _int(b["tensors"], "budget.tensors", probs, minimum=1),
        )
    policy = _enum(ErrorPolicy, top.get("on_error", "stop"), "on_error", probs)
    name = top.get("name", "capture")
    if not isinstance(name, str) or not name:
        probs.add("name", f"expected a non-empty string, got {name!r}")
    probs.raise_if_any()
    return CaptureSpec(tuple(sections), budget, policy, str(name), probs.filename, text)


def load_spec(path_or_text: str | Path, *, text: str | None = None) -> CaptureSpec:
    """Load a spec from a file path, a shipped spec name (``predecessor``), or ``text=`` YAML."""
    if text is None:
        p = Path(path_or_text)
        if not p.is_file() and str(path_or_text) in shipped_specs():
            p = shipped_specs()[str(path_or_text)]
        if not p.is_file():
            known = list(shipped_specs())
            raise FileNotFoundError(
                f"capture spec {str(path_or_text)!r} is neither a file nor a shipped spec {known}{did_you_mean(path_or_text, known)}"
            )
        text, filename = read_text(p), str(p)
    else:
        filename = str(path_or_text)
    data, probs = load_with_lines(text, filename)
    return parse_spec(data, probs, text)


def shipped_specs() -> dict[str, Path]:
    """Name -> path of the specs shipped in fxquant/capture/specs/."""
    d = Path(__file__).resolve().parent / "specs"
    return {p.stem: p for p in sorted(d.glob("*.yaml"))}


def default_spec_path() -> Path:
    return shipped_specs()["predecessor"]
