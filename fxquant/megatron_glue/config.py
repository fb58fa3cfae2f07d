"""Model architecture as data: `ModelConfig` (+ `MLAConfig`, `MoEConfig`) and the enums they use.

Pure data, no Megatron import: `experiments/` validates configurations (heads divisible by TP, ...)
before launching anything, and `fxquant.megatron_glue.model` turns a ModelConfig into Megatron's
`TransformerConfig` / `MLATransformerConfig` and a `GPTModel`. Published architectures live in
`experiments/models.py`; this module only ships the tiny Llama-style config used by tests.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace


class AttentionKind(enum.Enum):
    """Which core-attention module computes softmax(QK^T)V inside Megatron's attention layers."""

    SDPA = "sdpa"    # F.scaled_dot_product_attention (fxquant.megatron_glue.attention.SDPACoreAttention)
    LOCAL = "local"  # Megatron's unfused DotProductAttention: baddbmm -> mask -> softmax -> dropout -> bmm

    @classmethod
    def parse(cls, value: "AttentionKind | str") -> "AttentionKind":
        return _parse_enum(cls, value, "attention")


class Normalization(enum.Enum):
    RMSNORM = "RMSNorm"
    LAYERNORM = "LayerNorm"


class Activation(enum.Enum):
    SWIGLU = "swiglu"  # gated SiLU, as Llama and DeepSeek use
    GELU = "gelu"


class RopeScaling(enum.Enum):
    NONE = "none"
    LLAMA3 = "llama3"  # Llama 3.1 frequency scaling (low 1, high 4, original context 8192)
    YARN = "yarn"      # DeepSeek-V2 YaRN (MLA only)


class LoadBalancing(enum.Enum):
    """The MoE router's auxiliary load-balancing loss (Megatron's `moe_router_load_balancing_type`)."""

    AUX_LOSS = "aux_loss"          # Switch-Transformer loss over all tokens of the micro-batch
    SEQ_AUX_LOSS = "seq_aux_loss"  # the same per sequence, averaged (DeepSeek-V2's `seq_aux: true`)


def _parse_enum(cls: type[enum.Enum], value, argument: str):
    if isinstance(value, cls):
        return value
    for member in cls:
        if str(value).lower() in (member.value.lower(), member.name.lower()):
            return member
    raise ValueError(f"{argument}={value!r} is not valid; allowed: {[m.value for m in cls]}")


