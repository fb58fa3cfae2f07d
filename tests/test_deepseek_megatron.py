"""Tiny DeepSeek-V2-Lite (MLA + MoE) on Megatron-core, on CPU: structure, host swaps, training, fxquant.compile.

See host_moe_mla.py for what is swapped and why (docs/megatron.md, "DeepSeek-V2 on CPU").
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core", reason="needs megatron-core")

from tests.test_train_megatron import wiki_data  # noqa: E402,F401  (module fixture: WikiText-2 indexed dataset)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def single_process():
    from fxquant.megatron_glue import parallel

    return parallel.initialize_parallel()


def _tiny():
    from experiments.catalog import TINY

    return TINY["deepseek2_lite"]


def _build(attention="sdpa"):
    from fxquant.megatron_glue.model import build_gpt_model

    return build_gpt_model(_tiny(), attention=attention, seed=3)


def _batch(seq=32, batch=2):
    from fxquant.megatron_glue.model import causal_attention_mask, position_ids

    ids = torch.randint(0, 257, (batch, seq), generator=torch.Generator().manual_seed(0))
    return ids, position_ids(batch, seq), causal_attention_mask(seq)


def test_tiny_keeps_the_published_structure():
    from experiments.catalog import MODELS
    from fxquant.megatron_glue.config import LoadBalancing, RopeScaling

    full, tiny = MODELS["deepseek2_lite"], _tiny()
    for cfg in (full, tiny):
        m, e = cfg.mla, cfg.moe
        assert cfg.rope_scaling is RopeScaling.YARN and m.q_lora_rank is None
        assert m.qk_head_dim == 2 * m.qk_pos_emb_head_dim and m.v_head_dim == m.qk_head_dim  # 128 + 64, v 128
        heads_kv = cfg.num_attention_heads * (m.qk_head_dim + m.v_head_dim)
        assert m.kv_lora_rank < cfg.hidden_size and m.kv_lora_rank < heads_kv  # a compressed kv latent
        assert e.first_k_dense == 1 and e.top_k < e.num_experts
        assert e.shared_expert_ffn_hidden_size == 2 * e.expert_ffn_hidden_size            # 2 shared experts
        assert e.load_balancing is LoadBalancing.SEQ_AUX_LOSS
        assert cfg.ffn_hidden_size > e.expert_ffn_hidden_size * e.top_k
        gemm_dims = (cfg.hidden_size, cfg.ffn_hidden_size, m.kv_lora_rank, m.qk_head_dim + m.qk_pos_emb_head_dim,
                     m.v_head_dim, e.expert_ffn_hidden_size)
        assert all(d % 32 == 0 for d in gemm_dims)  # one MX block divides every reduction dim
    assert tiny.num_parameters() < 1e6 < full.num_parameters()


def test_model_is_built_with_host_modules_and_scoped_rebinding(single_process):
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from fxquant.megatron_glue.host_moe_mla import HostMLASelfAttention, HostYarnRotaryEmbedding, LocalTopKRouter

    have_te = multi_latent_attention.HAVE_TE
    model = _build()
    dense, moe = model.decoder.layers
    assert type(dense.mlp) is MLP and dense.mlp.linear_fc2.weight.shape == (64, 256)
    assert isinstance(moe.mlp, MoELayer) and isinstance(moe.mlp.router, LocalTopKRouter)
    assert len(moe.mlp.experts.local_experts) == 8 and moe.mlp.router.topk == 2
    assert moe.mlp.shared_experts.linear_fc2.weight.shape == (64, 64)
    assert isinstance(moe.mlp.token_dispatcher, MoEAllGatherTokenDispatcher)
    for layer in (dense, moe):
        attn = layer.self_attention
        assert type(attn) is HostMLASelfAttention and type(attn.rotary_pos_emb) is HostYarnRotaryEmbedding
        assert attn.linear_kv_down_proj.weight.shape == (32 + 32, 64)   # kv_lora_rank + rope dim
        assert attn.linear_kv_up_proj.weight.shape == (4 * (64 + 64), 32)  # heads x (k nope + v)
        assert attn.linear_q_proj.weight.shape == (4 * 96, 64)
        assert type(attn.kv_layernorm).__name__ == "RMSNorm"
        assert all(p.device.type == "cpu" for p in layer.parameters())
    # Megatron built exactly the parameters the config accounts for (+ the vocabulary padding 257 -> 384).
    built = sum(p.numel() for p in model.parameters())
    assert built == _tiny().num_parameters() + (384 - 257) * 64 * 2
    # The rebinding lasted only while the attention modules were built.
    assert multi_latent_attention.YarnRotaryEmbedding is YarnRotaryEmbedding
    assert multi_latent_attention.HAVE_TE is have_te


def test_host_yarn_matches_the_deepseek_formula(single_process):
    from fxquant.megatron_glue.host_moe_mla import HostYarnRotaryEmbedding

    dim, base, factor, orig, fast, slow = 32, 10000.0, 40.0, 64, 32.0, 1.0
    rope = HostYarnRotaryEmbedding(dim, rotary_base=base, scaling_factor=factor, original_max_position_embeddings=orig,
                                   beta_fast=fast, beta_slow=slow, mscale=1.0, mscale_all_dim=0.0)
    emb, mscale = rope(100)

    # DeepSeek-V2's modeling code (DeepseekV2YarnRotaryEmbedding), written out independently.
    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(fast)), 0), min(math.ceil(corr(slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = extra / factor * ramp + extra * (1 - ramp)
    freqs = torch.outer(torch.arange(100, dtype=torch.float32), inv_freq)
    torch.testing.assert_close(emb[:, 0, 0, :], torch.cat([freqs, freqs], -1), rtol=1e-6, atol=1e-6)
    assert mscale == pytest.approx(0.1 * math.log(factor) + 1.0)  # mscale_all_dim = 0: attention factor only
    assert emb.device.type == "cpu" and rope.inv_freq_extra.device.type == "cpu"


def test_forward_backward_on_cpu_and_attentions_agree(single_process):
    ids, pos, mask = _batch()
    sdpa, local = _build("sdpa"), _build("local")
    loss = sdpa(ids, pos, mask, labels=ids)
    padded_vocab = sdpa.output_layer.weight.shape[0]  # 384: an untrained model predicts ~uniformly over it
    assert loss.shape == ids.shape and abs(loss.mean().item() - math.log(padded_vocab)) < 0.2
    torch.testing.assert_close(local(ids, pos, mask, labels=ids), loss, rtol=1e-5, atol=1e-5)
    loss.mean().backward()
    grads = dict(sdpa.named_parameters())
    for name in ("decoder.layers.1.mlp.router.weight", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
                 "decoder.layers.0.self_attention.linear_kv_down_proj.weight",
                 "decoder.layers.1.self_attention.kv_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.weight"):
        grad = grads[name].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    routed = [grads[f"decoder.layers.1.mlp.experts.local_experts.{i}.linear_fc1.weight"].grad for i in range(8)]
    assert sum(g is not None and g.abs().sum() > 0 for g in routed) >= 2  # top-2 of 8: tokens reach experts


def test_a_per_layer_scheme_holds_in_every_step_with_exact_counts(single_process):
    """Layer 1's MoE breaks the graph, so Dynamo compiles each TransformerLayer's call as a frame of its own; the
    graph compiled for one layer must not run for the other (fxquant.passes.instances). Layer 0 alone is selected:
    the same loss in every step (no optimizer), and the runtime counters exact in steady steps, MLA's q_proj and
    kv_down_proj sharing their input's quantizations (fprop and wgrad) as AOT autograd's CSE does. Step 2 still
    compiles (Megatron's MoE logging tracker fills after step 1, a guard of the router's frame; layer 0 compiles
    again in its ``forward``, docs/compile.md), so steps 3 and 4 are the steady ones."""
    import fxquant
    from fxquant import schemes
    from fxquant.api import compile_state
    from fxquant.counters import count_quantize_calls
    from fxquant.megatron_glue.graph_breaks import quiet_tp_group_lookup

    scheme = schemes.Scheme.from_yaml_text("""
