"""Megatron-core glue: everything in fxquant that imports `megatron.core` lives in this package.

- `config`: ModelConfig / MLAConfig / MoEConfig and their enums (pure data, no Megatron import).
- `parallel`: torch.distributed + Megatron parallel_state from the torchrun environment or one process.
- `host`, `attention`, `graph_breaks`: running (and compiling) Megatron on CPU; SDPA core attention.
- `model`: GPTModel from a ModelConfig, layout-independent weights, global layer numbering.
- `data`, `train`, ...: datasets and the training loop (see docs/megatron.md).
Submodules are imported on demand so that `config` stays importable without Megatron.
"""
