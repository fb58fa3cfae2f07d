"""Every option of `python -m experiments run|matrix` and of the fxquant verbs owned here has a help line
that shows its default, and `fxquant schemes` lists the presets."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fxquant.cli import HelpFormatter, build_parser, main

REPO = Path(__file__).resolve().parents[1]
VERBS = ("formats", "schemes", "capture", "report", "quant-error", "mx-sweep", "explain", "check-spec")


def _parsers(parser: argparse.ArgumentParser, path: str):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """Options without help, or whose help shows no default although they have one to show."""
    formatter = HelpFormatter(parser.prog)
    bad = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        text = formatter._get_help_string(action) if action.help else ""
        if not text:
            bad.append(f"{name}: no help")
        elif action.option_strings and not action.required and action.nargs != 0 and "default" not in text:
            bad.append(f"{name}: no default in {text!r}")
    return bad


def test_fxquant_verbs_document_every_option():
    top = build_parser()
    verbs = {a.dest: a for a in top._actions if isinstance(a, argparse._SubParsersAction)}["verb"].choices
    problems = []
    for verb in VERBS:
        for path, parser in _parsers(verbs[verb], verb):
            assert parser.formatter_class is HelpFormatter, path
            problems += [f"fxquant {path}: {p}" for p in _undocumented(parser)]
    assert problems == []


@pytest.mark.parametrize("verb", ["collect", "prepare-data", "draw"])
def test_hand_laid_out_descriptions_keep_one_example_command_per_line(verb, capsys):
    """Verbs whose description lists example commands (argparse.RawDescriptionHelpFormatter) print each one on
    its own line, as written, and their option help lines still show defaults."""
    import importlib

    examples = [line.strip() for line in importlib.import_module(f"fxquant.cli.{verb.replace('-', '_')}_cmd")
                .__doc__.splitlines() if line.startswith(f"    fxquant {verb}")]
    assert len(examples) >= 3
    with pytest.raises(SystemExit) as done:
        main([verb, "--help"])
    assert done.value.code == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert [e for e in examples if e not in lines] == []
    top = build_parser()
    parser = {a.dest: a for a in top._actions if isinstance(a, argparse._SubParsersAction)}["verb"].choices[verb]
    parser.add_argument("--probe", type=int, default=7, help="a probe option")
    assert "a probe option (default: 7)" in parser.format_help()


def test_experiments_run_and_matrix_document_every_option():
    pytest.importorskip("megatron.core", reason="experiments imports megatron-core's glue")
    from experiments.__main__ import build_parser as experiments_parser

    parser = experiments_parser()
    problems = []
    for path, sub in _parsers(parser, "experiments"):
        if path.split()[-1] in ("run", "matrix"):
            problems += [f"{path}: {p}" for p in _undocumented(sub)]
    assert problems == []
    run_help = parser._subparsers._group_actions[0].choices["run"].format_help()
    assert "(default: aot_eager)" in run_help and "default tp*pp" in run_help


def test_schemes_lists_patterns_and_presets(capsys):
    assert main(["schemes"]) == 0
    out = capsys.readouterr().out
    assert "FA_linear_X" in out and "FA_PV_X" in out and "legacy_<predecessor name>" in out
    assert "FA_linear_hifp8" in out and "mxfp8" in out  # the predecessor's names and the formats X stands for
    assert main(["schemes", "--all"]) == 0
    assert "FA_QKPV_nvfp4" in capsys.readouterr().out
    assert main(["schemes", "FA_hifp8"]) == 0
    assert "scheme FA_hifp8" in capsys.readouterr().out
    assert main(["schemes", "FA_hifp"]) == 2
    assert "did you mean" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["-m fxquant schemes --all", "-m fxquant formats"])
def test_output_cut_short_by_head_is_not_a_traceback(command):
    """`fxquant ... | head -1`: the closed pipe ends the command quietly (status 141, as SIGPIPE would)."""
    proc = subprocess.run(f"{sys.executable} {command} | head -1; echo \"status ${{PIPESTATUS[0]}}\"",
                          shell=True, executable="/bin/bash", cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.stdout.splitlines()[-1] in ("status 141", "status 0")  # 0: all output fit the pipe's buffer


@pytest.mark.parametrize("argv", [["--help"], ["formats"]])
def test_help_and_formats_do_not_import_inductor(argv):
    """`fxquant --help` and `fxquant formats` stay quick: no verb module imports fxquant.lowering (and with it
    torch._inductor, seconds) when the parser is built."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "fxquant", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert {"fxquant.cli", "fxquant.cli.options"} <= imported  # the listing is real (verb modules are not in it:
    # importlib.import_module bypasses -X importtime, but their own imports are listed)
    assert "torch._inductor" not in imported and "fxquant.lowering" not in imported


def test_explain_kernels_choices_are_the_lowering_kernels():
    from fxquant.cli.explain_cmd import KERNELS
    from fxquant.lowering import Kernels

    assert KERNELS == tuple(k.value for k in Kernels)


