"""YAML loading with source positions, and an error collector that reports every problem at once.

``load_with_lines`` returns the plain data (``yaml.safe_load``: no Python objects, no tags) and a map from
dotted path (``sections[0].points[1].roles``) to the 1-based line where that key or item starts.
``Problems`` gathers ``file:line: path: message`` entries; ``raise_if_any`` raises one ``SpecError`` (a
ValueError) listing them all.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class SpecError(ValueError):
    """A YAML document failed validation; ``problems`` holds every ``file:line: path: message``."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        n = len(self.problems)
        super().__init__(f"{n} problem{'s' if n != 1 else ''} in capture spec:\n  " + "\n  ".join(self.problems))

    def __reduce__(self):  # pickle and deepcopy (a worker process's error) rebuild it from its problems
        return type(self), (self.problems,)


def did_you_mean(value: object, choices) -> str:
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def join(path: str, key: object) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def parent(path: str) -> str:
    """``a.b[2]`` -> ``a.b``; ``a.b`` -> ``a``; ``a`` -> ``""``."""
    m = re.match(r"^(.*?)(\.[^.\[]+|\[\d+\])$", path)
    return m.group(1) if m else ""


def _walk(node: yaml.Node, path: str, lines: dict[str, int], dups: list[tuple[str, int]]) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set = set()
        for key_node, value_node in node.value:
            key = key_node.value
            sub = join(path, key)
            if key in seen:
                dups.append((sub, key_node.start_mark.line + 1))
            seen.add(key)
            lines[sub] = key_node.start_mark.line + 1
            _walk(value_node, sub, lines, dups)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            sub = join(path, i)
            lines[sub] = item.start_mark.line + 1
            _walk(item, sub, lines, dups)


@dataclass
class Problems:
    """Every problem found in one document, each with its file, line and dotted path."""

    filename: str
    lines: dict[str, int] = field(default_factory=dict)
    items: list[str] = field(default_factory=list)

    def add(self, path: str, message: str) -> None:
        probe = path
        line = self.lines.get(probe)
        while line is None and probe:  # fall back to the nearest enclosing path that has a line
            probe = parent(probe)
            line = self.lines.get(probe)
        where = f"{self.filename}:{line}" if line is not None else self.filename
        self.items.append(f"{where}: {path or '<top>'}: {message}")

    def raise_if_any(self) -> None:
        """SpecError with every problem, sorted by line (problems without a line first)."""
        if self.items:
            raise SpecError(sorted(self.items, key=_line_of))


def _line_of(problem: str) -> int:
    m = re.match(r"^.*?:(\d+): ", problem)
    return int(m.group(1)) if m else 0


def load_with_lines(text: str, filename: str = "<string>") -> tuple[object, Problems]:
    """Parse ``text``; a syntax error or a duplicate key becomes a SpecError naming file:line."""
    probs = Problems(filename)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{filename}:{mark.line + 1}" if mark is not None else filename
        raise SpecError([f"{where}: invalid YAML: {getattr(exc, 'problem', None) or exc}"]) from None
    if node is not None:
        dups: list[tuple[str, int]] = []
        _walk(node, "", probs.lines, dups)
        for path, line in dups:
            probs.items.append(f"{filename}:{line}: {path}: duplicate key (YAML keeps only the last one)")
    return data, probs


def read_text(path: str | Path) -> str:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"spec file not found: {p}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = exc.object[:exc.start].count(b"\n") + 1
        raise SpecError([f"{p}:{line}: not UTF-8 text: byte {exc.object[exc.start]:#04x} at offset {exc.start} "
                         f"({exc.reason}); save the spec as UTF-8"]) from None
