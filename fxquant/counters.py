"""Runtime counters: ``fxquant::quantize`` calls expected vs executed per step (issue 3, item 5).

Expected comes from the rewrite passes (each SiteMeta's ``quantize_calls``: forward, backward) of the
graphs that ran in the block, as often as each ran (a module called twice expects twice; a graph compiled under
no_grad, an evaluation's, expects no backward), and of the other graphs in use for the same grad mode (a training
step's, or an evaluation's) once each; executed is measured, not inferred: the calls of the ``fxquant::quantize`` op (and
of ``fxquant::quantize_reference``, which ``kernels="reference"`` lowers it to) that the dispatcher records
while the block runs (torch.profiler, CPU activity; the op is dispatched by
eager, aot_eager and Inductor-generated code alike, and by the autograd engine's threads). A ``fxquant.compile``'d
module inside the compiled model runs graphs of its own (docs/compile.md): expected adds those of its graphs
that ran in the block. Count a step that compiles nothing (tracing dispatches the op as well; such a count is
flagged ``compiled``). A shortfall means some quantization did not run (a frame fell back to eager, the uncompiled module was called, a graph's
call made fewer quantizes than its passes expect); an excess, that the model quantizes by itself.
Graphs compiled with ``kernels="inductor"`` quantize in lowered ATen ops (Inductor-generated code, or aot_eager's
ATen calls) and dispatch no op: they count in ``fused`` (from the passes), not in expected or executed.
A forward-only step (``backward=False``) of graphs compiled in grad mode may run some of the backward's quantizes:
AOT autograd's partitioner may quantize a forward value for a backward GEMM (the input X along M for wgrad) in
the forward graph and save the result instead of X. Such a step expects its forward's quantizes and at most all of
the backward's more; a step of graphs compiled under no_grad expects its forward's exactly.

    >>> with fxquant.counters.count_quantize_calls(compiled) as count:
    ...     loss = compiled(batch).loss; loss.backward()
    >>> count.expected, count.executed, count.ok
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

OP_NAMES = ("fxquant::quantize", "fxquant::quantize_reference")  # the op, and the reference it may lower to


@dataclass
class QuantizeCount:
    expected_forward: int
    expected_backward: int
    executed: int = 0
    backward: bool = True
    compiled: bool = False  # graphs were compiled inside the block: tracing dispatches the op too
    fused: int = 0  # quantizes per step in Inductor-generated code (kernels="inductor"): no op call to count
    recomputed: bool = False  # sites in checkpointed regions: their backward recomputes forward quantizes


    @property
    def expected(self) -> int:
        return self.expected_forward + (self.expected_backward if self.backward else 0)

    @property
    def ok(self) -> bool:
        """Executed equals expected, or with checkpointed regions is at least expected (their recompute adds
        calls; how many depends on the backend's partitioner), or in a forward-only step lies between the forward's
        quantizes and those plus the backward's (the partitioner may move backward quantizes into the forward graph);
        a block that compiled counts as ok."""
        if self.compiled:
            return True
        if not self.backward:
            return self.expected_forward <= self.executed <= self.expected_forward + self.expected_backward
        return self.executed >= self.expected if self.recomputed else self.executed == self.expected

    def __str__(self) -> str:
        note = " (graphs were compiled during this step, so tracing calls are included; count a later step)"
        fused = f"; {self.fused} more quantizes lowered into ATen ops (kernels='inductor')" if self.fused else ""
        if self.backward:
            at_least = "at least " if self.recomputed else ""
            recompute = " (checkpointed regions recompute forward quantizes in the backward)" if at_least else ""
            expected = (f"{at_least}{self.expected} ({self.expected_forward} forward + {self.expected_backward} "
                        f"backward){recompute}")
        elif self.expected_backward:
            expected = (f"{self.expected_forward} to {self.expected_forward + self.expected_backward} (a forward-only "
                        f"step: {self.expected_forward} forward, and up to the {self.expected_backward} of the backward "
                        "that AOT autograd's partitioner may place in the forward graph)")
        else:
            expected = f"{self.expected} ({self.expected_forward} forward)"
        return f"fxquant::quantize calls: expected {expected}, executed {self.executed}{fused}" + (
            note if self.compiled else "")


def nested_states(model: nn.Module) -> list:
    """The CompileStates of ``fxquant.compile``'d modules inside ``model`` (at any depth): they run their own
    graphs, and their quantizes are part of ``model``'s step."""
    from fxquant.api import STATE_ATTR, CompileState

    states = [vars(m).get(STATE_ATTR) for m in model.modules()]
    return [s for s in states if isinstance(s, CompileState)]


def count_events(events: object) -> int:
    return sum(1 for e in events if e.name in OP_NAMES)


@contextlib.contextmanager
def count_quantize_calls(compiled: nn.Module, *, backward: bool = True, strict: bool | None = None) -> Iterator[QuantizeCount]:
    """Count the quantize calls of one step run inside the block; ``backward=False`` for forward-only steps.

    On exit a mismatch is reported like the other strict checks: raised (``QuantizationError``) when
    ``strict`` (default: the compiled module's own ``strict``), else logged at WARNING.
    """
    from fxquant.api import compile_state
    from fxquant.passes.strict import report

    state = compile_state(compiled)
    backends = [state.backend, *(s.backend for s in nested_states(state.model))]
    before = [(len(b.reports), dict(b.runs), b.recomputed_runs) for b in backends]
    grad_enabled = torch.is_grad_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        count = QuantizeCount(0, 0, backward=backward)
        yield count
    fused_fwd = fused_bwd = 0
    for i, (backend, (n_graphs, runs_before, recomputed_before)) in enumerate(zip(backends, before)):
        ran = {g: n - runs_before.get(g, 0) for g, n in backend.runs.items()}
        # the compiled module's graphs as block_times says; a nested module's, those that ran (it may be called
        # in some steps only; its own counter and strict checks judge its frames)
        times = backend.block_times(ran, grad_enabled) if i == 0 else {g: n for g, n in ran.items() if n}
        fwd, bwd = backend.calls_of(times, fused=False)
        count.expected_forward += fwd
        count.expected_backward += bwd
        fwd, bwd = backend.calls_of(times, fused=True)
        fused_fwd, fused_bwd = fused_fwd + fwd, fused_bwd + bwd
        # checkpointed regions in the graphs, or a checkpoint around the compiled module recomputing a graph during
        # the backward: more calls than a step without recompute, how many the checkpoint's kind decides
        count.recomputed |= backend.recomputes_in(times) or backend.recomputed_runs != recomputed_before
        count.compiled |= len(backend.reports) != n_graphs
    count.fused = fused_fwd + (fused_bwd if backward else 0)
    count.executed = count_events(prof.events())
    if not count.ok:
        report([f"{count} in this step"], state.strict if strict is None else strict)
