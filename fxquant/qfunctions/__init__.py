"""fxquant.qfunctions: the quantized ops the compile backend rewrites linear and attention into.

Module-level functions, each around a ``torch.autograd.Function`` with a hand-written backward, so every
GEMM operand of the forward, dgrad and wgrad is quantized independently along its own reduction dimension
(FORMATS.md "Which dimension is blocked"), always from the high-precision tensor:

    quantized_linear(x, weight, bias, lq)                         F.linear
    quantized_matmul(a, b, mq)                                    torch.matmul (batched)
    quantized_bmm(input, mat2, *, mq)                             torch.bmm       (Megatron's P @ V)
    quantized_baddbmm(input, batch1, batch2, *, beta, alpha, mq)  torch.baddbmm   (Megatron's Q @ K^T)
    quantized_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, *, aq)
                                                                  F.scaled_dot_product_attention
    quantized_attention(...same...)  -> (O, P)                    nn.MultiheadAttention(need_weights=True)
"""
from fxquant.qfunctions.attention import quantized_attention, quantized_sdpa
from fxquant.qfunctions.linear import quantized_linear
from fxquant.qfunctions.matmul import quantized_baddbmm, quantized_bmm, quantized_matmul

__all__ = ["quantized_attention", "quantized_baddbmm", "quantized_bmm", "quantized_linear", "quantized_matmul",
           "quantized_sdpa"]
