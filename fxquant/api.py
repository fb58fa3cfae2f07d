"""The public entry points ``fxquant.compile`` and ``fxquant.explain`` (issue 3, items 1 and 5).

``compile`` wraps ``torch.compile(model, backend=FxquantBackend(...))`` and adds, around each call of the
compiled module (forward pre-hook and an always-called forward hook, outside Dynamo):

- strict mode: Dynamo's ``fail_on_recompile_limit_hit`` for the duration of the call, so a frame that
  would fall back to eager raises instead;
- after a call that compiled new graphs: the checks of ``fxquant.passes.strict`` (coverage of selected
  modules, recompile-limit fallbacks; bad input: no site at all, rules matching nothing).

The state lives on the returned module as ``compiled._fxquant`` (a ``CompileState``); ``compile_state``
reads it, ``fxquant.counters`` uses it for the expected-vs-executed quantize counts.

The returned module's forward and hooks are ``torch.compiler.disable``d (``_run_apart``): inside another compiled
model it runs its own graphs, with its own scheme, at a graph break of the outer trace. ``copy.deepcopy`` and
``pickle`` make it again with ``compile`` (same scheme and options, fresh state).
"""
from __future__ import annotations

import copy
import functools
import inspect
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fxquant import isa_probe
from fxquant.backend import FxquantBackend, Inner
from fxquant.formats.options import did_you_mean
from fxquant.lowering import Kernels, parse_kernels
from fxquant.passes import LayerNumbering, SiteMeta, UnmatchedOp, strict as checks
from fxquant.passes.rewrite_sdpa import attention_impl
from fxquant.schemes.scheme import Scheme

log = logging.getLogger(__name__)

STATE_ATTR = "_fxquant"


def _scheme(scheme: object) -> Scheme:
    from fxquant import schemes

    if not isinstance(scheme, (str, Path, Scheme)):
        raise TypeError(f"scheme must be a preset name, a scheme YAML path or a Scheme, got {type(scheme).__name__}")
    return schemes.get(scheme)


def _inner(backend: object) -> Inner:
    allowed = [b.value for b in Inner]
    if isinstance(backend, Inner):
        return backend
    if not isinstance(backend, str) or backend not in allowed:
        hint = did_you_mean(backend, allowed) if isinstance(backend, str) else ""
        raise ValueError(f"backend={backend!r}{hint}; allowed: {', '.join(allowed)}")
    return Inner(backend)


def _on_cpu(model: nn.Module) -> bool:
    """Whether the model's parameters and buffers (if any) include CPU tensors."""
    tensors = [*model.parameters(), *model.buffers()]
    return not tensors or any(t.device.type == "cpu" for t in tensors)


def _graph_break_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def _new_graph_breaks(before: dict[str, int]) -> list[str]:
    """The first line of each graph-break reason Dynamo counted since ``before`` (``_graph_break_counts()``)."""
    return [reason.splitlines()[0] for reason, n in _graph_break_counts().items() if n > before.get(reason, 0)]


def _unimplemented_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["unimplemented"])


def _capture_spec(capture: object):
    from fxquant.capture import CaptureSpec, load_spec

    if isinstance(capture, CaptureSpec):
        return capture
    if not isinstance(capture, (str, Path)):
        raise TypeError(f"capture must be a CaptureSpec, a spec YAML path or a shipped spec name, got {type(capture).__name__}")
    return load_spec(capture)


