"""The fxquant torch.compile backend: fxquant's passes on the Dynamo graph, then Inductor or aot_eager.

``FxquantBackend(scheme, inner=Inner.INDUCTOR, ...)`` is what ``fxquant.compile`` hands to
``torch.compile(backend=...)``. Per Dynamo graph it runs ``fxquant.passes.run_passes`` (match, resolve,
rewrite), records a ``GraphReport``, has Dynamo compile the frame per module instance where the graph holds an
instance's sites or taps (``passes.instances``), compiles the rewritten graph with the inner backend, and reports sites it
could not rewrite (``passes.strict``); a graph whose compile raises (Dynamo restarting the frame's analysis, as
when it specialises a float it first traced as symbolic) leaves no report and no issue behind:

    Inner.INDUCTOR   compile_fx with config_patches keying the caches on fxquant (passes.cache_key, trap 5)
    Inner.AOT_EAGER  AOT autograd without codegen (quick; what most tests use, trap 11)
    Inner.EAGER      the rewritten graph run as it is, by the Python interpreter: the eager reference
                     that compiled runs are compared with bit for bit

``kernels`` (``fxquant.lowering.Kernels``) picks what the graph's quantize ops run, per graph and device: under
INDUCTOR they are lowered into ATen ops through AOT autograd's decomposition table, so Inductor fuses them.
"""
from __future__ import annotations

import collections
import enum
import logging

import torch
from torch import fx, nn

from fxquant import lowering
from fxquant.lowering import Kernels
from fxquant.passes import GraphReport, LayerNumbering, ModuleNames, run_passes
from fxquant.passes.instances import guard_instances
from fxquant.passes.strict import (QuantizationError, failed_sites, opaque_calls, possible_sites, report,
                                    unmatched_rule_error)
from fxquant.schemes.scheme import Scheme

log = logging.getLogger(__name__)



def _direct_forward(gm: fx.GraphModule):
    """``gm``'s generated ``forward``, called directly. The passes leave a lazily recompiled GraphModule, whose
    ``forward`` goes through ``GraphModule.__call__``: a call that raises there (a model failing on its input)
    had torch.fx print the generated code to stderr before the exception reached the caller."""
    real_recompile = getattr(gm, "real_recompile", None)  # torch.fx._lazy_graph_module._LazyGraphModule
    if real_recompile is not None:
        real_recompile()
    return gm.forward

class Inner(str, enum.Enum):
    INDUCTOR = "inductor"
    AOT_EAGER = "aot_eager"
    EAGER = "eager"


def scheme_text(scheme: Scheme) -> str:
    try:
        return scheme.to_yaml()
    except (ValueError, TypeError):
        return repr(scheme)


