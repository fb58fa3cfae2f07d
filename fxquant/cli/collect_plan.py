"""What `fxquant collect` runs: quant types, scheme names and scheme YAML files -> the collections' schemes.

- A predecessor quant type (`bf16 | mxfp8 | mxfp4 | hifp8`) means its setting as its name says: linear and
  attention in that format (`bf16`, `FA_linear_<fmt>`); any scheme preset name is used as it is; a scheme
  YAML path is read now (errors before any run) and collected under the scheme's own name.
- `--legacy` reproduces what the predecessor's runs computed (`legacy_*` presets, docs/schemes.md): a quant
  type `X` becomes `legacy_FA_linear_X` (its FA_X, linear_X and FA_linear_X were one and the same scheme),
  a predecessor name `N` becomes `legacy_N`.
- `batch` collects the predecessor's four quant types, as its batch mode did (`--quant-types` chooses others).
- `CUSTOM_QUANT_TYPE` (the predecessor's environment variable) is the quant type of `single` / `quick` when
  none is given on the command line; wherever it does not choose the collection a note says so.
- The predecessor's `--dtype` is mapped to `experiments run --precision` (bf16, fp32) or refused.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

MODES = ("single", "batch", "quick")
BASE_TYPES = ("bf16", "mxfp8", "mxfp4", "hifp8")  # the predecessor's quant types
ENV_QUANT_TYPE = "CUSTOM_QUANT_TYPE"
DEFAULT_QUANT_TYPE = {"single": "mxfp8", "quick": "hifp8"}
# the predecessor's --dtype values -> fxquant's training precision (experiments run --precision)
DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}


@dataclass(frozen=True)
class Collection:
    """One collection: `scheme` names it (its capture directory DIR/<scheme>/ and run directory);
    `scheme_arg` is what `experiments run --scheme` receives (the name, or the absolute YAML path)."""

    scheme: str
    scheme_arg: str


def is_scheme_file(value: str) -> bool:
    return value.endswith((".yaml", ".yml")) or Path(value).is_file()


def collection_for(quant_type: str, legacy: bool = False) -> Collection:
    """The collection of one quant type, scheme name or scheme YAML path (module docstring)."""
    from fxquant import schemes
    from fxquant.formats.options import did_you_mean
    from fxquant.schemes.presets import PREDECESSOR_NAMES

    if is_scheme_file(quant_type):
        if legacy:
            raise ValueError(f"--legacy maps the predecessor's quant types and scheme names to the legacy_* presets; "
                             f"the scheme file {quant_type!r} is used as written: drop --legacy for it")
        scheme = schemes.get(Path(quant_type))  # FileNotFoundError / SchemeError (file:line) now, before any run
        return Collection(scheme.name, str(Path(quant_type).resolve()))
    if legacy:
        base = f"FA_linear_{quant_type}" if quant_type in BASE_TYPES[1:] else quant_type
        if base in PREDECESSOR_NAMES:
            return Collection(f"legacy_{base}", f"legacy_{base}")
        if quant_type.startswith("legacy_") and quant_type in schemes.names():
            return Collection(quant_type, quant_type)
        raise ValueError(f"--legacy: no legacy preset for {quant_type!r}"
                         f"{did_you_mean(quant_type, [*BASE_TYPES, *PREDECESSOR_NAMES])}; allowed: the quant types "
                         f"{', '.join(BASE_TYPES)} or the predecessor's names {', '.join(PREDECESSOR_NAMES)}")
    if quant_type in BASE_TYPES:
        name = "bf16" if quant_type == "bf16" else f"FA_linear_{quant_type}"
        return Collection(name, name)
    if quant_type in schemes.names():
        return Collection(quant_type, quant_type)
    raise ValueError(f"quant type {quant_type!r}{did_you_mean(quant_type, [*BASE_TYPES, *schemes.names()])}; "
                     f"allowed: {', '.join(BASE_TYPES)}, a scheme name (fxquant schemes / experiments list) "
                     f"or a scheme YAML path")


def mode_and_quant_type(args: argparse.Namespace, modes: tuple[str, ...] = MODES) -> tuple[str, str | None]:
    """MODE and QUANT_TYPE of a command line, each from its positional or its option (given both ways, they must
    agree); with ``--mode``, a lone positional that is no mode is the quant type (``--mode quick hifp8``)."""
    from fxquant.formats.options import did_you_mean

    mode_arg, qt_arg = args.mode_arg, args.quant_type_arg
    if mode_arg is not None and mode_arg not in modes:
        if args.mode is None or qt_arg is not None:
            raise ValueError(f"MODE {mode_arg!r}{did_you_mean(mode_arg, modes)}: choose from {', '.join(modes)} (a "
                             f"quant type goes after MODE, e.g. `{modes[0]} {mode_arg}`, or with --quant-type)")
        mode_arg, qt_arg = None, mode_arg
    if args.mode and mode_arg and args.mode != mode_arg:
        raise ValueError(f"mode given twice: {mode_arg!r} and --mode {args.mode!r}")
    if args.quant_type and qt_arg and args.quant_type != qt_arg:
        raise ValueError(f"quant type given twice: {qt_arg!r} and --quant-type {args.quant_type!r}")
    return args.mode or mode_arg or modes[0], args.quant_type or qt_arg


def plan(args: argparse.Namespace, env: dict) -> tuple[str, list[Collection], list[str]]:
    """(mode, collections, notes) of a command line; notes say where CUSTOM_QUANT_TYPE was not used."""
    mode, qt = mode_and_quant_type(args)
    env_qt = env.get(ENV_QUANT_TYPE) or None
    notes = []
    if mode == "batch":
        if qt is not None:
            raise ValueError(f"batch collects every quant type; use --quant-types to choose, not {qt!r}")
        chosen = args.quant_types or BASE_TYPES
        if env_qt is not None:
            notes.append(f"{ENV_QUANT_TYPE}={env_qt} not used: batch collects {' '.join(chosen)}"
                         + ("" if args.quant_types else " (choose with --quant-types)"))
        collections = [collection_for(q, args.legacy) for q in chosen]
        named = {}
        for q, c in zip(chosen, collections):
            named.setdefault(c.scheme, []).append(q)
        twice = {scheme: qs for scheme, qs in named.items() if len(qs) > 1}
        if twice:  # one run and capture directory each: the second would replace the first's captures
            said = "; ".join(f"{' and '.join(map(repr, qs))} are both {scheme}" for scheme, qs in twice.items())
            raise ValueError(f"--quant-types name a scheme more than once: {said}; each is collected once")
        return mode, collections, notes
    if args.quant_types:
        raise ValueError(f"--quant-types is for batch mode; {mode} collects one --quant-type")
    if qt is None and env_qt is not None:
        qt = env_qt
        notes.append(f"quant type {env_qt} from {ENV_QUANT_TYPE}")
    elif env_qt is not None and env_qt != qt:
        notes.append(f"{ENV_QUANT_TYPE}={env_qt} not used: the command line names {qt}")
    return mode, [collection_for(qt or DEFAULT_QUANT_TYPE[mode], args.legacy)], notes


def precision_for(dtype: str | None) -> str | None:
    """`experiments run --precision` for the predecessor's `--dtype` (None: not given)."""
    if dtype is None:
        return None
    if dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    if dtype.lower() in ("fp8", "fp4", "hifp8", "mxfp8", "mxfp4"):
        raise ValueError(f"--dtype {dtype!r}: fxquant trains in bf16 or fp32 (--dtype bf16|fp32, i.e. --precision) "
                         f"and emulates low-precision GEMMs by scheme: give the format as the quant type "
                         f"(e.g. `fxquant collect single mxfp8`, or a scheme name such as FA_linear_fp8_e4m3)")
    raise ValueError(f"--dtype {dtype!r} is not supported; allowed: bf16, fp32 (fp16 training is not offered: "
                     f"use bf16)")
