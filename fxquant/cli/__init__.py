"""The `fxquant` command line.

Each verb lives in its own module of this package and exposes ``register(subparsers)``, which adds
its parser and sets ``func`` to a callable taking the parsed namespace and returning an exit code.
Printing is allowed here (and only here, in the library).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import warnings

# Modules of fxquant.cli that provide verbs; add a new verb by adding its module here.
_VERB_MODULES: tuple[str, ...] = ("formats_cmd", "schemes_cmd", "prepare_data_cmd", "check_spec_cmd", "capture_cmd",
                                  "explain_cmd", "report_cmd", "collect_cmd", "draw_cmd",
                                  "what_if_cmd")


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help line shows its default: ``(default: X)`` is appended unless the help already says
    what the default is, or there is none to show (a required option, a flag, an unset optional value)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=100, max_help_position=34)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.required or action.default in (None, False, [], argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


class RawDescriptionHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """HelpFormatter for a verb whose description is laid out by hand (``formatter_class=
    argparse.RawDescriptionHelpFormatter``: example commands one per line): the description is printed as
    written; the option help lines are wrapped and show their defaults as HelpFormatter's do."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxquant",
        description="Quantized-GEMM emulation, tensor capture and analysis for low-precision training research.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for name in _VERB_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    _show_defaults(parser)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """HelpFormatter for every verb's (and sub-verb's) parser, so each help line shows its default;
    RawDescriptionHelpFormatter for a parser that asked for argparse's, so its description keeps its lines."""
    raw = issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter)
    parser.formatter_class = RawDescriptionHelpFormatter if raw else HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)


def quiet_broken_pipe() -> int:
    """Exit status after the reader of stdout went away (`fxquant capture ls DIR --records | head`): stdout is
    pointed at /dev/null so the interpreter's final flush does not fail again; 141 = 128 + SIGPIPE, what a
    command killed by the signal reports."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141


def quiet_megatron_import_notices() -> None:
    """Hide megatron-core's import-time UserWarnings that Transformer Engine and Apex are absent (four per process,
    each with a source line; it then uses its own implementations, which is what a CPU run wants)."""
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    quiet_megatron_import_notices()
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return status
    except BrokenPipeError:  # an OSError: before the clause below
        return quiet_broken_pipe()
    except ModuleNotFoundError as exc:  # an ImportError: before the clause below
        extra = OPTIONAL_EXTRAS.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"fxquant {_command(args)}: error: this command needs {extra[0]}, which is not installed: "
              f"pip install {extra[1]}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError) as exc:  # OSError: a path that is a file, unwritable, disk full, ...
        print(f"fxquant {_command(args)}: error: {_message(exc)}", file=sys.stderr)
        return 2


# the optional packages a command may need: top-level module -> (package, what to install)
OPTIONAL_EXTRAS = {"megatron": ("megatron-core", "'fxquant[megatron]'"), "triton": ("Triton", "'fxquant[triton]'")}


def _command(args: argparse.Namespace) -> str:
    return " ".join(filter(None, (args.verb, getattr(args, "capture_verb", None))))  # `capture ls`


def _message(exc: Exception) -> str:
    """An OSError raised by the system as ``strerror: path`` (no ``[Errno N]``); any other error as it reads."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        paths = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        return f"{exc.strerror}: {paths}"
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
