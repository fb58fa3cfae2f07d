"""The Python snippets of README.md and docs/*.md name the API as it is: each import works, each attribute of an
imported module or class (or of a looked-up format, scheme or capture spec) exists, and each call of such a function
binds its arguments (positional count and keyword names) to the function's signature."""
from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"```python\n(.*?)```", re.S)
ASSUMED = ("fxquant", "torch")  # modules a snippet may use without importing them
SNIPPETS = [(page, i, code) for page in PAGES for i, code in enumerate(FENCE.findall(page.read_text("utf-8")))]


def _namespace(tree: ast.Module) -> dict[str, object]:
    """The names the snippet's imports bind, imported for real (a failing import fails the test)."""
    ns: dict[str, object] = {name: importlib.import_module(name) for name in ASSUMED}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = importlib.import_module(alias.name)
                ns[alias.asname or alias.name.split(".")[0]] = module if alias.asname else importlib.import_module(
                    alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                try:
                    value = getattr(module, alias.name)
                except AttributeError:
                    value = importlib.import_module(f"{node.module}.{alias.name}")
                ns[alias.asname or alias.name] = value
    return ns


def _resolve(node: ast.expr, ns: dict[str, object]) -> tuple[bool, object]:
    """(known, value) of a dotted name rooted at an imported name; an attribute that is missing raises."""
    if isinstance(node, ast.Name):
        return (node.id in ns, ns.get(node.id))
    if isinstance(node, ast.Attribute):
        known, base = _resolve(node.value, ns)
        if not known:
            return False, None
        if not hasattr(base, node.attr) and inspect.ismodule(base):
            try:  # a submodule not imported by its package
                return True, importlib.import_module(f"{base.__name__}.{node.attr}")
            except ImportError:
                pass
        assert hasattr(base, node.attr), f"{ast.unparse(node.value)} has no attribute {node.attr!r}"
        return True, getattr(base, node.attr)
    return False, None


def _lookups() -> tuple:
    """Functions without side effects that a snippet's assignment may be evaluated with (literal arguments), so that
    the methods called on their results are checked too (``fmt = formats.get("mxfp8"); fmt.quantize(...)``)."""
    from fxquant import capture, formats, schemes

    return formats.get, schemes.get, capture.load_spec


def _evaluate_lookups(tree: ast.Module, ns: dict[str, object]) -> None:
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        call = node.value
        if not isinstance(call, ast.Call) or not all(isinstance(a, ast.Constant) for a in call.args):
            continue
        known, fn = _resolve(call.func, ns)
        if known and any(fn is f for f in _lookups()):
            ns[node.targets[0].id] = fn(*[a.value for a in call.args])


def _check(page: Path, index: int, code: str) -> int:
    """Check one snippet (AssertionError on a name or call that does not fit); the number of calls bound."""
    tree = ast.parse(code)
    ns = _namespace(tree)
    _evaluate_lookups(tree, ns)
    checked = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            _resolve(node, ns)
        if not isinstance(node, ast.Call):
            continue
        known, fn = _resolve(node.func, ns)
        if not known or not callable(fn):
            continue
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a signature
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue
        args = [object()] * len(node.args)
        kwargs = {k.arg: object() for k in node.keywords}
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise AssertionError(f"{page.name} snippet {index}: `{ast.unparse(node)}`: {exc}") from None
        checked += 1
    return checked


@pytest.mark.parametrize(("page", "index", "code"), SNIPPETS, ids=[f"{p.name}#{i}" for p, i, _ in SNIPPETS])
def test_snippet_names_the_api(page, index, code):
    _check(page, index, code)


def test_the_snippets_call_the_api():
    """The scan binds calls at all (a changed page layout would otherwise check nothing): the README's formats
    snippet alone binds formats.get."""
    assert len(SNIPPETS) >= 10
    readme_formats = next(c for p, i, c in SNIPPETS if p.name == "README.md" and "formats.get(" in c)
    assert _check(REPO / "README.md", 0, readme_formats) >= 1
    assert sum(_check(p, i, c) for p, i, c in SNIPPETS) >= 15
