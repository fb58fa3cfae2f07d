"""Core-attention modules for Megatron's layer specs: `SDPACoreAttention` and `MLADotProductAttention`.

`SDPACoreAttention` computes attention with `F.scaled_dot_product_attention`. A drop-in for Megatron's
`DotProductAttention` in a layer spec's `core_attention` slot (same constructor and forward signature,
same [s, b, heads, dim] layout in and [s, b, heads * v_dim] out). It runs on any device, handles
grouped-query attention (`enable_gqa`) and MLA (value head dim != query head dim; MLA passes `k_channels`
/ `v_channels`), and appears in the Dynamo graph as one `F.scaled_dot_product_attention` call that
fxquant's passes match.

`MLADotProductAttention` is Megatron's unfused `DotProductAttention` accepting the `k_channels` /
`v_channels` that multi-latent attention passes (0.16.1's local class takes neither, and shapes its output
by `kv_channels`); the computation is Megatron's own.

Mask convention: Megatron's boolean masks are True where attention is *forbidden*; SDPA's are True where it
is *allowed*. With no mask and a causal mask type, `is_causal=True` is used.
"""
from __future__ import annotations

import math

import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class SDPACoreAttention(MegatronModule):
    """softmax(QK^T * scale + mask) V via F.scaled_dot_product_attention, tensor-parallel aware."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(f"SDPACoreAttention supports context_parallel_size=1 only, got {config.context_parallel_size}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        tp = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_groups_per_partition = divide(config.num_query_groups or config.num_attention_heads, tp)
        head_dim = k_channels or config.kv_channels  # MLA passes k_channels = nope + rope head dim
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention does not support packed sequences (packed_seq_params)")
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not support attention_bias")
        mask_type = attn_mask_type or self.attn_mask_type
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        allowed = None if attention_mask is None else attention_mask.logical_not()
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal, scale=self.softmax_scale,
            enable_gqa=k.size(1) != q.size(1),
        )
        # [b, n, s, dv] -> [s, b, n * dv]
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)


class MLADotProductAttention(DotProductAttention):
    """Megatron's unfused core attention for MLA: query/key head dim `k_channels`, value head dim `v_channels`."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: ProcessGroupCollection | None = None,
                 k_channels: int | None = None, v_channels: int | None = None) -> None:
        if softmax_scale is None and k_channels is not None:
            softmax_scale = 1.0 / math.sqrt(k_channels)
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if v_channels is not None:  # the output is [s, b, heads_per_partition * v_channels]
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
