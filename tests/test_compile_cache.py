"""Inductor's compile caches under fxquant.compile (ARCHITECTURE.md trap 5).

A second compile of the same model and scheme loads its forward and backward graphs from the FX-graph and
AOT-autograd caches and gives the same results bit for bit (a graph with capture taps too, its records
the same); a change that the graph does not show (fxquant's sources, the quantize
implementation) misses; the decomposition table, which both caches put in their keys, pickles as the call
that builds it.
"""
from __future__ import annotations

import copy
import pickle
import uuid

import pytest
import torch
from torch._dynamo.utils import counters

import fxquant
from fxquant import capture, lowering
from fxquant.lowering import Kernels
from fxquant.passes import cache_key
from tests.models import make_llama, make_tokens, next_token_loss

pytestmark = pytest.mark.slow

CFG = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=128, max_seq_len=16)


def _cache_counts() -> dict[str, int]:
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {"fx_hit": inductor["fxgraph_cache_hit"], "fx_miss": inductor["fxgraph_cache_miss"],
            "fx_bypass": inductor["fxgraph_cache_bypass"], "aot_hit": aot["autograd_cache_hit"],
            "aot_miss": aot["autograd_cache_miss"], "aot_bypass": aot["autograd_cache_bypass"]}


def _step(base: torch.nn.Module, scheme: str, **options) -> tuple[dict[str, int], torch.Tensor, dict]:
    """One forward + backward of a fresh copy of ``base`` compiled anew; the cache counters' increments."""
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    tokens = make_tokens(model.cfg, seed=3)
    before = _cache_counts()
    loss = next_token_loss(fxquant.compile(model, scheme, strict=True, **options)(tokens), tokens)
    loss.backward()
    after = _cache_counts()
    return ({k: after[k] - before[k] for k in after}, loss.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters()})


def _assert_same(a: tuple, b: tuple) -> None:
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], rtol=0, atol=0, msg=name)


def test_second_compile_loads_both_graphs_from_the_caches_with_the_same_results():
    base = make_llama(**CFG)
    first = _step(base, "FA_linear_mxfp8")
    assert first[0]["fx_bypass"] == first[0]["aot_bypass"] == 0, first[0]
    second = _step(base, "FA_linear_mxfp8")
    assert second[0] == {"fx_hit": 2, "fx_miss": 0, "fx_bypass": 0, "aot_hit": 1, "aot_miss": 0, "aot_bypass": 0}
    _assert_same(first, second)


class _Doubled(torch.autograd.Function):
    """A custom autograd.Function, which Dynamo traces into ``autograd_function_apply`` (as it does Megatron's
    tensor-parallel mappings)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _WithFunction(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 96), torch.nn.Linear(96, 32)

    def forward(self, x):
        return self.fc2(_Doubled.apply(torch.relu(self.fc1(x))))


def test_a_graph_with_a_custom_autograd_function_loads_from_the_aot_cache():
    """AOT autograd's cache refuses ``autograd_function_apply`` unless torch's
    ``autograd_cache_allow_custom_autograd_functions`` is set; fxquant's Inductor path sets it for its own
    compiles (its traced forward and backward bodies are part of the hashed graph)."""
    base = _WithFunction()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))

    def run() -> tuple[dict[str, int], torch.Tensor, dict]:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        before = _cache_counts()
        out = fxquant.compile(model, "linear_mxfp8", strict=True)(x).square().sum()
        out.backward()
        after = _cache_counts()
        return ({k: after[k] - before[k] for k in after}, out.detach(),
                {n: p.grad.clone() for n, p in model.named_parameters()})

    first = run()
    assert first[0]["aot_bypass"] == 0 and first[0]["fx_bypass"] == 0, first[0]
    second = run()
    assert (second[0]["aot_hit"], second[0]["aot_bypass"]) == (1, 0), second[0]
    _assert_same(first, second)
    assert not torch._functorch.config.autograd_cache_allow_custom_autograd_functions  # scoped to the compile


def test_changed_sources_or_quantize_implementation_miss(monkeypatch):
    """The graph Dynamo hands over is the same; fxquant's code or the quantize implementation is not. (The
    sources' hash is salted first, so that no entry of an earlier run in the same cache directory matches.)"""
    salted = f"{cache_key.sources_hash()}-{uuid.uuid4()}"
    monkeypatch.setattr(cache_key, "sources_hash", lambda: salted)
    base = make_llama(**CFG)
    auto = _step(base, "linear_hifp8")
    assert (auto[0]["aot_miss"], auto[0]["fx_miss"]) == (1, 2), auto[0]
    assert _step(base, "linear_hifp8")[0]["aot_hit"] == 1

    reference = _step(base, "linear_hifp8", kernels="reference")
    assert (reference[0]["aot_hit"], reference[0]["fx_hit"]) == (0, 0), reference[0]
    assert reference[0]["aot_miss"] == 1

    monkeypatch.setattr(cache_key, "sources_hash", lambda: salted + "-edited")
    edited = _step(base, "linear_hifp8")
    assert (edited[0]["aot_hit"], edited[0]["fx_hit"]) == (0, 0), edited[0]
    assert edited[0]["aot_miss"] == 1 and edited[0]["fx_miss"] == 2
    _assert_same(auto, edited)  # the same code, compiled again


