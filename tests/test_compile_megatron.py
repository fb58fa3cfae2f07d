"""fxquant.compile on Megatron-core GPTModel on CPU (TP=1): SDPA core attention and Megatron's unfused local
attention; the compiled (aot_eager) run equals the eager run of the rewritten graph bit for bit, every
linear is quantized inside its autograd_function_apply bodies, and the runtime counters agree."""
from __future__ import annotations

import pytest
import torch

import fxquant
from fxquant.counters import count_quantize_calls

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core", reason="needs megatron-core")
from tests.megatron_helpers import single_process  # noqa: E402,F401  (fixture)


def megatron_batch(seq: int = 16, batch: int = 2, vocab: int = 256, seed: int = 0):
    from fxquant.megatron_glue.model import causal_attention_mask, position_ids

    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return ids, position_ids(batch, seq), causal_attention_mask(seq)


def megatron_step(attention: str, scheme: str, backend: str, steps: int = 1, **changes):
    """(loss, grads by name, compiled model) after ``steps`` forward+backward steps on the same batch."""
    from fxquant.megatron_glue.config import tiny_llama_config
    from fxquant.megatron_glue.graph_breaks import quiet_tp_group_lookup
    from fxquant.megatron_glue.model import build_gpt_model

    model = build_gpt_model(tiny_llama_config(**changes), attention=attention, seed=7)
    compiled = fxquant.compile(model, scheme, backend=backend, strict=True)
    ids, pos, mask = megatron_batch()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with quiet_tp_group_lookup():
            loss = compiled(ids, pos, mask, labels=ids).mean()
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, compiled


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_megatron_aot_eager_equals_eager_reference_bitwise(single_process, attention):
    ref_loss, ref_grads, _ = megatron_step(attention, "FA_linear_mxfp8", "eager")
    torch._dynamo.reset()
    loss, grads, compiled = megatron_step(attention, "FA_linear_mxfp8", "aot_eager")
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    sites = fxquant.compile_state(compiled).sites()
    ops = {s.op.value for s in sites if s.selected}
    assert "megatron_linear" in ops and ({"sdpa"} if attention == "sdpa" else {"unfused_qk"}) <= ops
    assert all(s.status.value == "rewritten" for s in sites if s.selected and s.op.value != "unfused_pv")
    lm_head = [s for s in sites if s.site.module_path == "output_layer"]
    assert lm_head and not lm_head[0].selected  # the LM head stays in high precision unless selected
    plain_loss, _, _ = megatron_step(attention, "bf16", "aot_eager")
    assert not torch.equal(plain_loss, loss)


def test_megatron_linear_bodies_hold_the_quantize_nodes(single_process):
    """Each Column/RowParallelLinear keeps its autograd_function_apply; fprop's two operands are quantized in
    fwd_body, dgrad's and wgrad's four in bwd_body (linear_mxfp8: every operand)."""
    from fxquant.passes.sites import META_KEY, body_modules

    _, _, compiled = megatron_step("sdpa", "linear_mxfp8", "eager")
    state = fxquant.compile_state(compiled)
    (rep,) = state.backend.reports
    linear_sites = [s for s in rep.sites if s.op.value == "megatron_linear" and s.selected]
    assert len(linear_sites) == 8 and all(s.quantize_calls == (2, 4) for s in linear_sites)
    quantize = torch.ops.fxquant.quantize.default
    for s in linear_sites:
        node = next(n for n in rep.graph_module.graph.nodes if n.name == s.node_name)
        fwd, bwd = body_modules(rep.graph_module, node)
        assert [n.args[2] for n in fwd.graph.nodes if n.target is quantize] == [-1, -2]
        assert sorted(n.args[2] for n in bwd.graph.nodes if n.target is quantize) == [-2, -2, -1, -1]
        assert node.meta[META_KEY].status.value == "rewritten"
    assert rep.expected_calls == (16, 32)
    with count_quantize_calls(compiled) as count:
        megatron_step_again(compiled)
    assert count.executed == 16 + 32 and count.ok


def megatron_step_again(compiled):
    from fxquant.megatron_glue.graph_breaks import quiet_tp_group_lookup

    ids, pos, mask = megatron_batch()
    with quiet_tp_group_lookup():
        compiled(ids, pos, mask, labels=ids).mean().backward()


def test_megatron_local_attention_counts_match(single_process):
    _, _, compiled = megatron_step("local", "FA_QKPV_hifp8", "aot_eager")
    with count_quantize_calls(compiled) as count:
        megatron_step_again(compiled)
    assert (count.expected_forward, count.expected_backward) == (2 * 4, 2 * 8)  # QK and PV: 4 fwd, 8 bwd per layer
    assert count.ok


def test_megatron_linears_refuse_block_2d_on_their_3d_activations_naming_the_site(single_process):
    """Megatron's linears quantize their [S, B, H] input (fprop) and its gradient (dgrad) as they come: NVFP4's 2-D
    tiles there are refused at compile time naming the site (the first call failed with the format's message); on
    the weights they run."""
    from fxquant.schemes import Scheme

    for yaml, names in (("{format: nvfp4, block_2d: true}", "fprop.x and dgrad.dy have"),
                        ("{format: nvfp4, dgrad: {block_2d: true}}", "dgrad.dy has")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=rf"site 'decoder.layers.0.self_attention.linear_qkv' \(a Megatron "
                                            rf"linear\): {names} block_2d"):
            megatron_step("sdpa", Scheme.from_yaml_text(f"rules:\n  - linear: {yaml}\n"), "aot_eager")
    torch._dynamo.reset()
    weights = Scheme.from_yaml_text("rules:\n  - linear: {format: nvfp4, fprop: {w: {block_2d: true}}, dgrad: {w: "
                                    "{block_2d: true}}}\n")
    loss, _, _ = megatron_step("sdpa", weights, "aot_eager")
    assert torch.isfinite(loss)