class FxquantBackend:
    """A torch.compile backend; ``reports`` holds one GraphReport per Dynamo graph it compiled."""

    def __init__(self, scheme: Scheme, *, inner: Inner = Inner.INDUCTOR, strict: bool = False,
                 root: nn.Module | None = None, dry_run: bool = False, capture: object = None,
                 layers: LayerNumbering | None = None, attention: str | None = None,
                 kernels: Kernels = Kernels.AUTO) -> None:
        self.scheme = scheme
        self.kernels = Kernels(kernels)
        self.kernels_used: dict[int, Kernels] = {}  # graph index -> what ``kernels`` resolved to
        self.attention = attention  # SDPA implementation (passes.rewrite_sdpa.AttentionImpl); None: the env/auto
        self.capture = capture  # a CaptureSpec: taps are inserted after the rewrite passes
        self.tap_reports: list = []
        self.inner = Inner(inner)
        self.strict = strict
        self.dry_run = dry_run
        self.root = root
        self.names = ModuleNames(root)
        self.layers = layers if layers is not None else LayerNumbering.of_model(root)  # global layer indices
        self.reports: list[GraphReport] = []
        self.runs: collections.Counter[int] = collections.Counter()  # calls of each compiled graph (report index)
        self.recomputed_runs = 0  # graph calls made during a backward (fxquant.counters)
        self.pending: list[Exception] = []
        self._scheme_text = scheme_text(scheme)

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> object:
        # Dynamo wraps any exception raised here into BackendCompilerFailed. A user error (ValueError) is returned
        # as a graph that raises it when called, so nothing of the graph runs; strict failures are kept in
        # ``pending`` and raised by fxquant.compile's hook after the call.
        kept = len(self.reports), len(self.tap_reports), len(self.pending)
        try:
            graph_report = run_passes(
                gm, self.scheme, self.names, layers=self.layers, index=len(self.reports),
                dry_run=self.dry_run, dedupe=self.inner is not Inner.EAGER and torch.is_grad_enabled(),
                attention=self.attention,
            )
        except ValueError as exc:
            return self.refusal(exc)
        graph_report.frame = _frame_id()
        graph_report.grad_enabled = torch.is_grad_enabled()
        self.reports.append(graph_report)
        unmatched = self.unmatched_rules()
        if unmatched is not None:
            self.reports.pop()  # the graph never runs: nothing of it is checked again after the call
            return self.refusal(unmatched)
        if self.capture is not None and not self.dry_run:
            from fxquant.passes.capture_taps import insert_capture_taps

            self.tap_reports.append(insert_capture_taps(gm, self.capture))  # it logs what it cannot tap
        taps = self.tap_reports[-1].taps if self.capture is not None and not self.dry_run else []
        graph_report.instance = guard_instances(self.names, graph_report.sites, [t.module for t in taps], gm)
        n_rewritten = sum(s.status.value == "rewritten" for s in graph_report.sites)
        log.info("fxquant: graph %d: %d sites matched, %d rewritten, %d matmul-like ops unmatched",
                 graph_report.index, len(graph_report.sites), n_rewritten, len(graph_report.unmatched))
        try:
            compiled = self.compile_inner(gm, example_inputs, graph_report.index)
        except BaseException:  # re-raised: the graph was not compiled, so it never runs
            self._forget(graph_report.index, *kept)
            raise
        issues = failed_sites(graph_report.sites)  # said once the graph is compiled: it is the one that runs
        if not self.dry_run:  # explain() lists them as unmatched instead
            issues += opaque_calls(graph_report.unmatched, self.scheme, self.layers)
        try:
            report(issues, self.strict)
        except QuantizationError as exc:
            self.pending.append(exc)
        return self._counted(compiled, graph_report.index)

    def _forget(self, index: int, reports: int, tap_reports: int, pending: int) -> None:
        """Drop what ``__call__`` recorded for graph ``index`` when its compile raised: Dynamo restarting the
        frame's analysis (``RestartAnalysis``: e.g. a float it traced as symbolic, such as nn.MultiheadAttention's
        ``dropout_p`` under ``dynamic=True``, specialised for the next attempt) or a failed compile. That graph
        never runs, so its sites, unmatched ops and strict issues are not the model's."""
        del self.reports[reports:], self.tap_reports[tap_reports:], self.pending[pending:]
        self.kernels_used.pop(index, None)

    def _counted(self, compiled: object, index: int) -> object:
        """``compiled`` (the graph's callable, boxed or not), counting its calls in ``runs[index]``: the runtime
        counters expect the quantizes of the graphs that ran (fxquant.counters)."""
        def run(*args: object) -> object:
            if torch._C._current_graph_task_id() == -1:
                self.runs[index] += 1
            else:  # a call while autograd runs a backward: a checkpoint around the module recomputing its forward
                self.recomputed_runs += 1
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # AOT/Inductor's list-of-args convention
        return run

    def _resolve_kernels(self, example_inputs: list, index: int) -> Kernels:
        """What this graph's quantize ops run; ValueError where the choice cannot run (TRITON without kernels)."""
        device = lowering.graph_device(example_inputs)
        configs = [s.config for r in self.reports if r.index == index for s in r.sites]
        inexact = lowering.inexact_formats(configs, device)
        used = lowering.resolve(self.kernels, inductor=self.inner is Inner.INDUCTOR, device=device, inexact=inexact)
        self.kernels_used[index] = used
        log.info("fxquant: graph %d: quantize kernels %s (kernels=%s, %s%s)", index, used.value, self.kernels.value,
                 device, f"; Inductor's lowering is not exact there for {', '.join(inexact)}" if inexact else "")
        return used

    def unmatched_rules(self) -> ValueError | None:
        """Scheme rules with a selector that match neither a site compiled so far nor any site a later graph
        could show (``strict.possible_sites``): known before the graph that is compiling runs. Rules this
        cannot rule out (e.g. ``kinds: [attention]`` on a model without attention) are caught after the call,
        against the sites compiled (``CompileState._check_new_graphs``)."""
        known = [s.site for s in self.current_sites()]
        if self.root is not None:
            known += possible_sites(self.root, self.layers)
        return unmatched_rule_error(self.scheme, known, self.layers)

    def refusal(self, exc: ValueError):
        """A compiled graph that raises ``exc`` instead of running (kept in ``pending`` too, for ``explain``,
        whose example call may not reach the graph; raising it forgets it there)."""
        self.pending.append(exc)

        def refuse(*args: object) -> object:
            if exc in self.pending:
                self.pending.remove(exc)
            raise exc

        return refuse

    def raise_pending(self) -> None:
        """Raise the first error kept by ``__call__`` (and forget them all)."""
        if self.pending:
            first, self.pending = self.pending[0], []
            raise first

    def compile_inner(self, gm: fx.GraphModule, example_inputs: list, index: int = -1) -> object:
        if self.dry_run:
            return _direct_forward(gm)
        if self.inner is Inner.EAGER:  # the graph interpreted: its ops run what is registered for the device
            try:  # ... but a choice that cannot run is refused as under the other backends
                lowering.resolve(self.kernels, inductor=False, device=lowering.graph_device(example_inputs))
            except ValueError as exc:
                return self.refusal(exc)
            return _direct_forward(gm)
        try:
            kernels = self._resolve_kernels(example_inputs, index)
        except ValueError as exc:
            return self.refusal(exc)
        if self.inner is Inner.AOT_EAGER:
            from functorch.compile import min_cut_rematerialization_partition
            from torch._dynamo.backends.common import aot_autograd
            from torch._dynamo.backends.debugging import boxed_nop

            from fxquant.passes.effects import direct_capture_calls

            def nop(g: fx.GraphModule, inputs: list) -> object:  # aot_eager's compiler, capture calls made direct
                direct_capture_calls(g)
                return boxed_nop(g, inputs)

            # torch's aot_eager with fxquant's decompositions for ``kernels``: aot_eager itself drops a
            # ``decompositions`` argument (it builds its aot_autograd backend without one)
            return aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=min_cut_rematerialization_partition,
                                keep_inference_input_mutations=True,
                                decompositions=lowering.decompositions(kernels))(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx

        from fxquant import cpp_prebuild, isa_probe
        from fxquant.passes.cache_key import inductor_config_patches

        cpp_prebuild.install()  # C++ kernels built a few to a library, from code generation on
        isa_probe.wait()  # Inductor's ISA flags settled before anything reads them

        patches = inductor_config_patches(f"{self._scheme_text}\nkernels: {kernels.value}", gm)
        if kernels is Kernels.INDUCTOR:
            patches.update(lowering.inductor_config_patches())
        # AOT autograd's cache takes a graph with a custom autograd.Function (Dynamo's autograd_function_apply,
        # whose traced forward and backward bodies the key hashes: Megatron's tensor-parallel mappings) only
        # with this flag; scoped to fxquant's compiles (docs/compile.md, "Compile caches")
        with torch._functorch.config.patch(autograd_cache_allow_custom_autograd_functions=True):
            return compile_fx(gm, example_inputs, config_patches=patches,
                              decompositions=lowering.decomposition_table(kernels))

    # -- what was seen, across graphs (recompiles replace earlier graphs of the same sites) ----------------
    def current_sites(self) -> list:
        """The latest SiteMeta per (module path, op, occurrence): a recompiled graph replaces the old one."""
        latest: dict[tuple, object] = {}
        for rep in self.reports:
            seen: dict[tuple, int] = {}
            for s in rep.sites:
                base = (s.site.module_path, s.op)
                k = seen.get(base, 0)
                seen[base] = k + 1
                latest[base + (k,)] = s
        return list(latest.values())

    def current_reports(self) -> list[GraphReport]:
        """The reports of graphs still in use: one whose sites a later graph compiled in the same grad mode covers
        again was recompiled (a graph compiled under no_grad, for evaluation, sits beside the training graph)."""
        keys = [{(s.site.module_path, s.op, s.node_name) for s in r.sites} for r in self.reports]
        current = []
        for i, rep in enumerate(self.reports):
            later = set().union(*(k for k, r in zip(keys[i + 1:], self.reports[i + 1:])
                                  if r.grad_enabled == rep.grad_enabled))
            if not keys[i] or not keys[i] <= later:
                current.append(rep)
        return current

    def _step_reports(self) -> list[GraphReport]:
        """The graphs of a step: those in use compiled in grad mode (a training step), else (a model only ever
        called under no_grad) those compiled without."""
        current = self.current_reports()
        return [r for r in current if r.grad_enabled] or current

    def expected_calls(self) -> tuple[int, int]:
        """(forward, backward) calls of the ``fxquant::quantize`` op per step, in graphs that call the op (a graph
        whose quantizes Inductor generated code for, ``Kernels.INDUCTOR``, calls none: ``fused_calls``)."""
        return self.calls_of({r.index: 1 for r in self._step_reports()}, fused=False)

    def fused_calls(self) -> tuple[int, int]:
        """(forward, backward) quantizes per step that run as Inductor-generated code, not as op calls."""
        return self.calls_of({r.index: 1 for r in self._step_reports()}, fused=True)

    def calls_of(self, times: dict[int, int], *, fused: bool) -> tuple[int, int]:
        """(forward, backward) quantizes of the graphs ``times`` names (report index -> calls), of those lowered into
        Inductor's code (``fused``) or of those that call the op; a graph compiled under no_grad has no backward."""
        fwd = bwd = 0
        for r in self.reports:
            n = times.get(r.index, 0)
            if n and (self.kernels_used.get(r.index) is Kernels.INDUCTOR) == fused:
                fwd += n * r.expected_calls[0]
                bwd += n * r.expected_calls[1] * r.grad_enabled
        return fwd, bwd

    def block_times(self, runs: dict[int, int], grad_enabled: bool) -> dict[int, int]:
        """Report index -> how many calls of that graph a block of calls should have made: every graph as often as
        it ran (``runs``; a module called twice, an evaluation's no_grad graph, a graph of another input shape),
        and for each frame in use none of whose graphs of the grad modes that ran (none ran: ``grad_enabled``, the
        mode the block started in) ran, its latest graph once: a shortfall (a frame fell back to eager, the
        uncompiled module was called)."""
        times = {i: n for i, n in runs.items() if n}
        by_index = {r.index: r for r in self.reports}
        ran = [by_index[i] for i in times if i in by_index]
        modes = {r.grad_enabled for r in ran} or {grad_enabled}
        frames = {(r.frame, r.grad_enabled) for r in ran if r.frame is not None}
        for r in self.current_reports():  # a frame none of whose graphs ran: its graph in use, once
            if r.grad_enabled in modes and (r.frame, r.grad_enabled) not in frames:
                times[r.index] = max(times.get(r.index, 0), 1)
        return times

    def recomputes_in(self, times: dict[int, int]) -> bool:
        """Whether a graph ``times`` names has sites in checkpointed regions (``GraphReport.recomputes``): its
        backward runs the region's forward quantizes again, as many as it needs, beyond ``calls_of``."""
        return any(r.recomputes for r in self.reports if times.get(r.index))

    def unmatched_ops(self) -> list:
        """The unmatched ops of the graphs in use, once per call: per Dynamo frame those of its latest graph (a
        recompile replaces the frame's earlier graphs), over every frame (a graph break's resume function is a frame
        of its own). A recompile that compiles no graph (a frame left with nothing but a graph break) leaves the
        frame's earlier graph listed; a graph compiled outside Dynamo (no frame id) counts as a frame of its own."""
        latest = {("frame", rep.frame) if rep.frame is not None else ("graph", rep.index): rep for rep in self.reports}
        return [u for rep in latest.values() for u in rep.unmatched]


def _frame_id() -> int | None:
    """The frame id of the graph Dynamo is compiling (``CompileId.frame_id``; recompiles of a frame share it)."""
    try:
        compile_id = torch._guards.CompileContext.current_compile_id()
    except Exception:  # pragma: no cover - torch internals moved
        return None
    return getattr(compile_id, "frame_id", None)
