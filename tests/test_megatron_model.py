"""Megatron GPTModel on CPU (ARCHITECTURE.md trap 10): both core attentions run, agree, and compile as one graph."""
from __future__ import annotations

import sys

import pytest
import torch

pytestmark = pytest.mark.megatron

megatron_glue = pytest.importorskip("fxquant.megatron_glue.model", reason="needs megatron-core")


@pytest.fixture(scope="module")
def single_process():
    from fxquant.megatron_glue import parallel

    info = parallel.initialize_parallel()
    yield info


def _batch(seq: int = 16, batch: int = 2, vocab: int = 256):
    from fxquant.megatron_glue.model import causal_attention_mask, position_ids

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return ids, position_ids(batch, seq), causal_attention_mask(seq)


def _build(attention: str, **changes):
    from fxquant.megatron_glue.config import tiny_llama_config
    from fxquant.megatron_glue.model import build_gpt_model

    return build_gpt_model(tiny_llama_config(**changes), attention=attention, seed=7)


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_forward_backward_on_cpu(single_process, attention):
    model = _build(attention)
    ids, pos, mask = _batch()
    loss = model(ids, pos, mask, labels=ids)
    assert loss.shape == ids.shape and torch.isfinite(loss).all()
    # An untrained model predicts ~uniformly over the 256-entry vocabulary.
    assert abs(loss.mean().item() - torch.log(torch.tensor(256.0)).item()) < 0.2
    loss.mean().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_sdpa_and_local_attention_agree(single_process):
    ids, pos, mask = _batch()
    sdpa = _build("sdpa")(ids, pos, mask, labels=ids)
    local = _build("local")(ids, pos, mask, labels=ids)
    torch.testing.assert_close(sdpa, local, rtol=1e-5, atol=1e-5)


def test_weights_do_not_depend_on_the_seed_order(single_process):
    a, b = _build("sdpa"), _build("local")
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_tied_embeddings_share_the_weight(single_process):
    model = _build("sdpa", tie_embeddings=True)
    assert model.output_layer.weight is None
    ids, pos, mask = _batch()
    assert torch.isfinite(model(ids, pos, mask, labels=ids)).all()


def _count_graphs(model, *args, **kwargs):
    import torch._dynamo

    torch._dynamo.reset()
    return torch._dynamo.explain(model)(*args, **kwargs)


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_compiles_as_one_graph(single_process, attention):
    from fxquant.megatron_glue.graph_breaks import quiet_tp_group_lookup

    model = _build(attention)
    ids, pos, mask = _batch()
    with quiet_tp_group_lookup():
        explained = _count_graphs(model, ids, pos, mask, labels=ids)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_a_second_call_compiles_nothing(single_process):
    """Megatron's unfused attention takes its baddbmm output from the global memory buffer. Traced, the buffer
    must not be filled as a side effect: Dynamo would guard on the dict's contents and the second call, finding
    the entry, would recompile the whole model (the shipped main job uses this attention)."""
    from megatron.core import parallel_state

    from fxquant.megatron_glue.graph_breaks import quiet_tp_group_lookup

    parallel_state._GLOBAL_MEMORY_BUFFER.buffer.clear()  # as in a fresh process
    model = _build("local")
    ids, pos, mask = _batch()
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    with quiet_tp_group_lookup():
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        compiled(ids, pos, mask, labels=ids).mean().backward()
        assert counters["stats"]["unique_graphs"] == 1, dict(counters)
        compiled(ids, pos, mask, labels=ids).mean().backward()
    assert counters["stats"]["unique_graphs"] == 1, "the second call recompiled"
    assert parallel_state._GLOBAL_MEMORY_BUFFER.buffer == {}


def test_without_the_patch_megatron_breaks_the_graph(single_process):
    """The control for the test above: the warnings.warn in Megatron's TP-group lookup does break graphs."""
    model = _build("sdpa")
    ids, pos, mask = _batch()
    explained = _count_graphs(model, ids, pos, mask, labels=ids)
    assert explained.graph_break_count > 0
    assert any("warn" in str(b.reason) for b in explained.break_reasons)


def test_compiled_equals_eager_with_gradients(single_process):
    from fxquant.megatron_glue.graph_breaks import quiet_tp_group_lookup

    ids, pos, mask = _batch()
    eager, compiled_model = _build("local"), _build("local")
    ref = eager(ids, pos, mask, labels=ids)
    ref.mean().backward()
    torch._dynamo.reset()
    with quiet_tp_group_lookup():
        compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
        out = compiled(ids, pos, mask, labels=ids)
        out.mean().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_quiet_tp_group_lookup_is_scoped_and_reentrant(single_process):
    from megatron.core import utils as megatron_utils
    from megatron.core.tensor_parallel import layers, mappings

    from fxquant.megatron_glue import graph_breaks

    original = megatron_utils.get_tensor_model_parallel_group_if_none
    linear_fn = layers.LinearWithGradAccumulationAndAsyncCommunication
    warned = layers.linear_with_grad_accumulation_and_async_allreduce.warned
    with graph_breaks.quiet_tp_group_lookup():
        patched = mappings.get_tensor_model_parallel_group_if_none
        assert patched is not original and graph_breaks.is_quiet()
        # TP > 1: the linear's async dgrad all-reduce is done synchronously by a subclass of Megatron's Function
        assert layers.LinearWithGradAccumulationAndAsyncCommunication is graph_breaks.SyncDgradLinear
        assert issubclass(graph_breaks.SyncDgradLinear, linear_fn)
        assert layers.linear_with_grad_accumulation_and_async_allreduce.warned is True
        with graph_breaks.quiet_tp_group_lookup():
            assert mappings.get_tensor_model_parallel_group_if_none is patched
        assert mappings.get_tensor_model_parallel_group_if_none is patched
        # Same answer as Megatron's function, without the warning.
        assert patched(None) is original(None)
    assert mappings.get_tensor_model_parallel_group_if_none is original
    assert megatron_utils.get_tensor_model_parallel_group_if_none is original
    assert layers.LinearWithGradAccumulationAndAsyncCommunication is linear_fn
    assert layers.linear_with_grad_accumulation_and_async_allreduce.warned is warned
    assert not graph_breaks.is_quiet()
    assert all(getattr(m, "get_tensor_model_parallel_group_if_none", original) is not graph_breaks._tp_group_if_none
               for m in list(sys.modules.values()) if m is not None)


def test_parallel_layout_rejects_bad_sizes():
    from fxquant.megatron_glue.config import tiny_llama_config
    from fxquant.megatron_glue.parallel import ParallelLayout

    with pytest.raises(ValueError, match="tp"):
        ParallelLayout(tp=0)
    with pytest.raises(ValueError, match="not divisible"):
        ParallelLayout(tp=2).data_parallel_size(3)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        tiny_llama_config().check_parallel(tp=3, pp=1)
    with pytest.raises(ValueError, match="num_layers=2"):
        tiny_llama_config().check_parallel(tp=1, pp=4)