def test_an_unwritable_output_path_is_a_one_line_error(tmp_path, capsys):
    """An OSError (here: the output directory is an existing file) ends the verb with `fxquant VERB: error:`
    naming the path, status 2, not a traceback."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 1, "loss": 2.0}\n')
    afile = tmp_path / "afile.txt"
    afile.write_text("not a directory")
    assert main(["report", "--metrics", str(run), "-o", str(afile), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxquant report: error: ") and str(afile) in err and err.count("\n") == 1
    assert main(["report", "--metrics", str(run), "-o", str(afile / "sub"), "-q"]) == 2
    assert "fxquant report: error: Not a directory" in capsys.readouterr().err


def test_prepare_data_prints_no_megatron_import_notices(tmp_path):
    """megatron-core's four 'Transformer Engine and Apex are not installed' UserWarnings stay off the console."""
    pytest.importorskip("megatron.core", reason="prepare-data imports megatron-core's dataset builder")
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "hello world"}\n{"text": "more text"}\n')
    proc = subprocess.run([sys.executable, "-m", "fxquant", "prepare-data", str(src), "--dataset", "wikipedia",
                           "-o", str(tmp_path / "ds")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "ds.bin").is_file() and "2 documents" in proc.stdout
    assert "Transformer Engine" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr


def test_draw_offers_no_quant_types(capsys):
    """`fxquant draw` collects one quant type (collect|both, as `collect single`): its help does not offer
    `collect batch`'s --quant-types, and the flag is an unknown argument there; `collect` keeps it."""
    verbs = {a.dest: a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)}["verb"].choices
    assert "--quant-types" not in verbs["draw"].format_help()
    assert "--quant-types" in verbs["collect"].format_help()
    with pytest.raises(SystemExit) as done:
        main(["draw", "collect", "--quant-types", "bf16", "mxfp8", "--dry-run"])
    assert done.value.code == 2 and "unrecognized arguments: --quant-types" in capsys.readouterr().err


def test_where_help_says_repeated_values_add_up():
    """Every verb's --where help says what repeating it does (the values for one FIELD add up)."""
    verbs = {a.dest: a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)}["verb"].choices
    found = 0
    for verb in verbs:
        for path, parser in _parsers(verbs[verb], verb):
            for action in parser._actions:
                if "--where" in action.option_strings:
                    found += 1
                    assert "values given for the same FIELD add up" in action.help, path
    assert found == 7  # report, quant-error, mx-sweep, what-if, plot-tensors, capture ls, capture export-pt


def make_float_model():
    """A model of float inputs (no nn.Embedding), for `fxquant explain`."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_explain_says_it_feeds_token_ids_for_a_model_without_an_embedding(capsys):
    assert main(["explain", "--scheme", "linear_mxfp8", "--model", f"{__name__}:make_float_model"]) == 2
    err = capsys.readouterr().err
    assert "the model has no nn.Embedding: `fxquant explain` feeds a model token ids" in err
    assert "fxquant.explain(model, *inputs, scheme=...)" in err
    # given --vocab, the forward runs and fails on token ids: one error line, no generated code printed by torch.fx
    # (a lazily recompiled graph called through GraphModule.__call__ printed it to stderr)
    assert main(["explain", "--scheme", "linear_mxfp8", "--model", f"{__name__}:make_float_model", "--vocab", "16"]) == 2
    err = capsys.readouterr().err
    assert "its forward on token ids of shape [2, " in err and "check --vocab, --seq-len and --batch" in err
    assert "FX-traced Module" not in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_help_and_errors_name_the_right_command_and_defaults(tmp_path, capsys):
    """draw's --quant-type help gives draw's default (it collects as `single`), not collect's quick mode; a quant
    type error points at `fxquant schemes` for the scheme names (`fxquant explain` lists none); an error inside
    `capture ls` names `capture ls`."""
    for verb, want, not_want in (("draw", "$CUSTOM_QUANT_TYPE, else mxfp8)", "quick"),
                                 ("collect", "else mxfp8 for single, hifp8 for quick", None)):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert want in text and (not_want is None or not_want not in text.split("--quant-type")[1].split("--")[0])
    assert main(["collect", "single", "mxfp9", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "a scheme name (fxquant schemes / experiments list)" in err and "fxquant explain" not in err
    assert main(["capture", "ls", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("fxquant capture ls: error: ")


@pytest.mark.parametrize("missing,argv,needs", [
    ("megatron", ["prepare-data", "docs.jsonl", "--dataset", "dolma", "-q"], "megatron-core"),
    ("triton", ["formats"], None),
])
def test_a_command_whose_optional_package_is_missing_says_what_to_install(tmp_path, missing, argv, needs):
    """Without megatron-core (a base install), `fxquant prepare-data` is one error line naming the extra to install,
    exit 2, nothing written; a command that does not need the package runs as usual."""
    (tmp_path / "docs.jsonl").write_text('{"text": "a b c"}\n')
    code = ("import sys; sys.modules[%r] = None  # as if not installed: importing it raises ModuleNotFoundError\n"
            "from fxquant.cli import main; sys.exit(main(%r))") % (missing, argv)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if needs is None:
        assert done.returncode == 0, done.stderr[-2000:]
        return
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"fxquant prepare-data: error: this command needs {needs}, which is not installed: pip install "
        f"'fxquant[megatron]'"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]
