"""Scheme YAML: parse (with ``file:line`` and dotted paths for every problem, all reported at once) and dump.

    name: FA_linear_mxfp8                # optional, default: the file's stem
    description: ...                     # optional
    rules:                               # ordered; resolution in fxquant.schemes.rules
      - match: {modules: REGEX, kinds: [fc1, fc2], layers: [0, "4..7", -1], first_layers: N, last_layers: N}
        priority: 0                      # optional int, higher wins before specificity
        linear: VALUE                    # gemms fprop (x, w), dgrad (dy, w), wgrad (dy, x)
        attention: VALUE                 # gemms qk (q, k), dq (ds, k), dk (ds, q), pv (p, v), dp (do, v), dv (p, do)

A VALUE, at the component, GEMM or operand level, is ``none`` (high precision), a format spec string
(``mxfp8`` or ``mxfp8:rounding=ta,scale_mode=floor``) or a mapping with ``format`` / option keys
(rounding, scale_mode, saturate, scaling, scale_target, block_2d) and, above the operand level, child keys. Format
and options cascade down: a child inherits what its parent set and overrides what it sets itself. Child
keys not written inherit the parent's format (none when the parent set no format). An option that reaches no
operand with a format is an error; ``null`` unsets an inherited option. An empty ``kinds`` / ``layers`` list or
``modules`` regex is an error (it would select nothing); a key left out does not restrict the rule.
"""
from __future__ import annotations

from pathlib import Path

import yaml
from yaml.constructor import SafeConstructor

from fxquant.formats import canonical_name
from fxquant.formats.options import did_you_mean
from fxquant.formats.tensor_quant import _OPTION_KEYS, TensorQuant
from fxquant.schemes.model import (
    ATTENTION_GEMMS,
    LINEAR_GEMMS,
    AttentionQuant,
    Component,
    LinearQuant,
    SiteKind,
    attention_from_operands,
    attention_operands,
    linear_from_operands,
    linear_operands,
)
from fxquant.schemes.rules import LayerSpan, Rule, Selector, unreachable_components
from fxquant.schemes.scheme import Scheme

TOP_KEYS = ("name", "description", "rules")
RULE_KEYS = ("match", "priority", "linear", "attention")
MATCH_KEYS = ("modules", "kinds", "layers", "first_layers", "last_layers")
NONE_WORDS = ("none", "high", "off")
_LINEAR_TREE = {g: ops for g, ops in LINEAR_GEMMS.items()}
_ATTN_TREE = {g: ops for g, (_, _, ops) in ATTENTION_GEMMS.items()}
_EMPTY_HINT = "leave the key out to select every site"


def _is_none(v: object) -> bool:
    """``none``, ``null``/``~``, ``off``/``false``/``no`` (YAML 1.1 booleans) all mean high precision."""
    return v is None or v is False or (isinstance(v, str) and v.strip().lower() in NONE_WORDS)


