"""Every command line README.md, docs/*.md and benchmarks/RESULTS.md show for `fxquant VERB`, `python -m experiments
SUB` and `bash scripts/run_main.sh` names a verb that exists and options its parser has; a command without
placeholders (DIR, FILE, ...) parses as written."""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from fxquant.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "RESULTS.md"]
STARTS = ("fxquant ", "python -m experiments ", "bash scripts/run_main.sh")
FENCE = re.compile(r"```[\w-]*\n(.*?)```", re.S)
SPAN = re.compile(r"`([^`\n]+)`")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*([|.=][A-Za-z0-9_.]*)*$")  # DIR, OUT, NAME|FILE.yaml, HF_DIR


def _synopsis(text: str) -> str:
    """A synopsis as a command: each ``[optional part]`` kept (its first alternative), ``...`` dropped."""
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split("|")[0], text).replace("...", " ")


def _commands(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    lines = []
    for block in FENCE.findall(text):
        lines += [re.sub(r"\s#.*", "", ln) for ln in block.replace("\\\n", " ").splitlines()]
    lines += SPAN.findall(FENCE.sub("", text))
    found = []
    for line in lines:
        for part in _synopsis(line).split("&&"):
            part = part.strip()
            if part.startswith(STARTS):
                found.append(part)
    return found


def _experiments_parser() -> argparse.ArgumentParser:
    pytest.importorskip("megatron.core", reason="experiments imports megatron-core's glue")
    from experiments.__main__ import build_parser as experiments_parser

    return experiments_parser()


def _resolve(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """(parser, its arguments) of a command; ``run_main.sh`` passes its own ``experiments run`` arguments first."""
    if argv[0] == "fxquant":
        return build_parser(), argv[1:]
    if argv[0] == "bash":
        script = (REPO / "scripts" / "run_main.sh").read_text(encoding="utf-8")
        fixed = re.search(r'-m experiments (run .*?)"\$@"', script.replace("\\\n", " "), re.S).group(1)
        fixed = re.sub(r'"\$\{[A-Z_]+:-([^}]*)\}"', r"\1", fixed).replace('"$out"', "runs/main")
        return _experiments_parser(), shlex.split(fixed) + argv[2:]
    return _experiments_parser(), argv[3:]


def _subparser(parser: argparse.ArgumentParser, args: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The (sub-)parser the leading verbs select, and the rest; a verb that does not exist fails the test."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or not args or args[0].startswith("-"):
            return parser, args
        choices = subs[0].choices
        verb = args[0].split("|")[0]
        assert verb in choices, f"{verb!r} is not one of {sorted(choices)}"
        parser, args = choices[verb], args[1:]


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _values(args: list[str], option: str) -> list[str]:
    """The values after ``option`` up to the next option (``--schemes a b``, ``--scheme a``)."""
    out, on = [], False
    for token in args:
        if token.startswith("-"):
            on = token == option
        elif on:
            out.append(token)
    return out


def _check_names(page: Path, cmd: str, args: list[str]) -> None:
    """Scheme names are presets; experiments' model names are in its catalog."""
    from fxquant import schemes

    presets = set(schemes.names())
    for name in _values(args, "--scheme") + _values(args, "--schemes"):
        if not PLACEHOLDER.match(name) and not name.endswith((".yaml", ".yml")):
            assert name in presets, f"{page.name}: `{cmd}`: no preset scheme {name!r}"
    models = _values(args, "--model") + _values(args, "--models")
    if cmd.startswith(("python -m experiments", "bash scripts/run_main.sh")) and models:
        from experiments import catalog

        for name in models:
            assert name in catalog.MODELS, f"{page.name}: `{cmd}`: no model {name!r} in experiments.catalog"


CASES = [(page, cmd) for page in PAGES for cmd in dict.fromkeys(_commands(page))]  # each once per page


def test_the_pages_show_commands():
    """The scan finds the commands it checks (a changed page layout would otherwise check nothing)."""
    names = {page.name for page, _ in CASES}
    assert {"README.md", "analysis.md", "megatron.md"} <= names
    assert sum(cmd.startswith("fxquant ") for _, cmd in CASES) >= 20


@pytest.mark.parametrize(("page", "cmd"), CASES, ids=[f"{p.name}:{c[:60]}" for p, c in CASES])
def test_documented_command_parses(page, cmd):
    argv = shlex.split(cmd)
    parser, args = _resolve(argv)
    leaf, rest = _subparser(parser, args)
    options = _options(leaf)
    for token in rest:
        name = token.split("=")[0]
        if name.startswith("--") or re.fullmatch(r"-[a-zA-Z]", name):
            assert name in options, f"{page.name}: `{cmd}`: no option {name} (has {sorted(options)})"
    _check_names(page, cmd, rest)
    if not rest:
        return  # a verb named in prose (`fxquant report`): it exists; its required arguments are not shown
    if any(PLACEHOLDER.match(t) or "|" in t for t in args):
        return  # a synopsis: its options exist (above); placeholders and alternatives are not values to parse
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(args)
        except SystemExit as exc:
            assert exc.code == 0, f"{page.name}: `{cmd}` does not parse: {err.getvalue().strip()}"