name: layer0
rules:
  - match: {layers: [0]}
    linear: mxfp8
    attention: {qk: mxfp8}
""")
    ids, pos, mask = _batch()
    compiled = fxquant.compile(_build(), scheme, backend="aot_eager", strict=True)
    losses, counts = [], []
    with quiet_tp_group_lookup():
        for _ in range(4):
            with count_quantize_calls(compiled) as count:
                loss = compiled(ids, pos, mask, labels=ids).mean()
                loss.backward()
            losses.append(loss.item())
            counts.append(count)
    assert losses == [losses[0]] * 4
    # 6 linears x (2 forward + 4 backward) + QK^T (2 forward), less X's fprop and wgrad quantizes shared
    assert all(c.ok and not c.compiled and c.executed == c.expected == 36 for c in counts[2:])
    sites = {s.site.module_path: s.status.value for s in compile_state(compiled).sites()}
    for module in ("linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj", "core_attention"):
        assert sites[f"decoder.layers.0.self_attention.{module}"] == "rewritten"
        assert sites[f"decoder.layers.1.self_attention.{module}"] == "high"


def _run(tmp_path, name, data, **changes):
    from fxquant.megatron_glue.run_config import CompileBackend, OptimConfig, RunConfig, TrainConfig

    opts = dict(seq_length=32, micro_batch_size=2, global_batch_size=4, train_iters=10,
                optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=1))
    scheme, backend = changes.pop("scheme", "bf16"), changes.pop("backend", "none")
    opts.update(changes)
    return RunConfig(model=_tiny(), train=TrainConfig(**opts), data=data, output_dir=str(tmp_path / name),
                     scheme=scheme, backend=CompileBackend(backend))


def test_trains_on_wikitext_with_aux_loss_and_validation(tmp_path, wiki_data):  # noqa: F811
    from fxquant.megatron_glue.train import train

    result = train(_run(tmp_path, "bf16", wiki_data, eval_interval=5, eval_iters=2))
    losses = [r["loss"] for r in result.records]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.4
    aux = [r["seq_load_balancing_loss"] for r in result.records]
    assert all(0.5 < a < 4.0 for a in aux)  # ~1 when balanced; top-2 of 8 can at most reach 4
    val = {r["iteration"]: r["val_loss"] for r in result.records if "val_loss" in r}
    assert sorted(val) == [5, 10] and val[10] < val[5] < math.log(384)


@pytest.mark.slow
def test_mx_scheme_trains_through_fxquant_compile(tmp_path, wiki_data):  # noqa: F811
    from fxquant.megatron_glue.train import SITES_FILE, train

    result = train(_run(tmp_path, "mx", wiki_data, scheme="FA_linear_mxfp8", backend="aot_eager", train_iters=3))
    losses = [r["loss"] for r in result.records]
    assert all(math.isfinite(l) for l in losses) and losses[-1] < losses[0]
    sites = {s["module_path"]: s for s in result.sites}
    assert json.loads((result.run_dir / SITES_FILE).read_text())["scheme"] == "FA_linear_mxfp8"
    # Every GEMM of MLA and MoE is matched and quantized: routed and shared experts, MLA projections,
    # core attention (SDPA); the LM head and the router (it decides routing) stay in high precision.
    expected = [f"decoder.layers.1.mlp.experts.local_experts.{i}.linear_fc{j}" for i in range(8) for j in (1, 2)]
    expected += [f"decoder.layers.1.mlp.shared_experts.linear_fc{j}" for j in (1, 2)]
    expected += [f"decoder.layers.{l}.self_attention.{m}" for l in (0, 1) for m in
                 ("linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj", "core_attention")]
    expected += ["decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc2"]
    assert all(sites[p]["status"] == "rewritten" for p in expected), {p: sites.get(p) for p in expected}
    assert sites["output_layer"]["status"] == "high"
    assert sites["decoder.layers.1.mlp.router"]["status"] == "high"


@pytest.mark.dist
def test_experiments_run_tiny_deepseek_pp2_matches_one_process(tmp_path, wiki_data):  # noqa: F811
    from dataclasses import replace

    from fxquant.megatron_glue.run_config import ParallelLayout, RunConfig
    from fxquant.megatron_glue.train import train

    prefix = wiki_data.prefixes[0]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "experiments", "run", "--model", "deepseek2_lite", "--variant", "tiny",
           "--dataset", "wikipedia", "--data-prefix", prefix, "--scheme", "bf16", "--backend", "none",
           "--iters", "3", "--eval-interval", "3", "--eval-iters", "1", "--nproc", "2", "--pp", "2",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "seq_load_balancing" in proc.stdout and "val loss" in proc.stdout
    summary = json.loads(proc.stdout.split("FXQUANT_RESULT ", 1)[1].splitlines()[0])
    assert summary["iterations"] == 3 and math.isfinite(summary["final_val_loss"])
    run_dir = tmp_path / "deepseek2_lite-tiny" / "wikipedia" / "bf16"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3] and "val_loss" in records[-1]
    # Stage 0 holds the dense layer, stage 1 the MoE layer: the same run in one process agrees.
    launched = RunConfig.from_dict(json.loads((run_dir / "launch.json").read_text()))
    one = train(replace(launched, layout=ParallelLayout(), output_dir=str(tmp_path / "one")))
    for key in ("loss", "seq_load_balancing_loss", "grad_norm"):
        assert [r[key] for r in records] == pytest.approx([r[key] for r in one.records], rel=1e-4), key
    assert records[-1]["val_loss"] == pytest.approx(one.records[-1]["val_loss"], rel=1e-4)


def test_tensor_and_expert_parallel_mla_moe_are_refused_off_cuda():
    from fxquant.megatron_glue.config import tiny_llama_config
    from fxquant.megatron_glue.host_moe_mla import check_host_layout

    with pytest.raises(ValueError, match=r"\(MLA \+ MoE\) with tp=2, ep=1 cannot run on cpu"):
        check_host_layout(_tiny(), tp=2, ep=1, device="cpu")
    with pytest.raises(ValueError, match="tp=1, ep=2"):
        check_host_layout(_tiny(), tp=1, ep=2, device="cpu")
    check_host_layout(_tiny(), tp=1, ep=1, device="cpu")
    check_host_layout(_tiny(), tp=2, ep=2, device="cuda")
    check_host_layout(tiny_llama_config(), tp=2, ep=1, device="cpu")  # plain attention + dense MLP: fine