class SchemeError(ValueError):
    """Every problem of one scheme file, one ``file:line: path: message`` per line."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = list(problems)
        n = len(problems)
        super().__init__(f"{n} problem{'s' * (n != 1)} in scheme {source}:\n  " + "\n  ".join(problems))

    def __reduce__(self):  # pickle and deepcopy (a worker process's error) rebuild it from its fields
        return type(self), (self.source, self.problems)


_MAP_TAG, _SEQ_TAG = "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source
        self.problems: list[str] = []
        self._constructor = SafeConstructor()
        self._merged: dict[int, int] = {}  # id(mapping node) -> how many of its pairs came from merge keys ('<<')

    def readable(self, node: yaml.Node, path: str, seen: set[int] | None = None) -> None:
        """Report every value plain YAML data cannot hold (a custom tag, a bad ``!!binary``, a merge key whose
        value is no mapping) and flatten merge keys (``<<: *anchor``: the anchor's keys, which keys written
        beside it override), before the scheme is read."""
        seen = set() if seen is None else seen
        if id(node) in seen:  # an alias: checked where its anchor is
            return
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            try:
                self._constructor.construct_object(node, deep=True)
            except yaml.YAMLError as exc:
                self.error(node, path, f"unreadable value: {getattr(exc, 'problem', None) or exc}")
            return
        default = _MAP_TAG if isinstance(node, yaml.MappingNode) else _SEQ_TAG
        if node.tag != default:
            self.error(node, path, f"tag {node.tag!r} is not part of a scheme (plain mappings, lists and values)")
            return
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.readable(item, f"{path}[{i}]", seen)
            return
        explicit = sum(k.tag != "tag:yaml.org,2002:merge" for k, _ in node.value)
        try:
            self._constructor.flatten_mapping(node)
        except yaml.YAMLError as exc:
            self.error(node, f"{path}.<<", f"{getattr(exc, 'problem', None) or exc} (a merge key takes a mapping "
                                           f"or a list of mappings, e.g. '<<: *anchor')")
            return
        self._merged[id(node)] = len(node.value) - explicit
        for k, v in node.value:
            self.readable(k, path, seen)
            key = k.value if isinstance(k, yaml.ScalarNode) else "?"
            self.readable(v, f"{path}.{key}" if path != "(top)" else str(key), seen)

    def error(self, node: yaml.Node, path: str, msg: str) -> None:
        self.problems.append(f"{self.source}:{node.start_mark.line + 1}: {path}: {msg}")

    def where(self, node: yaml.Node) -> str:
        return f"{self.source}:{node.start_mark.line + 1}"

    def value(self, node: yaml.Node) -> object:
        return self._constructor.construct_object(node, deep=True)

    def mapping(self, node: yaml.Node, path: str, allowed: tuple[str, ...]) -> dict[str, tuple[yaml.Node, yaml.Node]] | None:
        """``key -> (key node, value node)``; unknown and duplicate keys are reported."""
        if not isinstance(node, yaml.MappingNode):
            self.error(node, path, f"expected a mapping with keys {list(allowed)}, got {self._kind(node)}")
            return None
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        written: set[str] = set()
        merged = self._merged.get(id(node), 0)  # the first pairs, from merge keys: later ones override them
        for i, (k, v) in enumerate(node.value):
            key = self.value(k)
            if not isinstance(key, str) or key not in allowed:
                self.error(k, path, f"unknown key {key!r}{did_you_mean(str(key), allowed)}; allowed: {', '.join(allowed)}")
            elif i >= merged and key in written:
                self.error(k, f"{path}.{key}", f"duplicate key {key!r} (first at line {out[key][0].start_mark.line + 1})")
            else:
                out[key] = (k, v)
                if i >= merged:
                    written.add(key)
        return out

    @staticmethod
    def _kind(node: yaml.Node) -> str:
        if isinstance(node, yaml.MappingNode):
            return "a mapping"
        if isinstance(node, yaml.SequenceNode):
            return "a list"
        return f"{node.value!r}"

    # -- document --------------------------------------------------------------------------------------
    def scheme(self, root: yaml.Node | None, default_name: str) -> Scheme | None:
        if root is None:
            self.problems.append(f"{self.source}:1: (top): the file is empty; a scheme needs at least 'rules: []'")
            return None
        top = self.mapping(root, "(top)", TOP_KEYS)
        if top is None:
            return None
        name, description = default_name, ""
        for key in ("name", "description"):
            if key in top:
                v = self.value(top[key][1])
                if not isinstance(v, str) or (key == "name" and not v.strip()):
                    self.error(top[key][1], key, f"must be a non-empty string, got {v!r}")
                elif key == "name":
                    name = v.strip()
                else:
                    description = v.strip()
        rules: list[Rule] = []
        if "rules" not in top:
            self.error(root, "rules", "missing; write 'rules: []' for a scheme that quantizes nothing")
        else:
            node = top["rules"][1]
            if isinstance(node, yaml.ScalarNode) and self.value(node) is None:
                pass
            elif not isinstance(node, yaml.SequenceNode):
                self.error(node, "rules", f"expected a list of rules, got {self._kind(node)}")
            else:
                for i, item in enumerate(node.value):
                    rule = self.rule(item, f"rules[{i}]")
                    if rule is not None:
                        rules.append(rule)
        if self.problems:
            return None
        return Scheme(name, description, tuple(rules), source=self.source)

    def rule(self, node: yaml.Node, path: str) -> Rule | None:
        m = self.mapping(node, path, RULE_KEYS)
        if m is None:
            return None
        n_before = len(self.problems)
        selector = self.selector(m["match"][1], f"{path}.match") if "match" in m else Selector()
        priority = 0
        if "priority" in m:
            priority = self.value(m["priority"][1])
            if not isinstance(priority, int) or isinstance(priority, bool):
                self.error(m["priority"][1], f"{path}.priority", f"must be an int, got {priority!r}")
                priority = 0
        linear = attention = None
        if "linear" in m:
            table = self.component(m["linear"][1], f"{path}.linear", _LINEAR_TREE)
            linear = None if table is None else linear_from_operands(table)
        if "attention" in m:
            table = self.component(m["attention"][1], f"{path}.attention", _ATTN_TREE)
            attention = None if table is None else attention_from_operands(table)
        if "linear" not in m and "attention" not in m:
            self.error(node, path, "a rule must configure 'linear', 'attention' or both")
        if selector is not None and selector.kinds:
            comps = {k.component.value for k in selector.kinds}
            given = {c for c in ("linear", "attention") if c in m}
            if given and not comps & given:
                self.error(
                    node, path,
                    f"kinds {[k.value for k in selector.kinds]} are {'/'.join(sorted(comps))} sites but the rule "
                    f"configures only {'/'.join(sorted(given))}: it could never apply",
                )
            for part in unreachable_components(selector.kinds, [c for c in Component if c.value in m]):
                self.error(m[part][0], f"{path}.{part}", f"kinds {[k.value for k in selector.kinds]} select no "
                                                         f"{part} site: this part could never apply")
        if len(self.problems) > n_before or selector is None:
            return None
        return Rule(selector, linear, attention, priority, where=self.where(node))

    # -- selectors --------------------------------------------------------------------------------------
    def selector(self, node: yaml.Node, path: str) -> Selector | None:
        m = self.mapping(node, path, MATCH_KEYS)
        if m is None:
            return None
        ok = True
        kw: dict = {}
        if "modules" in m:
            v = self.value(m["modules"][1])
            try:
                if not isinstance(v, str):
                    raise ValueError(f"must be a regular expression string, got {v!r}")
                if not v.strip():
                    raise ValueError(f"an empty regex selects nothing; {_EMPTY_HINT}")
                kw["modules"] = Selector(modules=v).modules
            except ValueError as exc:
                self.error(m["modules"][1], f"{path}.modules", str(exc))
                ok = False
        if "kinds" in m:
            kn = m["kinds"][1]
            items = kn.value if isinstance(kn, yaml.SequenceNode) else [kn]
            if not items:
                self.error(kn, f"{path}.kinds", f"an empty list selects nothing; {_EMPTY_HINT}")
                ok = False
            kinds = []
            allowed = [k.value for k in SiteKind]
            for j, it in enumerate(items):
                v = self.value(it)
                if isinstance(v, str) and v.lower() in allowed:
                    kinds.append(SiteKind(v.lower()))
                else:
                    self.error(it, f"{path}.kinds[{j}]", f"unknown kind {v!r}{did_you_mean(str(v), allowed)}; allowed: {', '.join(allowed)}")
                    ok = False
            kw["kinds"] = tuple(dict.fromkeys(kinds))
        if "layers" in m:
            ln = m["layers"][1]
            items = ln.value if isinstance(ln, yaml.SequenceNode) else [ln]
            if not items:
                self.error(ln, f"{path}.layers", f"an empty list selects nothing; {_EMPTY_HINT}")
                ok = False
            spans = []
            for j, it in enumerate(items):
                try:  # not an index or a range, or a range LayerSpan refuses (empty, mixed signs)
                    spans.append(LayerSpan.parse(self.value(it)))
                except ValueError as exc:
                    self.error(it, f"{path}.layers[{j}]", str(exc))
                    ok = False
            kw["layers"] = tuple(spans)
        for key in ("first_layers", "last_layers"):
            if key in m:
                v = self.value(m[key][1])
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    self.error(m[key][1], f"{path}.{key}", f"must be a positive int, got {v!r}")
                    ok = False
                else:
                    kw[key] = v
        return Selector(**kw) if ok else None

    # -- components: cascade of format + options down to operands ------------------------------------------
    # A scope is a dict: "format", the option keys, and "_from" (option key -> dotted path where it was written).
    def component(self, node: yaml.Node, path: str, tree: dict[str, tuple[str, str]]) -> dict | None:
        n_before = len(self.problems)
        self._written: list[tuple[str, str, yaml.Node]] = []  # (option, path, key node) written in a mapping
        used: set[tuple[str, str]] = set()  # (option, path written) that reached an operand with a format
        table: dict[str, dict[str, TensorQuant | None]] = {}
        scope = self.scope(node, path, {}, tuple(tree))
        for gemm, ops in tree.items():
            gnode, gscope = self.child(node, gemm, path, scope, ops)
            table[gemm] = {}
            for op in ops:
                onode, oscope = self.child(gnode, op, f"{path}.{gemm}", gscope, ())
                table[gemm][op] = self.leaf(oscope)
                if oscope is not None and oscope.get("format") is not None:
                    used.update((k, where) for k, where in oscope.get("_from", {}).items() if oscope.get(k) is not None)
        if len(self.problems) == n_before:
            for key, where, knode in self._written:
                if (key, where) not in used:
                    self.error(
                        knode, f"{where}.{key}",
                        f"{key} given but no format in force at {where}: no operand under it gets a format with "
                        f"this {key} (none is set, or each sets its own {key}); add 'format: ...' here or below, "
                        f"or drop {key}",
                    )
        return table if len(self.problems) == n_before else None

    def child(self, node, key, path, scope, grandchildren):
        """(node of ``key`` under ``node`` or None, the scope it resolves with)."""
        if scope is None or node is None or not isinstance(node, yaml.MappingNode):
            return None, scope
        for k, v in node.value:
            if self.value(k) == key:
                return v, self.scope(v, f"{path}.{key}", scope, grandchildren)
        return None, scope

    def scope(self, node: yaml.Node, path: str, parent: dict | None, children: tuple[str, ...]) -> dict | None:
        """The format and options in force at ``node`` (None: an error was reported here)."""
        if parent is None:
            return None
        if isinstance(node, yaml.ScalarNode):
            v = self.value(node)
            if _is_none(v):
                return {**parent, "format": None}
            if not isinstance(v, str):
                self.error(node, path, f"expected a format (e.g. 'mxfp8'), 'none' or a mapping, got {v!r}")
                return None
            try:
                tq = TensorQuant.from_spec(v)
            except ValueError as exc:
                self.error(node, path, str(exc))
                return None
            written = tq._kwargs()
            new = {**parent, "format": tq.format, **written, "_from": {**parent.get("_from", {}), **dict.fromkeys(written, path)}}
            return self.checked(node, path, new)
        allowed = tuple(children) + ("format",) + _OPTION_KEYS
        m = self.mapping(node, path, allowed)
        if m is None:
            return None
        new = dict(parent)  # unknown or duplicate keys were reported; the known ones are still checked
        if "format" in m:
            v = self.value(m["format"][1])
            if _is_none(v):
                new["format"] = None
            else:
                try:
                    new["format"] = canonical_name(str(v))
                except ValueError as exc:
                    self.error(m["format"][1], f"{path}.format", str(exc))
                    return None
        new["_from"] = dict(parent.get("_from", {}))
        for key in _OPTION_KEYS:
            if key in m:
                new[key] = self.value(m[key][1])  # None (YAML null) unsets what the parent set
                new["_from"][key] = path
                if new[key] is not None:
                    self._written.append((key, path, m[key][0]))
        if any(k in m for k in ("format",) + _OPTION_KEYS):
            return self.checked(node, path, new)
        return new

    def checked(self, node: yaml.Node, path: str, scope: dict) -> dict | None:
        """``scope`` if its format takes its options, else None (reported). Options that apply to no format are
        reported once the whole component is read (``component``): a child may still give the format."""
        if scope.get("format") is None:
            return scope
        try:
            self.leaf(scope)
        except (ValueError, TypeError) as exc:
            self.error(node, path, str(exc) + self.inherited_culprits(scope, path, str(exc)))
            return None
        return scope

    def inherited_culprits(self, scope: dict, path: str, problem: str) -> str:
        """Which inherited options (written at an enclosing level) cause ``problem``, and how to drop them."""
        notes = []
        for key, where in scope.get("_from", {}).items():
            if where == path or scope.get(key) is None:
                continue
            try:
                self.leaf({**scope, key: None})
                fixed = True
            except (ValueError, TypeError) as exc:
                fixed = str(exc) != problem
            if fixed:
                notes.append(
                    f"{key}={scope[key]!r} is inherited from {where}; reset it here with '{key}: null', e.g. "
                    f"{{format: {scope['format']}, {key}: null}}"
                )
        return f" ({'; '.join(notes)})" if notes else ""

    @staticmethod
    def leaf(scope: dict | None) -> TensorQuant | None:
        if scope is None or scope.get("format") is None:
            return None
        return TensorQuant(scope["format"], **{k: scope[k] for k in _OPTION_KEYS if scope.get(k) is not None})


def load_text(text: str, source: str = "<string>", default_name: str | None = None) -> Scheme:
    """Parse scheme YAML text; raise ``SchemeError`` (a ValueError) listing every problem."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = f"{mark.line + 1}" if mark is not None else "?"
        raise SchemeError(source, [f"{source}:{line}: invalid YAML: {getattr(exc, 'problem', None) or exc}"]) from None
    parser = _Parser(source)
    if root is not None:
        parser.readable(root, "(top)")
        if parser.problems:
            raise SchemeError(source, parser.problems)
    scheme = parser.scheme(root, default_name or Path(source).stem or "scheme")
    if parser.problems:
        raise SchemeError(source, parser.problems)
    return scheme


