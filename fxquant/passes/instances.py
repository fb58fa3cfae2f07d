"""Graphs compiled per module instance: an identity guard where a graph's rewrite depends on the module it runs for.

Dynamo caches compiled code per code object. By default (``inline_inbuilt_nn_modules``) it guards a module that
reaches a frame as an argument (``self`` of a layer's ``forward``, or of a resume function after a graph break) by
its type only, and passes the module's parameters as graph inputs, so one compiled graph serves every instance of
a class whose calls Dynamo compiles as frames of their own: the layers of a stack whose loop has a graph break
(Dynamo runs such a loop eagerly and compiles each layer's call), Megatron's ``TransformerLayer`` with its own
``__call__``. fxquant's rewrite of a graph is fixed when it compiles, from the module paths of the instance it was
traced for: the formats the scheme resolves for its sites (a rule that selects ``layers: [1]``) and the module path
and layer of each capture tap. Run for another instance, such a graph would quantize with the first instance's
formats and label its captures with the first instance's paths.

``instance_arguments`` names the compiling frame's module arguments that hold a site or a capture tap of the graph
and share their class with another module of the root model. ``guard_instances`` adds Dynamo's ID_MATCH guard on
each (the guard Dynamo itself puts on a module it specialises; its ``recompile_limit`` then counts compiles per
guarded instance, and ``accumulated_recompile_limit``, 256 by default, all compiles of the frame), so the frame
compiles once per instance: every layer's sites are rewritten with its own configuration, reported under its own
path (``explain``, strict mode's coverage check, the runtime counters) and captured under its own labels, also when
the scheme treats every layer alike. A frame without sites or taps (a router's, a norm's) stays shared.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from fxquant.passes.sites import SiteMeta

log = logging.getLogger(__name__)


def _under(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix + ".")


def instance_arguments(arguments: dict[str, object], root: nn.Module, sites: Sequence[SiteMeta],
                       tap_modules: Sequence[str]) -> dict[str, str]:
    """Argument name -> module path, for each module argument of the compiling frame (``arguments``: name -> value)
    that holds a site (``sites``) or a tap (``tap_modules``) and has another module of its class in ``root``."""
    path_of: dict[int, str] = {}
    classes: dict[type, int] = {}
    for name, m in root.named_modules():
        path_of.setdefault(id(m), name)
        classes[type(m)] = classes.get(type(m), 0) + 1
    held = [s.site.module_path for s in sites] + list(tap_modules)
    out = {}
    for arg, value in arguments.items():
        if isinstance(value, nn.Module) and id(value) in path_of and classes[type(value)] > 1:
            path = path_of[id(value)]
            if any(_under(p, path) for p in held):
                out[arg] = path
    return out


def _compiling_frame() -> object | None:
    """Dynamo's translator of the frame being compiled (None outside Dynamo, e.g. a backend called directly)."""
    try:
        from torch._dynamo import symbolic_convert
    except ImportError:  # pragma: no cover - Dynamo is part of every supported torch
        return None
    return getattr(symbolic_convert.tls, "current_tx", None)


def _frame_arguments(tx: object) -> dict[str, object]:
    code = getattr(tx, "f_code", None)
    f_locals = getattr(tx, "f_locals", None)
    if code is None or not isinstance(f_locals, dict):
        return {}
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    return {name: f_locals[name] for name in names if name in f_locals}


def _identity_guard(tx: object, name: str) -> None:
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import LocalSource

    code = tx.f_code
    cell = name in code.co_cellvars or name in code.co_freevars  # an argument a closure reads is stored in a cell
    source = LocalSource(name, is_input=True, is_derefed_cell_contents=cell)
    install_guard(source.make_guard(GuardBuilder.ID_MATCH))


def guard_instances(root: nn.Module | None, sites: Sequence[SiteMeta], tap_modules: Sequence[str]) -> dict[str, str]:
    """Guard by identity the compiling frame's module arguments that hold the graph's sites or taps (module
    docstring); returns them (argument name -> module path). Nothing outside Dynamo's compile of a frame."""
    tx = _compiling_frame()
    if root is None or tx is None:
        return {}
    guarded = instance_arguments(_frame_arguments(tx), root, sites, tap_modules)
    for name, path in guarded.items():
        _identity_guard(tx, name)
        log.debug("fxquant: graph compiled for module %r only (frame argument %r)", path, name)
    return guarded
