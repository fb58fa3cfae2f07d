"""The catalogue: published model architectures (+ `tiny` variants), training configs, datasets, schemes.

Architectures follow the published configurations (HuggingFace config.json of each model):
- Llama 3.1 8B: 32 layers, hidden 4096, FFN 14336, 32 heads, 8 KV groups, RoPE base 500000 with Llama-3
  scaling (factor 8), RMSNorm eps 1e-5, SwiGLU, vocab 128256, untied embeddings.
- Llama 3.2 1B: 16 layers, hidden 2048, FFN 8192, 32 heads, 8 KV groups, head dim 64, RoPE 500000
  (Llama-3 scaling factor 32), RMSNorm eps 1e-5, SwiGLU, vocab 128256, tied embeddings.
- DeepSeek-V2-Lite: 27 layers, hidden 2048, MLA (kv_lora_rank 512, no q compression, 16 heads, q/k nope
  128 + rope 64, v 128, YaRN factor 40 over 4096), MoE with 64 routed experts top-6 + 2 shared, expert
  FFN 1408, first layer dense with FFN 10944, RMSNorm eps 1e-6, vocab 102400, untied.
Training configs `standard` and `fast` are the predecessor's (PREDECESSOR.md); `cpu` fits 2 CPU cores.
Datasets `wikipedia` and `dolma` each read their own indexed-dataset prefix (`--data-prefix NAME=PREFIX`,
`$FXQUANT_<NAME>_PREFIX`, or the default below), labelled with their name (`dataset_label.py`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from fxquant.megatron_glue.config import LoadBalancing, MLAConfig, ModelConfig, MoEConfig, RopeScaling
from fxquant.megatron_glue.run_config import OptimConfig, TrainConfig

MODELS: dict[str, ModelConfig] = {
    "llama31-8b": ModelConfig(
        name="llama31-8b", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        num_query_groups=8, vocab_size=128256, max_position_embeddings=131072, rotary_base=500000.0,
        rope_scaling=RopeScaling.LLAMA3, rope_scaling_factor=8.0, norm_epsilon=1e-5, tie_embeddings=False),
    "llama32-1b": ModelConfig(
        name="llama32-1b", num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
        num_query_groups=8, kv_channels=64, vocab_size=128256, max_position_embeddings=131072,
        rotary_base=500000.0, rope_scaling=RopeScaling.LLAMA3, rope_scaling_factor=32.0, norm_epsilon=1e-5,
        tie_embeddings=True),
    "deepseek2_lite": ModelConfig(
        name="deepseek2_lite", num_layers=27, hidden_size=2048, ffn_hidden_size=10944, num_attention_heads=16,
        vocab_size=102400, max_position_embeddings=163840, rotary_base=10000.0, rope_scaling=RopeScaling.YARN,
        norm_epsilon=1e-6, tie_embeddings=False,
        mla=MLAConfig(kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, q_lora_rank=None,
                      rope_scaling_factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                      beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
        moe=MoEConfig(num_experts=64, top_k=6, expert_ffn_hidden_size=1408, shared_expert_ffn_hidden_size=2 * 1408,
                      first_k_dense=1, aux_loss_coeff=0.001, load_balancing=LoadBalancing.SEQ_AUX_LOSS)),
}

BYTE_VOCAB = 257  # fxquant's built-in byte tokenizer

# Same structure as the published model, shrunk to train on 2 CPU cores in a minute or two.
TINY: dict[str, ModelConfig] = {
    "llama31-8b": MODELS["llama31-8b"].with_(
        name="llama31-8b-tiny", num_layers=2, hidden_size=64, ffn_hidden_size=224, num_attention_heads=4,
        num_query_groups=2, vocab_size=BYTE_VOCAB, max_position_embeddings=1024),
    "llama32-1b": MODELS["llama32-1b"].with_(
        name="llama32-1b-tiny", num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
        num_query_groups=2, kv_channels=16, vocab_size=BYTE_VOCAB, max_position_embeddings=1024),
    # MLA (kv latent smaller than hidden and than heads x (k nope + v); q/k nope:rope = 2:1; v = nope; YaRN),
    # MoE (routed top-k + 2 shared experts, sequence aux loss) after one dense layer. Every GEMM reduction
    # dim is a multiple of 32 (one MX block), as in the full model.
    "deepseek2_lite": MODELS["deepseek2_lite"].with_(
        name="deepseek2_lite-tiny", num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
        vocab_size=BYTE_VOCAB, max_position_embeddings=1024,
        mla=replace(MODELS["deepseek2_lite"].mla, kv_lora_rank=32, qk_head_dim=64, qk_pos_emb_head_dim=32,
                    v_head_dim=64, original_max_position_embeddings=64),
        moe=replace(MODELS["deepseek2_lite"].moe, num_experts=8, top_k=2, expert_ffn_hidden_size=32,
                    shared_expert_ffn_hidden_size=2 * 32)),
}

CONFIGS: dict[str, TrainConfig] = {
    # The predecessor's: MBS 1, GBS 128, seq 8192, lr 1.5e-4.
    "standard": TrainConfig(seq_length=8192, micro_batch_size=1, global_batch_size=128, train_iters=1000,
                            optim=OptimConfig(lr=1.5e-4, min_lr=1.5e-5, warmup_iters=100), save_interval=500),
    # The predecessor's: GBS 32, seq 2048, 1000 samples (31 whole iterations of 32), lr 1e-4.
    "fast": TrainConfig(seq_length=2048, micro_batch_size=1, global_batch_size=32, train_iters=1000 // 32,
                        optim=OptimConfig(lr=1e-4, min_lr=1e-5, warmup_iters=3)),
    "cpu": TrainConfig(seq_length=64, micro_batch_size=2, global_batch_size=8, train_iters=40,
                       optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=4), eval_interval=10, eval_iters=2),
}


@dataclass(frozen=True)
class Dataset:
    name: str
    env: str | None              # environment variable naming the indexed-dataset prefix
    default_prefix: str | None   # used when the variable is unset


DATASETS: dict[str, Dataset] = {
    "wikipedia": Dataset("wikipedia", "FXQUANT_WIKIPEDIA_PREFIX", "data/wikipedia/wikipedia_text_document"),
    "dolma": Dataset("dolma", "FXQUANT_DOLMA_PREFIX", "data/dolma/dolma_text_document"),
    "mock": Dataset("mock", None, None),
}

# The predecessor's ten schemes (PREDECESSOR.md); each is a preset of fxquant.schemes.
PREDECESSOR_SCHEMES: tuple[str, ...] = (
    "bf16", "FA_mxfp8", "FA_mxfp4", "FA_hifp8", "linear_mxfp8", "linear_mxfp4", "linear_hifp8",
    "FA_linear_mxfp8", "FA_linear_mxfp4", "FA_linear_hifp8",
)


def scheme_names() -> list[str]:
    from fxquant import schemes

    return schemes.names()


def dataset_prefix(name: str, override: str | None = None) -> str | None:
    ds = DATASETS[name]
    if ds.env is None:
        return None
    return override or os.environ.get(ds.env) or ds.default_prefix


def data_prefixes(values: list[str] | None, datasets: list[str]) -> dict[str, str]:
    """`--data-prefix` values (`DATASET=PREFIX`, or one bare `PREFIX` when a single indexed dataset is named)
    -> {dataset: prefix}. Each prefix belongs to one dataset: naming a dataset twice, a dataset not among
    `datasets`, `mock`, or one prefix for two datasets is refused."""
    indexed = [d for d in dict.fromkeys(datasets) if d in DATASETS and DATASETS[d].env is not None]
    out: dict[str, str] = {}
    for value in values or []:
        name, sep, prefix = value.partition("=")
        if not sep or "/" in name:  # a bare prefix (a path may contain '=' after a '/')
            if len(indexed) != 1:
                where = f"datasets {', '.join(indexed)}" if indexed else f"dataset(s) {', '.join(datasets)}"
                raise ValueError(f"--data-prefix {value!r}: a bare prefix needs exactly one indexed dataset, the run "
                                 f"has {where}; name each: --data-prefix wikipedia=PREFIX dolma=PREFIX")
            name, prefix = indexed[0], value
        elif name not in DATASETS or DATASETS[name].env is None:
            from fxquant.formats.options import did_you_mean

            choices = [n for n, d in DATASETS.items() if d.env is not None]
            raise ValueError(f"--data-prefix {value!r}: {name!r} is not an indexed dataset"
                             f"{did_you_mean(name, choices)}; allowed: {', '.join(choices)} (mock reads no files)")
        if name not in indexed:
            raise ValueError(f"--data-prefix {value!r}: dataset {name!r} is not among the run's datasets "
                             f"({', '.join(datasets)})")
        if name in out:
            raise ValueError(f"--data-prefix: dataset {name!r} given twice ({out[name]!r} and {prefix!r})")
        if not prefix:
            raise ValueError(f"--data-prefix {value!r}: empty prefix")
        out[name] = prefix
    shared = {os.path.abspath(p) for p in out.values()}
    if len(shared) < len(out):
        raise ValueError(f"--data-prefix: one prefix for several datasets ({out}); each dataset reads its own files")
    return out