def load_file(path: str | Path) -> Scheme:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"scheme file {str(path)!r} does not exist")
    return load_text(p.read_text(encoding="utf-8"), str(p), default_name=p.stem)


# -- dump ----------------------------------------------------------------------------------------------------
def _tq_value(tq: TensorQuant | None) -> str:
    if tq is None:
        return "none"
    return tq.format if tq == TensorQuant(tq.format) else tq.spec()


def _component_value(table: dict[str, dict[str, TensorQuant | None]]) -> object:
    every = [tq for ops in table.values() for tq in ops.values()]
    if all(tq == every[0] for tq in every):
        return _tq_value(every[0])
    out: dict[str, object] = {}
    for gemm, ops in table.items():
        vals = list(ops.values())
        if all(v is None for v in vals):
            continue
        out[gemm] = _tq_value(vals[0]) if vals[0] == vals[1] else {k: _tq_value(v) for k, v in ops.items()}
    return out


def _selector_value(sel: Selector) -> dict:
    out: dict[str, object] = {}
    if sel.modules is not None:
        out["modules"] = sel.modules
    if sel.kinds:
        out["kinds"] = [k.value for k in sel.kinds]
    if sel.layers:
        out["layers"] = [s.start if s.start == s.stop else f"{s.start}..{s.stop}" for s in sel.layers]
    if sel.first_layers is not None:
        out["first_layers"] = sel.first_layers
    if sel.last_layers is not None:
        out["last_layers"] = sel.last_layers
    return out


def dump(scheme: Scheme) -> str:
    rules = []
    for r in scheme.rules:
        d: dict[str, object] = {}
        sel = _selector_value(r.selector)
        if sel:
            d["match"] = sel
        if r.priority:
            d["priority"] = r.priority
        if r.linear is not None:
            d["linear"] = _component_value(linear_operands(r.linear))
        if r.attention is not None:
            d["attention"] = _component_value(attention_operands(r.attention))
        rules.append(d)
    doc = {"name": scheme.name, "description": scheme.description, "rules": rules}
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=120)


__all__ = ["SchemeError", "dump", "load_file", "load_text", "AttentionQuant", "LinearQuant"]
