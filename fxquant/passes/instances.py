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

``instance_arguments`` names the compiling frame's module arguments and closure variables that hold a site or a
capture tap of the graph and share their class with another module of the root model; ``guard_instances`` adds
Dynamo's ID_MATCH guard on each (the guard Dynamo itself puts on a module it specialises; its ``recompile_limit``
then counts compiles per guarded instance, and ``accumulated_recompile_limit``, 256 by default, all compiles of the
frame). Where a site's module reaches the frame another way (a bound method, ``*args``), ``uncovered_parameters``
names the graph's parameter inputs it owns, and those are guarded instead. So a graph compiled for one instance
never runs for another: every layer's sites are rewritten with its own configuration, reported under its own path
(``explain``, strict mode's coverage check, the runtime counters) and captured under its own labels, also when the
scheme treats every layer alike. A frame without sites or taps (a router's, a norm's) stays shared.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import fx, nn

from fxquant.passes.module_paths import ModuleNames
from fxquant.passes.sites import SiteMeta

log = logging.getLogger(__name__)


def _under(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix + ".")


def instance_arguments(arguments: dict[str, object], names: ModuleNames, held: Sequence[str]) -> dict[str, str]:
    """Name -> module path, for each module of the root model among the compiling frame's ``arguments`` (name ->
    value) that holds a ``held`` path (a site's or tap's module) and shares its class with another module."""
    out = {}
    for arg, value in arguments.items():
        path = names.path_of(value)
        if path is not None and names.shares_class(value) and any(_under(p, path) for p in held):
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
    """The compiling frame's arguments and closure variables (a module a nested function reads, as in Hugging Face's
    ``create_custom_forward(module)``), by name, with their values at the frame's entry."""
    code = getattr(tx, "f_code", None)
    f_locals = getattr(tx, "f_locals", None)
    if code is None or not isinstance(f_locals, dict):
        return {}
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount] + code.co_cellvars + code.co_freevars
    return {name: f_locals[name] for name in dict.fromkeys(names) if name in f_locals}


def _guard_identity(source: object) -> None:
    from torch._dynamo.guards import GuardBuilder, install_guard

    install_guard(source.make_guard(GuardBuilder.ID_MATCH))


def _local(tx: object, name: str) -> object:
    """Dynamo's source of the frame's local ``name`` (an argument a closure reads, or a free variable, is a cell)."""
    from torch._dynamo.source import LocalSource

    code = tx.f_code
    return LocalSource(name, is_input=True, is_derefed_cell_contents=name in code.co_cellvars + code.co_freevars)


def _parameter_inputs(gm: fx.GraphModule | None) -> list[tuple[nn.Parameter, object]]:
    """(parameter, Dynamo source) of each graph input of ``gm`` that is a parameter."""
    out = []
    for node in gm.graph.nodes if gm is not None else ():
        grapharg = node.meta.get("grapharg") if node.op == "placeholder" else None
        example, source = getattr(grapharg, "example", None), getattr(grapharg, "source", None)
        if isinstance(example, nn.Parameter) and source is not None:
            out.append((example, source))
    return out


def uncovered_parameters(arguments: dict[str, object], names: ModuleNames, held: Sequence[str],
                         parameters: Sequence[tuple[nn.Parameter, object]]) -> list[tuple[str, object]]:
    """(owner path, source) of the graph's parameter inputs owned at or under a ``held`` path that no module among
    the frame's ``arguments`` holds: the module reached the frame another way (a bound method, ``*args``), so its
    parameters, found by Dynamo through it, tell the instance."""
    frame_paths = [p for p in map(names.path_of, arguments.values()) if p is not None]
    loose = [p for p in held if not any(_under(p, f) for f in frame_paths)]
    owned = [(names.owner_of(param), source) for param, source in parameters]
    return [(owner, source) for owner, source in owned if owner is not None and any(_under(owner, p) for p in loose)]


def guard_instances(names: ModuleNames, sites: Sequence[SiteMeta], tap_modules: Sequence[str],
                    gm: fx.GraphModule | None = None) -> dict[str, str]:
    """Guard by identity what tells the instance of the graph's sites and taps (module docstring): the frame's
    modules that hold them, else their parameters that are graph inputs; returns what it guarded (argument name or
    parameter source -> module path). Nothing outside Dynamo's compile of a frame."""
    tx = _compiling_frame()
    if tx is None:
        return {}
    arguments = _frame_arguments(tx)
    held = [s.site.module_path for s in sites] + list(tap_modules)
    guarded = instance_arguments(arguments, names, held)
    for name in guarded:
        _guard_identity(_local(tx, name))
    for path, source in uncovered_parameters(arguments, names, held, _parameter_inputs(gm)):
        _guard_identity(source)
        guarded[source.name] = path
    if guarded:
        log.debug("fxquant: graph compiled for one module instance: %s", guarded)
    return guarded
