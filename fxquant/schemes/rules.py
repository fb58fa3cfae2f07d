"""Scheme rules and their resolution: which rule configures a site, and what it gives.

A ``Scheme`` is an ordered tuple of ``Rule``s. A rule has a ``Selector`` (all of its parts must match) and
configures the linear component, the attention component, or both. For a site, the candidates are the
rules that configure the site's component and whose selector matches it; the winner is the candidate with
the highest ``(priority, specificity, position in the file)``. Specificity, most specific first:

    modules (path regex)  >  layers (indices, ranges, first_layers, last_layers)  >  kinds  >  no selector

compared as the tuple (has modules, has layers, has kinds), so ``{layers: [0], kinds: [fc1]}`` beats
``{layers: [0]}``, which beats ``{kinds: [fc1]}``. Among equals the later rule wins. The winner alone
decides the site (rules are not merged). LM head and embedding sites are only matched by a rule that
names them: its ``kinds`` lists them, or its ``modules`` regex matches their path.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from fxquant.schemes.model import (
    EXPLICIT_ONLY_KINDS,
    AttentionQuant,
    Component,
    LinearQuant,
    Site,
    SiteKind,
    parse_kind,
)

_RANGE_RE = re.compile(r"^\s*(-?\d+)\s*\.\.\s*(-?\d+)\s*$|^\s*(\d+)\s*-\s*(\d+)\s*$")


@dataclass(frozen=True)
class LayerSpan:
    """Layers ``start..stop`` inclusive; negative values count from the end (-1 = last layer). ``2..-1`` is layer 2
    to the last; a negative start with a non-negative stop (``-1..2``) is refused: it would cover layers only in
    models of at most a few layers."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        for v in (self.start, self.stop):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"LayerSpan bounds must be ints, got {v!r}")
        if self.start < 0 <= self.stop:
            raise ValueError(
                f"layer range {self.start}..{self.stop} starts counted from the last layer and stops counted from the "
                f"first, so it is empty in any model of more than {self.stop - self.start} layers (here "
                f"{self._spelled_with_n()}); give both bounds non-negative ('0..2'), both negative ('-3..-1'), a "
                f"non-negative start and a negative stop ('2..-1': layer 2 to the last), or use first_layers / "
                f"last_layers"
            )
        if (self.start >= 0) == (self.stop >= 0) and self.start > self.stop:
            raise ValueError(
                f"layer range {self.start}..{self.stop} is empty: start must not exceed stop "
                f"(write '{self.stop}..{self.start}')"
            )

    @classmethod
    def parse(cls, value: object) -> "LayerSpan":
        """A LayerSpan from a layer index (``3``, ``-1``, ``"3"``) or a range string (``"2..5"``, ``"2-5"``,
        ``"-3..-1"``, ``"2..-1"``), as the scheme YAML and ``Selector(layers=...)`` take them; ValueError otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(value, value)
        if isinstance(value, str):
            m = _RANGE_RE.match(value)
            if m:
                a, b = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
                return cls(int(a), int(b))  # LayerSpan refuses an empty or mixed-sign range, saying why
            if re.fullmatch(r"\s*-?\d+\s*", value):
                return cls(int(value), int(value))
        raise ValueError(f"expected a layer index (0, -1) or a range ('2..5', '2-5', '2..-1'), got {value!r}")

    def _spelled_with_n(self) -> str:
        """The span with its negative bound written as ``N-k``: ``N-1..2``."""
        return "..".join(f"N{v}" if v < 0 else str(v) for v in (self.start, self.stop))

    def contains(self, layer: int, num_layers: int | None) -> bool:
        lo, hi = self.start, self.stop
        if lo < 0 or hi < 0:
            if num_layers is None:
                return False
            lo = lo + num_layers if lo < 0 else lo
            hi = hi + num_layers if hi < 0 else hi
        return lo <= layer <= hi

    def __str__(self) -> str:
        return str(self.start) if self.start == self.stop else f"{self.start}..{self.stop}"


@dataclass(frozen=True)
class Selector:
    """Which sites a rule applies to; every given part must match (layer parts are a union). An empty ``kinds`` /
    ``layers`` does not restrict. ``kinds`` may name kinds (``("fc1",)``) and ``layers`` hold indices and range
    strings (``(0, "2..5")``), as in the YAML: they become SiteKind / LayerSpan here."""

    modules: str | None = None  # regex matched against the whole module path (re.fullmatch)
    kinds: tuple[SiteKind, ...] = ()
    layers: tuple[LayerSpan, ...] = ()
    first_layers: int | None = None
    last_layers: int | None = None

    def __post_init__(self) -> None:
        # Kind names and layer indices / range strings become SiteKind / LayerSpan here (the YAML gives the same).
        object.__setattr__(self, "kinds", tuple(dict.fromkeys(parse_kind(k) for k in self._items("kinds"))))
        object.__setattr__(self, "layers", tuple(LayerSpan.parse(v) for v in self._items("layers")))
        if self.modules is not None:
            if not isinstance(self.modules, str):
                raise TypeError(f"Selector.modules must be a regular expression string or None, got {self.modules!r}")
            if not self.modules.strip():
                raise ValueError("Selector.modules: an empty regex selects nothing; leave it None to select every site")
            try:
                re.compile(self.modules)
            except re.error as exc:
                raise ValueError(f"modules={self.modules!r} is not a valid regular expression: {exc}") from None
        for name in ("first_layers", "last_layers"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name}={v!r} must be a positive int")

    def _items(self, name: str) -> tuple:
        v = getattr(self, name)
        if isinstance(v, (str, int, SiteKind, LayerSpan)) or not isinstance(v, (tuple, list)):
            example = "('fc1', 'fc2')" if name == "kinds" else "(0, '2..5', -1)"
            raise TypeError(f"Selector.{name} must be a tuple (or list), e.g. {name}={example}, got {v!r}")
        return tuple(v)

    @property
    def has_layers(self) -> bool:
        return bool(self.layers) or self.first_layers is not None or self.last_layers is not None

    @property
    def specificity(self) -> tuple[bool, bool, bool]:
        return (self.modules is not None, self.has_layers, bool(self.kinds))

    def matches_layer(self, site: Site) -> bool:
        if not self.has_layers:
            return True
        if site.layer is None:
            return False
        if any(span.contains(site.layer, site.num_layers) for span in self.layers):
            return True
        if self.first_layers is not None and site.layer < self.first_layers:
            return True
        if self.last_layers is not None and site.num_layers is not None:
            return site.layer >= site.num_layers - self.last_layers
        return False

    def matches(self, site: Site) -> bool:
        if self.modules is not None and re.fullmatch(self.modules, site.rule_path) is None:
            return False
        if self.kinds and site.kind not in self.kinds:
            return False
        return self.matches_layer(site)

    def names_explicitly(self, site: Site) -> bool:
        """Whether this selector names ``site`` itself (needed for LM head and embeddings)."""
        return site.kind in self.kinds or (
            self.modules is not None and re.fullmatch(self.modules, site.rule_path) is not None
        )

    def describe(self) -> str:
        parts = []
        if self.modules is not None:
            parts.append(f"modules={self.modules!r}")
        if self.kinds:
            parts.append("kinds=" + ",".join(k.value for k in self.kinds))
        if self.layers:
            parts.append("layers=" + ",".join(str(s) for s in self.layers))
        if self.first_layers is not None:
            parts.append(f"first_layers={self.first_layers}")
        if self.last_layers is not None:
            parts.append(f"last_layers={self.last_layers}")
        return " ".join(parts) if parts else "(all)"


@dataclass(frozen=True)
class Rule:
    """A selector plus what it configures. ``linear`` / ``attention`` None: this rule does not configure that
    component; an all-high-precision LinearQuant / AttentionQuant: it keeps matched sites unquantized."""

    selector: Selector = Selector()
    linear: LinearQuant | None = None
    attention: AttentionQuant | None = None
    priority: int = 0
    where: str = field(default="", compare=False)  # "file:line" of the rule in its YAML, for messages

    def __post_init__(self) -> None:
        if not isinstance(self.selector, Selector):
            raise TypeError(f"Rule.selector must be a Selector (Selector() selects every site), got "
                            f"{type(self.selector).__name__}")
        if self.linear is None and self.attention is None:
            raise ValueError("a rule must configure linear, attention or both")
        if self.linear is not None and not isinstance(self.linear, LinearQuant):
            raise TypeError(f"Rule.linear must be a LinearQuant or None, got {type(self.linear).__name__}")
        if self.attention is not None and not isinstance(self.attention, AttentionQuant):
            raise TypeError(f"Rule.attention must be an AttentionQuant or None, got {type(self.attention).__name__}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise TypeError(f"Rule.priority must be an int, got {self.priority!r}")
        kinds = self.selector.kinds
        if kinds and not any(self.configures(k.component) for k in kinds):
            raise ValueError(
                f"a rule selecting kinds {[k.value for k in kinds]} must configure "
                f"{' or '.join(sorted({k.component.value for k in kinds}))}: otherwise it could never apply"
            )
        dead = unreachable_components(kinds, [c for c in Component if self.configures(c)])
        if dead:
            raise ValueError(f"a rule selecting kinds {[k.value for k in kinds]} selects no {' or '.join(dead)} "
                             f"site: its {' and '.join(dead)} part could never apply")

    def configures(self, component: Component) -> bool:
        return (self.linear if component is Component.LINEAR else self.attention) is not None

    def applies_to(self, site: Site) -> bool:
        if not self.configures(site.kind.component) or not self.selector.matches(site):
            return False
        return site.kind not in EXPLICIT_ONLY_KINDS or self.selector.names_explicitly(site)


def unreachable_components(kinds: tuple[SiteKind, ...], configured: list[Component]) -> list[str]:
    """The configured components (``linear``, ``attention``) none of ``kinds`` belongs to, when some other
    configured one is reachable (a rule configuring none reachable is refused as a whole); () selects all."""
    reach = {k.component for k in kinds}
    if not kinds or not reach & set(configured):
        return []
    return [c.value for c in configured if c not in reach]


@dataclass(frozen=True)
class UnmatchedRule:
    """A rule that matched none of the given sites, with the nearest module paths as suggestions."""

    index: int
    rule: Rule
    nearest: tuple[str, ...]
    reason: str

    def __str__(self) -> str:
        where = f" ({self.rule.where})" if self.rule.where else ""
        shown = [p if p else "<the model itself>" for p in self.nearest]  # '' is the root module's path
        near = f"; nearest module paths: {', '.join(shown)}" if shown else ""
        return f"rule {self.index}{where} [{self.rule.selector.describe()}] matched no site: {self.reason}{near}"


def winner(rules: tuple[Rule, ...], site: Site) -> Rule | None:
    """The rule that decides ``site`` (module docstring), or None when no rule applies."""
    best: tuple | None = None
    best_rule = None
    for i, rule in enumerate(rules):
        if rule.applies_to(site):
            key = (rule.priority, rule.selector.specificity, i)
            if best is None or key > best:
                best, best_rule = key, rule
    return best_rule


def explain_unmatched(index: int, rule: Rule, sites: list[Site]) -> UnmatchedRule:
    """Why ``rule`` matched none of ``sites``, and the module paths nearest to what it asked for."""
    sel = rule.selector
    comps = [c for c in Component if rule.configures(c)]
    relevant = [s for s in sites if s.kind.component in comps]
    paths = sorted({s.rule_path for s in relevant})  # the paths rules match (global on a pipeline stage)
    if not relevant:
        return UnmatchedRule(index, rule, (), f"the model has no {' or '.join(c.value for c in comps)} sites")
    nearest: list[str] = []
    if sel.modules is not None:
        searched = [p for p in paths if re.search(sel.modules, p)]
        nearest = searched[:3] or difflib.get_close_matches(sel.modules, paths, n=3, cutoff=0.3)
        if not nearest:
            nearest = difflib.get_close_matches(sel.modules.replace("\\", ""), paths, n=3, cutoff=0.0)
        reason = f"no {'/'.join(c.value for c in comps)} module path fully matches {sel.modules!r}"
        if searched:
            reason += " (some contain it: the regex must match the whole path, e.g. '.*' + it + '.*')"
    elif sel.kinds and not any(s.kind in sel.kinds for s in relevant):
        present = sorted({s.kind.value for s in relevant})
        reason = f"no site of kind {', '.join(k.value for k in sel.kinds)}; the model has kinds {', '.join(present)}"
    else:
        layers = sorted({s.layer for s in relevant if s.layer is not None})
        span = f"{layers[0]}..{layers[-1]}" if layers else "none"
        reason = f"no site in the selected layers; the model's layers are {span}"
        nearest = list(dict.fromkeys(s.rule_path for s in relevant if sel.kinds == () or s.kind in sel.kinds))[:3]
    return UnmatchedRule(index, rule, tuple(nearest), reason)