def _positive(owner: str, **values: int | float | None) -> None:
    for name, value in values.items():
        if value is not None and not value > 0:
            raise ValueError(f"{owner}.{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2). q_lora_rank None = queries are not compressed."""

    kv_lora_rank: int
    qk_head_dim: int          # the "nope" part of each query/key head
    qk_pos_emb_head_dim: int  # the rotary part
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_scaling_factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.707
    mscale_all_dim: float = 0.707

    def __post_init__(self) -> None:
        _positive("MLAConfig", kv_lora_rank=self.kv_lora_rank, qk_head_dim=self.qk_head_dim,
                  qk_pos_emb_head_dim=self.qk_pos_emb_head_dim, v_head_dim=self.v_head_dim,
                  q_lora_rank=self.q_lora_rank)


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts: routed experts with top-k softmax routing, optional shared experts."""

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    shared_expert_ffn_hidden_size: int | None = None  # all shared experts together (DeepSeek: n_shared x ffn)
    first_k_dense: int = 0                            # leading layers with a dense MLP instead of MoE
    aux_loss_coeff: float = 0.001
    load_balancing: LoadBalancing = LoadBalancing.AUX_LOSS

    def __post_init__(self) -> None:
        _positive("MoEConfig", num_experts=self.num_experts, top_k=self.top_k,
                  expert_ffn_hidden_size=self.expert_ffn_hidden_size,
                  shared_expert_ffn_hidden_size=self.shared_expert_ffn_hidden_size)
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.first_k_dense < 0:
            raise ValueError(f"MoEConfig.first_k_dense must be >= 0, got {self.first_k_dense}")
        if not isinstance(self.load_balancing, LoadBalancing):
            object.__setattr__(self, "load_balancing", _parse_enum(LoadBalancing, self.load_balancing,
                                                                   "MoEConfig.load_balancing"))


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer, described the way model cards describe it."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    vocab_size: int
    num_query_groups: int | None = None  # None = multi-head attention (groups == heads)
    kv_channels: int | None = None       # head dim; None = hidden_size // num_attention_heads
    max_position_embeddings: int = 4096
    rotary_base: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling.NONE
    rope_scaling_factor: float = 8.0
    normalization: Normalization = Normalization.RMSNORM
    norm_epsilon: float = 1e-5
    activation: Activation = Activation.SWIGLU
    tie_embeddings: bool = False
    add_bias_linear: bool = False
    init_method_std: float = 0.02
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    extras: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        _positive("ModelConfig", num_layers=self.num_layers, hidden_size=self.hidden_size,
                  ffn_hidden_size=self.ffn_hidden_size, num_attention_heads=self.num_attention_heads,
                  vocab_size=self.vocab_size, num_query_groups=self.num_query_groups,
                  kv_channels=self.kv_channels, rotary_base=self.rotary_base)
        groups = self.query_groups
        if self.num_attention_heads % groups:
            raise ValueError(f"ModelConfig.num_query_groups={groups} must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.kv_channels is None and self.mla is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"ModelConfig.hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}; give kv_channels")
        if self.rope_scaling is RopeScaling.YARN and self.mla is None:
            raise ValueError("ModelConfig.rope_scaling='yarn' is only supported with MLA (mla=MLAConfig(...))")
        if self.moe is not None and self.moe.first_k_dense > self.num_layers:
            raise ValueError(f"MoEConfig.first_k_dense={self.moe.first_k_dense} exceeds num_layers={self.num_layers}")

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def with_(self, **changes) -> "ModelConfig":
        """A copy with fields replaced (validated again)."""
        return replace(self, **changes)

    def check_parallel(self, tp: int, pp: int, ep: int = 1) -> None:
        """Raise ValueError when this model cannot be split `tp`-way across tensors / `pp`-way across stages."""
        if tp < 1 or pp < 1 or ep < 1:
            raise ValueError(f"parallel sizes must be >= 1, got tp={tp}, pp={pp}, ep={ep}")
        if self.num_attention_heads % tp:
            raise ValueError(f"tp={tp} does not divide num_attention_heads={self.num_attention_heads} "
                             f"of model {self.name!r}")
        if self.mla is None and self.query_groups % tp:
            raise ValueError(f"tp={tp} does not divide num_query_groups={self.query_groups} of model {self.name!r}")
        if self.ffn_hidden_size % tp:
            raise ValueError(f"tp={tp} does not divide ffn_hidden_size={self.ffn_hidden_size} of model {self.name!r}")
        if self.num_layers % pp:
            raise ValueError(f"pp={pp} does not divide num_layers={self.num_layers} of model {self.name!r}")
        if self.moe is not None and self.moe.num_experts % ep:
            raise ValueError(f"ep={ep} does not divide num_experts={self.moe.num_experts} of model {self.name!r}")

    def tp_block_splits(self, tp: int, block: int = 32) -> list[str]:
        """The decoder layers' GEMM reduction dims that tensor parallelism shards to a length per rank that is no multiple of
        `block` (one per line, empty when none, or tp 1): there a rank's last block is short and the blocks of
        the other ranks start elsewhere than one process's, so block formats quantize those operands
        differently; for a SwiGLU fc1 (rows [gate; up] per rank) a block along its output rows in the dgrad
        holds gate and up values under one scale."""
        if tp <= 1:
            return []
        out = []
        gated = self.activation is Activation.SWIGLU
        ffns = []  # (which MLP, its FFN width): the dense one, and under MoE (expert TP = TP) the experts' ones
        if self.moe is None or self.moe.first_k_dense:
            ffns.append(("", self.ffn_hidden_size))
        if self.moe is not None:
            ffns.append(("experts' ", self.moe.expert_ffn_hidden_size))
            if self.moe.shared_expert_ffn_hidden_size:
                ffns.append(("shared experts' ", self.moe.shared_expert_ffn_hidden_size))
        dims = []
        for who, ffn in ffns:
            dims += [(f"{who}linear_fc1 dgrad (its output rows" + (", [gate; up] per rank)" if gated else ")"),
                      ffn * (2 if gated else 1) // tp),
                     (f"{who}linear_fc2 fprop (its input columns)", ffn // tp)]
        if self.mla is None:
            attention = self.num_attention_heads * self.head_dim
            dims += [("linear_qkv dgrad (its output rows)", (attention + 2 * self.query_groups * self.head_dim) // tp),
                     ("linear_proj fprop (its input columns)", attention // tp)]
        else:
            m, heads = self.mla, self.num_attention_heads
            dims += [("linear_q(_up)_proj dgrad (its output rows)", heads * (m.qk_head_dim + m.qk_pos_emb_head_dim) // tp),
                     ("linear_kv_up_proj dgrad (its output rows)", heads * (m.qk_head_dim + m.v_head_dim) // tp),
                     ("linear_proj fprop (its input columns)", heads * m.v_head_dim // tp)]
        for what, per_rank in dims:
            if per_rank % block:
                out.append(f"{what}: {per_rank} per rank, not a multiple of {block}")
        for who, ffn in ffns:
            if gated and (ffn // tp) % block:
                out.append(f"{who}linear_fc1 dgrad: a block spans the end of the gate rows and the start of the up "
                           f"rows ({ffn // tp} of each per rank)")
        return out

    def num_parameters(self) -> int:
        """Parameter count (embeddings included once when tied), for reports and sanity checks."""
        h, v = self.hidden_size, self.vocab_size
        total = v * h * (1 if self.tie_embeddings else 2) + h  # embeddings, LM head, final norm
        for layer in range(self.num_layers):
            total += 2 * h  # two norms
            total += self._attention_parameters()
            dense = self.moe is None or layer < self.moe.first_k_dense
            if dense:
                total += self._mlp_parameters(self.ffn_hidden_size)
            else:
                m = self.moe
                total += m.num_experts * self._mlp_parameters(m.expert_ffn_hidden_size) + m.num_experts * h
                if m.shared_expert_ffn_hidden_size:
                    total += self._mlp_parameters(m.shared_expert_ffn_hidden_size)
        return total

    def _mlp_parameters(self, ffn: int) -> int:
        return (3 if self.activation is Activation.SWIGLU else 2) * self.hidden_size * ffn

    def _attention_parameters(self) -> int:
        h, n = self.hidden_size, self.num_attention_heads
        if self.mla is None:
            d = self.head_dim
            return h * d * (n + 2 * self.query_groups) + n * d * h
        m = self.mla
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        q = h * n * qk if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * qk
        kv = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank
        kv += m.kv_lora_rank * n * (m.qk_head_dim + m.v_head_dim)
        return q + kv + n * m.v_head_dim * h


def tiny_llama_config(**changes) -> ModelConfig:
    """A 2-layer Llama-style model (RMSNorm, RoPE, GQA 4:2, SwiGLU, byte vocabulary) for tests and CPU demos."""
    base = ModelConfig(
        name="tiny-llama", num_layers=2, hidden_size=64, ffn_hidden_size=172, num_attention_heads=4,
        num_query_groups=2, vocab_size=256, max_position_embeddings=256, rotary_base=500000.0,
    )
    return replace(base, **changes) if changes else base


def check_host_layout(cfg: ModelConfig, tp: int, ep: int, device: object) -> None:
    """Refuse the layouts whose MLA / MoE communication Megatron 0.16.1 allocates on CUDA.

    Off CUDA, tensor parallelism of MLA (the kv / q down-projections are gathered by
    `tensor_parallel.mappings._gather_along_last_dim`) and of MoE (the all-gather dispatcher), and expert
    parallelism, all reach `torch.empty(..., device=torch.cuda.current_device())`. Pipeline and data
    parallelism work. `device`: a torch.device or its name ("cpu", "cuda:0").
    """
    if str(device).split(":")[0] == "cuda" or (cfg.mla is None and cfg.moe is None):
        return
    parts = " + ".join(name for name, on in (("MLA", cfg.mla is not None), ("MoE", cfg.moe is not None)) if on)
    if tp > 1 or ep > 1:
        raise ValueError(f"model {cfg.name!r} ({parts}) with tp={tp}, ep={ep} cannot run on {device}: Megatron-core "
                         f"0.16.1 gathers MLA/MoE activations across tensor/expert-parallel ranks into CUDA-only "
                         f"buffers; use tp=1 and ep=1 off CUDA (pipeline and data parallelism work)")
