"""Building Megatron-core GPTModels from a `ModelConfig`: local layer spec, CPU-capable, layout-independent init.

- `transformer_config(cfg, ...)` -> Megatron `TransformerConfig` (or `MLATransformerConfig` for MLA), with the
  parallel sizes of the current `parallel_state`.
- `layer_spec(cfg, tcfg, attention)` -> the decoder block spec of this pipeline stage: Megatron's local
  (no Transformer Engine) spec, MoE layers where `cfg.moe` says, and the core attention chosen by
  `AttentionKind`: Megatron's unfused `DotProductAttention` (LOCAL) or `SDPACoreAttention` (SDPA).
- `build_gpt_model(cfg, attention=...)` -> a `GPTModel` for this rank's pipeline stage and TP shard,
  on the parallel state's device, off CUDA a `HostGPTModel` with `HostRotaryEmbedding` (host.py) and the
  host MLA / MoE modules (host_moe_mla.py) in the spec, and weights drawn
  per *global* parameter name (`global_parameter_name`): the model computes the same function for any
  TP/PP layout, which is what lets a 2-process run be compared with a single-process one. With tied
  embeddings split across pipeline stages, the last stage's copy is not drawn but set up from the first
  stage's weights by Megatron's protocol (zero, then all-reduce over the embedding group).
- `causal_attention_mask(seq)`: the explicit boolean mask Megatron needs on CPU (trap 10).
Requires `parallel.initialize_parallel()` first.
"""
from __future__ import annotations

import copy
import logging
import re
import zlib

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from fxquant.megatron_glue.attention import MLADotProductAttention, SDPACoreAttention
from fxquant.megatron_glue.config import Activation, AttentionKind, ModelConfig, RopeScaling
from fxquant.megatron_glue.host import HostGPTModel, HostRotaryEmbedding
from fxquant.megatron_glue.host_moe_mla import check_host_layout, swap_mla_moe_modules

log = logging.getLogger(__name__)

VOCAB_DIVISIBLE_BY = 128  # Megatron-LM's default --make-vocab-size-divisible-by


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Vocabulary rounded up to a multiple of `divisible_by` (and of divisible_by * tp only when tp does not
    divide that): the same padded size, hence the same model, for every TP size that divides it."""
    padded = -(-vocab_size // divisible_by) * divisible_by
    if padded % tp:
        multiple = divisible_by * tp
        padded = -(-vocab_size // multiple) * multiple
    return padded


def transformer_config(cfg: ModelConfig, *, params_dtype: torch.dtype = torch.float32,
                       bf16: bool = False, device: torch.device | None = None, **overrides) -> TransformerConfig:
    """Megatron's TransformerConfig for `cfg` under the current parallel state. `overrides` pass through."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cfg.check_parallel(tp, pp, parallel_state.get_expert_model_parallel_world_size())
    on_cuda = device is not None and torch.device(device).type == "cuda"
    kwargs = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.query_groups,
        kv_channels=cfg.head_dim, normalization=cfg.normalization.value, layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=cfg.activation is Activation.SWIGLU,
        activation_func=F.silu if cfg.activation is Activation.SWIGLU else F.gelu,
        add_bias_linear=cfg.add_bias_linear, add_qkv_bias=cfg.add_bias_linear,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        sequence_parallel=False, params_dtype=params_dtype, bf16=bf16,
        pipeline_dtype=params_dtype if pp > 1 else None,
        use_cpu_initialization=not on_cuda, perform_initialization=True,
        # The fused kernels are CUDA-only (and hide the GEMMs fxquant rewrites).
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        qk_layernorm=cfg.mla is not None,  # MLA: RMSNorm on the compressed kv (DeepSeek-V2 kv_a_layernorm)
    )
    if cfg.moe is not None:
        m = cfg.moe
        kwargs.update(
            num_moe_experts=m.num_experts, moe_router_topk=m.top_k, moe_ffn_hidden_size=m.expert_ffn_hidden_size,
            moe_shared_expert_intermediate_size=m.shared_expert_ffn_hidden_size,
            moe_layer_freq=[0] * m.first_k_dense + [1] * (cfg.num_layers - m.first_k_dense),
            moe_router_load_balancing_type=m.load_balancing.value, moe_aux_loss_coeff=m.aux_loss_coeff,
            # all-to-all builds a torch.cuda.Stream; all-gather routes identically at EP = 1 (host_moe_mla.py)
            moe_token_dispatcher_type="alltoall" if on_cuda else "allgather",
            moe_grouped_gemm=False, moe_router_dtype="fp32",
            moe_router_score_function="softmax", moe_router_pre_softmax=True,
        )
    kwargs.update(overrides)
    if cfg.mla is None:
        return TransformerConfig(**kwargs)
    m = cfg.mla
    return MLATransformerConfig(
        **kwargs, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
        rope_type="yarn" if cfg.rope_scaling is RopeScaling.YARN else "rope", rotary_base=cfg.rotary_base,
        rotary_scaling_factor=m.rope_scaling_factor if cfg.rope_scaling is RopeScaling.YARN else 1.0,
        original_max_position_embeddings=m.original_max_position_embeddings, beta_fast=m.beta_fast,
        beta_slow=m.beta_slow, mscale=m.mscale, mscale_all_dim=m.mscale_all_dim,
    )


def layer_spec(cfg: ModelConfig, tcfg: TransformerConfig, attention: AttentionKind,
               device: torch.device | str = "cpu"):
    """This pipeline stage's decoder block spec (local modules) with the chosen core attention; off CUDA,
    with the host replacements of Megatron's MLA and MoE modules (host_moe_mla.py)."""
    spec = copy.deepcopy(get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False,
                                                    normalization=cfg.normalization.value))
    if attention is AttentionKind.SDPA:
        core = SDPACoreAttention
    else:
        core = MLADotProductAttention if cfg.mla is not None else DotProductAttention
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = core
    swap_mla_moe_modules(spec, host=torch.device(device).type != "cuda")
    return spec