def test_capture_graphs_load_from_the_caches_and_write_the_same_records(tmp_path):
    """A graph with capture taps holds effectful ops (``with_effects``), which torch leaves out of its caches
    unless marked (``cache_key.effects_cacheable``); marked, a second compile loads both graphs, and its run
    writes the same records (values bit for bit) as the first."""
    base = make_llama(**CFG)
    stores, counts = [], []
    for run in range(2):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        tokens = make_tokens(model.cfg, seed=3)
        before = _cache_counts()
        compiled = fxquant.compile(model, "linear_mxfp8", capture="linear_io")
        with capture.start(capture.load_spec("linear_io"), tmp_path / str(run), scheme="linear_mxfp8"):
            next_token_loss(compiled(tokens), tokens).backward()
        counts.append({k: v - before[k] for k, v in _cache_counts().items()})
        stores.append(capture.open(tmp_path / str(run)))
    assert counts[0]["fx_bypass"] == counts[0]["aot_bypass"] == 0, counts[0]
    assert (counts[1]["fx_hit"], counts[1]["aot_hit"]) == (2, 1), counts[1]
    first, second = stores

    def key(r) -> tuple:
        return tuple(str(r.fields.get(f)) for f in ("module", "role", "iteration", "copy", "gemm", "qspec"))

    records = [sorted(s, key=key) for s in stores]
    assert len(records[0]) == len(records[1]) > 0
    assert {r.fields.get("role") for r in records[0]} == {"input", "grad_output"}  # forward and backward taps
    for a, b in zip(*records):
        assert key(a) == key(b)
        torch.testing.assert_close(first.load(a), second.load(b), rtol=0, atol=0)


def test_effects_stay_uncached_beside_a_higher_order_op_or_a_script_object():
    """``effects_cacheable`` keeps torch's default where the graph calls a higher-order op other than those with
    traced bodies (one may run Python the key does not hash) or holds a script object; a graph of plain calls,
    or with a custom autograd.Function traced by Dynamo (Megatron's tensor-parallel mappings), is cacheable."""
    def f(x):
        return torch.sin(x) + 1

    gm = torch.fx.symbolic_trace(f)
    assert cache_key.effects_cacheable(gm)
    marked = cache_key.inductor_config_patches("scheme", gm)["unsafe_marked_cacheable_functions"]
    assert cache_key.WITH_EFFECTS in marked

    def with_hop(op) -> torch.fx.GraphModule:
        g = torch.fx.symbolic_trace(f)
        x = next(n for n in g.graph.nodes if n.op == "placeholder")
        with g.graph.inserting_after(x):
            g.graph.call_function(op, (x,))  # the check reads targets only: the node is never run
        return g

    assert cache_key.effects_cacheable(with_hop(torch.ops.higher_order.autograd_function_apply))  # traced bodies
    hop = with_hop(torch.ops.higher_order.with_effects)
    assert not cache_key.effects_cacheable(hop)
    assert cache_key.WITH_EFFECTS not in cache_key.inductor_config_patches("scheme", hop)["unsafe_marked_cacheable_functions"]

    scripted = torch.fx.symbolic_trace(f)
    scripted.obj = torch.jit.script(torch.nn.Identity())._c  # a torch.ScriptObject, as a torchbind object is
    with scripted.graph.inserting_before(next(iter(scripted.graph.nodes))):
        scripted.graph.get_attr("obj")
    assert not cache_key.effects_cacheable(scripted)


@pytest.mark.parametrize("kernels", [Kernels.INDUCTOR, Kernels.TRITON, Kernels.REFERENCE])
def test_decomposition_table_pickles_as_its_construction(kernels):
    table = lowering.decomposition_table(kernels)
    blob = pickle.dumps(table)  # what the caches hash (nothing here is unpickled)
    assert len(blob) < 500 and b"decomposition_table" in blob  # the call, not a few thousand entries
    build, args = table.__reduce__()
    assert (build, args) == (lowering.decomposition_table, (kernels.value,))
    again = build(*args)
    assert again == table and again.kernels is kernels
    op = torch.ops.fxquant.quantize.default
    assert (op in table) is (kernels is not Kernels.TRITON)


def test_fxquant_functions_of_a_rewritten_graph_are_marked_with_the_key():
    from torch._inductor import config

    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    assert cache_key.fxquant_targets(gm) == []
    from fxquant.passes.wrappers import fxquant_linear

    node = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(node):
        gm.graph.call_function(fxquant_linear, (node, node, None, (None,) * 6))
    assert cache_key.fxquant_targets(gm) == ["fxquant.passes.wrappers.fxquant_linear"]
    patches = cache_key.inductor_config_patches("scheme text", gm)
    uuid = patches["post_grad_custom_post_pass"].uuid()
    assert patches["unsafe_marked_cacheable_functions"] == {
        **config.unsafe_marked_cacheable_functions, "fxquant.passes.wrappers.fxquant_linear": uuid,
        cache_key.WITH_EFFECTS: uuid}
    assert cache_key.inductor_config_patches("other scheme", gm)["post_grad_custom_post_pass"].uuid() != uuid