@dataclass
class CompileState:
    """What ``fxquant.compile`` knows about one compiled module."""

    backend: FxquantBackend
    model: nn.Module
    strict: bool
    capture_session: object = None  # the session ``compile(capture_dir=...)`` started, if any
    options: dict = field(default_factory=dict, repr=False)  # compile's keyword arguments but capture_dir
    checked_reports: int = 0
    _warned_no_session: bool = field(default=False, repr=False)
    _patch: object = field(default=None, repr=False)
    _calls: int = field(default=0, repr=False)
    _first_call_checked: bool = field(default=False, repr=False)
    _attention_said: bool = field(default=False, repr=False)
    _sections_said: set = field(default_factory=set, repr=False)  # capture sections said to select no site
    _breaks: dict = field(default_factory=dict, repr=False)
    _unimpl: dict = field(default_factory=dict, repr=False)

    @property
    def scheme(self) -> Scheme:
        return self.backend.scheme

    def sites(self) -> list[SiteMeta]:
        return self.backend.current_sites()

    def unmatched(self) -> list[UnmatchedOp]:
        return self.backend.unmatched_ops()

    def kernels(self) -> list[Kernels]:
        """What the quantize ops of each compiled graph run (``fxquant.lowering.Kernels``), in compile order."""
        return [self.backend.kernels_used[i] for i in sorted(self.backend.kernels_used)]

    def expected_quantize_calls(self) -> tuple[int, int]:
        """(forward, backward) ``fxquant::quantize`` calls per step that the current rewritten graphs make (graphs
        lowered with ``kernels="inductor"`` make none: their quantizes are generated code, ``fused_quantizes``)."""
        return self.backend.expected_calls()

    def uncapturable(self) -> list[str]:
        """The points the capture spec selects that the compiled graphs do not offer (e.g. a quantized copy of an
        operand the scheme keeps in high precision), one line each, without repeats; logged as WARNING per graph."""
        return list(dict.fromkeys(line for report in self.backend.tap_reports for line in report.unavailable))

    def fused_quantizes(self) -> tuple[int, int]:
        """(forward, backward) quantizes per step that Inductor compiled into its own kernels."""
        return self.backend.fused_calls()

    # -- hooks -------------------------------------------------------------------------------------------
    def before_call(self, module: nn.Module, args: tuple) -> None:
        self._breaks, self._unimpl = _graph_break_counts(), _unimplemented_counts()
        if self.capture_session is not None:
            self.capture_session.set_iteration(self.capture_session.iteration + (self._calls > 0))
            self._calls += 1
        elif self.backend.capture is not None and not self._warned_no_session:
            from fxquant.capture import active_session

            if active_session() is None:
                self._warned_no_session = True
                log.warning(
                    "fxquant: a capture spec is compiled in but no capture session is active, so nothing is "
                    "written; start one with fxquant.capture.start(spec, dir) or pass capture_dir= to compile"
                )
        if self.strict:
            self._patch = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
            self._patch.__enter__()

    def after_call(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._patch is not None:
            patch, self._patch = self._patch, None
            patch.__exit__(None, None, None)
        if sys.exc_info()[0] is not None:  # the call raised (an always_call hook runs then too): that error is
            return                         # the news; checks of what the call compiled would mislead
        self.backend.raise_pending()
        issues = checks.recompile_limit_hits(self._unimpl, _unimplemented_counts())
        if not self._first_call_checked:
            self._first_call_checked = True
            if not self.backend.reports:  # Dynamo skipped the whole frame: no graph, so nothing is quantized
                issues += checks.no_graph_compiled(type(self.model).__name__, self._unimpl, _unimplemented_counts())
        if len(self.backend.reports) > self.checked_reports:
            self.checked_reports = len(self.backend.reports)
            issues += self._check_new_graphs()
        checks.report(issues, self.strict)

    def _check_new_graphs(self) -> list[str]:
        sites = self.sites()
        checks.check_model_has_sites(sites, self.unmatched(), type(self.model).__name__)
        new_breaks = _new_graph_breaks(self._breaks)
        expected = checks.model_sites(self.model, self.backend.layers)
        # after a graph break a selected module may have run outside the graphs (an LM head after a layer loop that
        # broke): its rule matches a site of the model, and the coverage check below says where it ran
        checks.check_rules_match(self.scheme, sites, self.backend.layers, expected if new_breaks else ())
        traced = frozenset().union(*(r.modules for r in self.backend.reports))
        issues = checks.coverage(expected, self.scheme, sites, new_breaks, traced)
        if not self._attention_said:  # once: later graphs (no_grad, new shapes) would repeat it
            missing = checks.attention_not_found(self.scheme, sites, self.unmatched())
            self._attention_said = bool(missing)
            issues += missing
        self._say_unmatched_sections()
        return issues

    def _say_unmatched_sections(self) -> None:
        """One WARNING per capture-spec section that selects no site of the graphs compiled so far (a graph break
        may put a section's sites in another graph than the first one; a section is judged over all of them)."""
        reports = [r for r in self.backend.tap_reports if r.sites]
        if self.backend.capture is None or not reports:
            return
        from fxquant.passes.capture_taps import unmatched_sections

        for name, line in unmatched_sections(self.backend.capture, reports):
            if name not in self._sections_said:
                self._sections_said.add(name)
                log.warning("capture: %s", line)


def compile(
    model: nn.Module,
    scheme: str | Path | Scheme,
    *,
    capture: object = None,
    capture_dir: str | Path | None = None,
    backend: str = "inductor",
    strict: bool = False,
    dynamic: bool | None = None,
    layer_offset: int | None = None,
    num_layers: int | None = None,
    attention: str | None = None,
    kernels: str = "auto",
) -> nn.Module:
    """``torch.compile(model)`` with every GEMM operand the scheme selects quantized, forward and backward.

    scheme: a preset name (``fxquant.schemes.names()``), a scheme YAML path, or a Scheme.
    backend: "inductor" (default), "aot_eager" (quick), or "eager" (the rewritten graph interpreted: the
        reference compiled runs are checked against).
    strict: raise ``QuantizationError`` when a selected site was not rewritten, a graph break split one,
        or a frame fell back to eager; otherwise the same is logged at WARNING.
    dynamic: passed to ``torch.compile``.
    layer_offset, num_layers: the global numbering of layers (``fxquant.passes.layers``), for a pipeline stage
        that holds a slice of the model: a site in ``layers.N`` is layer N + layer_offset, and ``num_layers``
        is the whole model's count (for ``last_layers``). Default: automatic, from Megatron's
        ``TransformerLayer.layer_number`` and ``config.num_layers`` when present, else the local ``layers.N``.
    capture: a tensor-capture placement spec (``fxquant.capture.CaptureSpec``, a spec YAML path, or a
        shipped spec name such as "predecessor"): capture taps are inserted around the sites it selects,
        in the forward and backward graphs. They write while a capture session is active.
    capture_dir: start that session now, writing under this directory; its iteration advances by one
        at every call of the returned module (``compile_state(m).capture_session``; close it to commit).
        Training loops with micro-batches start their own with ``fxquant.capture.start`` and drive
        ``set_iteration`` / ``set_micro_batch`` instead.
    attention: how quantized SDPA sites run: "auto" (the flash kernel op on CUDA, the explicit-math
        ``quantized_sdpa`` elsewhere), "flash" (the flash op everywhere: the flash reference off CUDA, same
        semantics as the GPU kernel), "math" (``quantized_sdpa`` everywhere). Default: the environment
        variable FXQUANT_ATTENTION, else "auto" (docs/compile.md).
    kernels: what the quantize ops run (``fxquant.lowering``): "inductor" (the reference's arithmetic as ATen
        ops that Inductor fuses with their neighbours), "triton" (the standalone Triton kernels), "reference"
        (the pure-torch reference as an opaque op), or "auto" (default): "inductor" with the Inductor backend
        on CPU and on CUDA (there except for a graph that quantizes in NVFP4, whose lowering is not bit-exact
        on CUDA, and where "inductor" is refused), else the Triton kernels where registered (CUDA), else the
        reference. Every choice gives the same values bit for bit; ``compile_state(m).kernels()`` says what
        each graph uses.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _refuse_compiled(model, "compile it with this scheme")
    spec = None if capture is None else _capture_spec(capture)
    if capture_dir is not None and spec is None:
        raise ValueError("capture_dir is only meaningful with a capture spec (capture=...)")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    if dynamic not in (None, True, False):
        raise ValueError(f"dynamic={dynamic!r}; allowed: None, True, False")
    resolved = _scheme(scheme)
    if attention is not None:
        attention = attention_impl(attention).value  # a bad name fails here, with a did-you-mean
    layers = LayerNumbering.of_model(model, layer_offset=layer_offset, num_layers=num_layers)
    fx_backend = FxquantBackend(resolved, inner=_inner(backend), strict=strict, root=model, capture=spec,
                                layers=layers, attention=attention, kernels=parse_kernels(kernels))
    if fx_backend.inner is Inner.INDUCTOR and _on_cpu(model):
        isa_probe.start()  # Inductor's one-time C++ toolchain probe, overlapped with the first call's tracing
    compiled = torch.compile(model, backend=fx_backend, dynamic=dynamic, **_ISOLATED)
    session = None
    if capture_dir is not None:
        from fxquant import capture as capture_api

        session = capture_api.start(spec, capture_dir, scheme=resolved.name)  # closed at exit if never closed
    options = dict(capture=spec, backend=backend, strict=strict, dynamic=dynamic, layer_offset=layer_offset,
                   num_layers=num_layers, attention=attention, kernels=kernels)
    state = CompileState(fx_backend, model, strict, capture_session=session, options=options)
    object.__setattr__(compiled, STATE_ATTR, state)
    # torch's OptimizedModule deep-copies and pickles as a bare torch.compile of the model (its __reduce__): no
    # hooks, no state, and a pickled backend with its rewritten graphs, which do not load. copy.deepcopy looks
    # __deepcopy__ up on the instance and pickle __reduce_ex__, so copy and unpickled module are compiled again.
    object.__setattr__(compiled, "__deepcopy__", functools.partial(_deepcopy_compiled, state))
    object.__setattr__(compiled, "__reduce_ex__", functools.partial(_reduce_compiled, state))
    _run_apart(compiled, state)
    return compiled


_APART = ("fxquant.compile'd module: it runs its own compiled graphs with its own scheme, outside the graph of "
          "an enclosing torch.compile (docs/compile.md, 'A compiled module inside a compiled model')")


def _run_apart(compiled: nn.Module, state: CompileState) -> None:
    """Make calls of ``compiled`` opaque to an enclosing Dynamo trace, and install the state's hooks.

    Dynamo inlines a torch.compile'd submodule into the graph of an enclosing compile (its ``_orig_mod``), which
    compiles it with the outer backend: the module would run unquantized, or with the outer scheme. Dynamo leaves a call
    of an OptimizedModule whose ``forward`` is ``torch.compiler.disable``d to run outside its graph (a graph
    break), and there ``forward`` runs this module's own compiled code. The forward is wrapped in a function of
    our own: ``disable`` unwraps a Dynamo-wrapped callable to the function it compiles. The hooks are disabled too
    (they run around ``forward``, where an enclosing compile would otherwise trace them as frames of their own)."""
    compiled_forward = compiled.forward

    def forward(*args: object, **kwargs: object) -> object:
        return compiled_forward(*args, **kwargs)

    compiled.forward = torch._dynamo.disable(forward, reason=_APART)
    compiled.register_forward_pre_hook(torch._dynamo.disable(state.before_call, reason=_APART))
    compiled.register_forward_hook(torch._dynamo.disable(state.after_call, reason=_APART), always_call=True)


# Every torch.compile of one model shares its forward's cache entries, and Dynamo's recompile limit (8) counts them
# all: a sweep of schemes over one model (each fxquant.compile or explain a new backend, so a new entry) ran its
# ninth compile unquantized. torch >= 2.13 keeps each call's entries, and their limit, apart.
_ISOLATED = {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}


def _deepcopy_compiled(state: CompileState, memo: dict) -> nn.Module:
    """``copy.deepcopy`` of a module ``compile`` returned: ``compile`` of a deep copy of its model, with the same
    scheme and options. Its graphs compile again on its first call; it has no capture session of its own."""
    if state.capture_session is not None:
        log.warning("fxquant: the deep copy of a module compiled with capture_dir= has no capture session of its own; "
                    "its capture taps write to the session active when it runs, whose iteration it does not advance")
    return compile(copy.deepcopy(state.model, memo), state.scheme, **state.options)


def _reduce_compiled(state: CompileState, protocol: int) -> tuple:
    """``pickle`` (and ``torch.save``) of a module ``compile`` returned: on loading, ``compile`` of the unpickled
    model with the same scheme and options, as ``copy.deepcopy``: a fresh state, graphs compiled on its first
    call; no capture session of its own."""
    if state.capture_session is not None:
        log.warning("fxquant: a module compiled with capture_dir= is pickled without its capture session; once "
                    "loaded, its capture taps write to the session active when it runs")
    return _compile_unpickled, (state.model, state.scheme, state.options)


def _compile_unpickled(model: nn.Module, scheme: Scheme, options: dict) -> nn.Module:
    return compile(model, scheme, **options)


def compile_state(compiled: nn.Module) -> CompileState:
    """The CompileState of a module returned by ``fxquant.compile``."""
    state = getattr(compiled, STATE_ATTR, None)
    if not isinstance(state, CompileState):
        raise TypeError(f"expected a module returned by fxquant.compile, got {type(compiled).__name__}")
    return state


def _refuse_compiled(model: nn.Module, to: str) -> None:
    """A torch.compile'd or fxquant.compile'd module (an OptimizedModule) is refused: its wrapped module is wanted."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        how = "fxquant.compile" if hasattr(model, STATE_ATTR) else "torch.compile"
        raise TypeError(f"model is already compiled ({how}); pass the module it wraps, model._orig_mod, to {to}")


def explain(model: nn.Module, *example_args: object, scheme: str | Path | Scheme, layer_offset: int | None = None,
            num_layers: int | None = None, kernels: str = "auto", backend: str = "inductor", **example_kwargs: object):
    """Trace ``model(*example_args, **example_kwargs)`` once (forward only) and return an ``Explanation``:
    every matched site with its resolved per-operand formats, every matmul-like op left unmatched, and the
    quantize implementation ``compile(kernels=..., backend=...)`` would use on the inputs' device.
    The model is not modified and nothing is quantized; ``print(explanation)`` shows the table.
    ``layer_offset`` / ``num_layers``: the global layer numbering, as in ``compile``."""
    from fxquant import lowering
    from fxquant.passes.explanation import Explanation

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _refuse_compiled(model, "explain it (its paths would carry the wrapper's _orig_mod. prefix)")
    resolved = _scheme(scheme)
    layers = LayerNumbering.of_model(model, layer_offset=layer_offset, num_layers=num_layers)
    fx_backend = FxquantBackend(resolved, inner=Inner.EAGER, root=model, dry_run=True, layers=layers)
    # Grad mode on, as in training: Megatron's linears are traced as autograd_function_apply then.
    before, breaks_before = _unimplemented_counts(), _graph_break_counts()
    torch.compile(model, backend=fx_backend, **_ISOLATED)(*example_args, **example_kwargs)
    fx_backend.raise_pending()
    if not fx_backend.reports:  # Dynamo skipped the frame: say so, rather than "no linear op was found"
        raise ValueError(checks.no_graph_compiled(type(model).__name__, before, _unimplemented_counts())[0])
    sites, unmatched = fx_backend.current_sites(), fx_backend.unmatched_ops()
    checks.check_model_has_sites(sites, unmatched, type(model).__name__)
    breaks = _new_graph_breaks(breaks_before)
    expected = checks.model_sites(model, layers) if breaks else []
    checks.check_rules_match(resolved, sites, layers, expected)  # as compile: a rule with a selector must match a site
    traced = frozenset().union(*(r.modules for r in fx_backend.reports))
    for issue in checks.coverage(expected, resolved, sites, breaks, traced):  # not in the table: ran outside a graph
        log.warning("fxquant: %s", issue)
    graphs = len(fx_backend.reports)
    requested = parse_kernels(kernels)
    device = lowering.graph_device([*example_args, *example_kwargs.values(), *model.parameters()])
    inexact = lowering.inexact_formats([s.config for s in sites], device)
    used = lowering.resolve(requested, inductor=_inner(backend) is Inner.INDUCTOR, device=device, inexact=inexact)
    how = f"{used.value} (kernels={requested.value}, backend {_inner(backend).value}, {device})"
    if inexact and requested is lowering.Kernels.AUTO and _inner(backend) is Inner.INDUCTOR:
        how += f"; not inductor: its code is not bit-exact for {', '.join(inexact)} on {device}"
    return Explanation(resolved, copy.copy(sites), unmatched, graphs,
                       resolved.unmatched_rules([s.site for s in sites] + expected), kernels=how)