def build_gpt_model(cfg: ModelConfig, *, attention: AttentionKind | str = AttentionKind.SDPA,
                    device: torch.device | str | None = None, params_dtype: torch.dtype = torch.float32,
                    bf16: bool = False, seed: int = 1234, max_sequence_length: int | None = None,
                    **config_overrides) -> GPTModel:
    """A Megatron GPTModel for this rank (its pipeline stage and TP shard), on `device` (default: CPU or
    the current CUDA device). `attention` picks the core attention ("sdpa" or "local")."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is not initialised; call "
                           "fxquant.megatron_glue.parallel.initialize_parallel() first")
    attention = AttentionKind.parse(attention)
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    tp = parallel_state.get_tensor_model_parallel_world_size()
    check_host_layout(cfg, tp, parallel_state.get_expert_model_parallel_world_size(), device)
    tcfg = transformer_config(cfg, params_dtype=params_dtype, bf16=bf16, device=device, **config_overrides)
    model_class = GPTModel if device.type == "cuda" else HostGPTModel  # tied-embedding set-up (host.py)
    model = model_class(
        config=tcfg, transformer_layer_spec=layer_spec(cfg, tcfg, attention, device),
        vocab_size=padded_vocab_size(cfg.vocab_size, tp),
        max_sequence_length=max_sequence_length or cfg.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True, share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type="none" if cfg.mla is not None else "rope",
        rotary_base=int(cfg.rotary_base), rope_scaling=cfg.rope_scaling is RopeScaling.LLAMA3,
        rope_scaling_factor=cfg.rope_scaling_factor,
    )
    if device.type != "cuda" and hasattr(model, "rotary_pos_emb"):
        model.rotary_pos_emb.__class__ = HostRotaryEmbedding  # same state, no move to CUDA (host.py)
    model.to(device)
    initialize_weights(model, cfg, seed=seed)
    if cfg.tie_embeddings and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        # The stages' copies were synchronised at construction, before the draw: again (zero the last
        # stage's copy, all-reduce), so that copy becomes the first stage's drawn embedding.
        model.setup_embeddings_and_output_layer()
    return model


_LAYER = re.compile(r"(?<![\w.])(decoder\.layers\.)(\d+)\.")
_EXPERT = re.compile(r"(local_experts\.)(\d+)\.")


def layer_offset(model: GPTModel) -> int:
    """Global 0-based index of this pipeline stage's first transformer layer."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def global_layer_numbers(model: GPTModel) -> dict[str, int]:
    """Module path of each transformer layer (`decoder.layers.N`, local to the stage) -> global 0-based index."""
    return {f"decoder.layers.{i}": layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}


def global_parameter_name(name: str, model: GPTModel, tied: bool) -> str:
    """The parameter's name in the unsplit model: global layer and expert indices; a tied LM head is the
    embedding."""
    numbers = global_layer_numbers(model)
    name = _LAYER.sub(lambda m: f"{m.group(1)}{numbers[m.group(1) + m.group(2)]}.", name)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    cfg = model.config
    if cfg.num_moe_experts:
        local = cfg.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        name = _EXPERT.sub(lambda m: f"{m.group(1)}{ep_rank * local + int(m.group(2))}.", name)
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return name


@torch.no_grad()
def initialize_weights(model: GPTModel, cfg: ModelConfig, *, seed: int) -> None:
    """Draw every matrix from N(0, std) seeded by (seed, global name), then keep this rank's TP shard.

    Output projections (linear_proj, linear_fc2) use std / sqrt(2 * num_layers) as Megatron does. Vectors
    (norm scales, biases) keep Megatron's deterministic init. Gated fc1 weights ([gate; up]) are sharded
    per half, matching how Megatron's ColumnParallelLinear lays out a SwiGLU fc1 on each TP rank. A copy
    Megatron marks `shared` (the last pipeline stage's copy of tied embeddings) is not drawn:
    `build_gpt_model` sets it from the first stage's.
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    gated = model.config.gated_linear_unit
    for name, param in model.named_parameters():
        if param.dim() < 2 or getattr(param, "shared", False):
            continue
        gname = global_parameter_name(name, model, cfg.tie_embeddings)
        dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) and tp > 1 else -1
        shape = list(param.shape)
        if dim >= 0:
            shape[dim] *= tp
        std = cfg.init_method_std
        if gname.endswith(("linear_proj.weight", "linear_fc2.weight")):
            std = std / (2.0 * cfg.num_layers) ** 0.5
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{gname}".encode()))
        full = torch.randn(shape, generator=gen, dtype=torch.float32) * std
        if dim >= 0:
            if gated and gname.endswith("linear_fc1.weight") and dim == 0:
                full = torch.cat([half.chunk(tp, dim=0)[tp_rank] for half in full.chunk(2, dim=0)], dim=0)
            else:
                full = full.chunk(tp, dim=dim)[tp_rank]
        param.copy_(full.to(param.dtype))


def causal_attention_mask(seq_length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[1, 1, s, s] bool mask, True where attention is forbidden (Megatron's convention)."""
    return torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool, device=device).triu_(diagonal=1)


def position_ids(batch: int, seq_length: int, device: torch.device | str | None = None) -> torch.Tensor:
    return torch.arange(seq_length, device=device).unsqueeze(0).expand(batch, seq_length)
