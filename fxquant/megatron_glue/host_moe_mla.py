"""MLA and MoE blocks (DeepSeek-V2) of Megatron-core 0.16.1 off CUDA and without Transformer Engine.

Megatron's multi-latent attention and mixture-of-experts modules allocate on CUDA, or need Transformer
Engine, in places a CPU run reaches. Each is replaced through the layer spec (`swap_mla_moe_modules`,
called by `model.layer_spec`); nothing of Megatron or torch stays patched:
- `MLASelfAttention.__init__` builds its rotary embedding (`YarnRotaryEmbedding`, or `RotaryEmbedding` for
  rope_type='rope') without `use_cpu_initialization`, i.e. on `torch.cuda.current_device()`, and both
  move their frequencies to CUDA on first use; and its `HAVE_TE` is True whenever Megatron's TE extension
  module imports (it does without TE, with MagicMock classes), so `isinstance(.., TELinear)` raises.
  `HostMLASelfAttention` (the spec's `self_attention.module`) runs Megatron's constructor while `_rebound`
  rebinds those names in the multi_latent_attention module only, for the duration of that constructor, to
  `HostYarnRotaryEmbedding` / `HostRotaryEmbedding` (built on the host, never moved) and the true TE flag.
  `LocalMLASelfAttention` (used on CUDA) rebinds only the TE flag.
- `TopKRouter.gating` moves the router weight to CUDA on every call and its gating function needs TE's
  `te_general_gemm`: `LocalTopKRouter` (the spec's `mlp.submodules.router`) computes the same gating.
- The all-to-all token dispatcher creates a `torch.cuda.Stream` when built: off CUDA the MoE layers use
  Megatron's all-gather dispatcher (`model.transformer_config`), which routes identically at EP = 1.
- The aux-loss tracker: `track_moe_metrics(force_initialize=True)` creates missing entries with
  `device="cuda"` (moe_utils.py, ~line 998). `MoEAuxLosses` creates them on the run's device, then calls
  Megatron's reduction and logging (`track_moe_metrics` without force_initialize).
- `check_host_layout` (defined in `config`, no Megatron import, so the launcher checks it before starting)
  refuses tensor/expert parallelism of MLA/MoE off CUDA (CUDA-only gather buffers).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from megatron.core.extensions import transformer_engine as te_extension
from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler, TopKRouter

from fxquant.megatron_glue.config import check_host_layout  # noqa: F401 (re-exported: it lived here)
from fxquant.megatron_glue.host import HostRotaryEmbedding


class HostYarnRotaryEmbedding(yarn.YarnRotaryEmbedding):
    """Megatron's YaRN rotary embedding, built on the host, whose frequencies stay where they were built."""

    def __init__(self, kv_channels: int, **kwargs) -> None:
        kwargs["use_cpu_initialization"] = True
        super().__init__(kv_channels, **kwargs)

    def get_emb(self, max_seq_len: int, offset: int = 0):
        """`YarnRotaryEmbedding.get_emb` of Megatron-core 0.16.1 without the move to CUDA."""
        if self.rotary_interleaved:
            raise ValueError("YaRN RoPE does not support interleaved rotary embeddings (rotary_interleaved=True)")
        low, high = yarn._yarn_find_correction_range(
            self.beta_fast, self.beta_slow, self.dim, self.rotary_base, self.original_max_position_embeddings,
            self.correction_range_round_to_int)
        device = self.inv_freq_extra.device
        extra_mask = 1.0 - yarn._yarn_linear_ramp_mask(low, high, self.dim // 2, device=device).float()
        inv_freq = self.inv_freq_inter * (1 - extra_mask) + self.inv_freq_extra * extra_mask
        seq = torch.arange(max_seq_len, device=device, dtype=self.inv_freq_extra.dtype) + offset
        freqs = torch.outer(seq, inv_freq)
        mscale = yarn._yarn_get_concentration_factor(self.scaling_factor, self.mscale, self.mscale_all_dim)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :], mscale


_rebind_lock = threading.Lock()


@contextlib.contextmanager
def _rebound(module, bindings: dict[str, object]) -> Iterator[None]:
    """Within the block, `module.<name>` is `bindings[name]`; the previous bindings are restored on exit."""
    with _rebind_lock:
        saved = {name: getattr(module, name) for name in bindings}
        try:
            for name, value in bindings.items():
                setattr(module, name, value)
            yield
        finally:
            for name, value in saved.items():
                setattr(module, name, value)


class LocalMLASelfAttention(multi_latent_attention.MLASelfAttention):
    """Megatron's MLASelfAttention, built with the true Transformer Engine flag (and, off CUDA, host rotary).

    multi_latent_attention.py's `HAVE_TE` is True whenever `megatron.core.extensions.transformer_engine`
    imports, which it does without Transformer Engine (its classes are then MagicMocks), and the
    constructor's `isinstance(self.linear_proj, TELinear)` raises TypeError. The constructor therefore runs
    with `HAVE_TE` rebound to the extension's own flag.
    """

    host_rotary = False

    def __init__(self, *args, **kwargs) -> None:
        bindings: dict[str, object] = {}
        if multi_latent_attention.HAVE_TE and not te_extension.HAVE_TE:
            bindings["HAVE_TE"] = False
        if self.host_rotary:
            bindings.update(YarnRotaryEmbedding=HostYarnRotaryEmbedding, RotaryEmbedding=HostRotaryEmbedding)
        with _rebound(multi_latent_attention, bindings):
            super().__init__(*args, **kwargs)


class HostMLASelfAttention(LocalMLASelfAttention):
    """`LocalMLASelfAttention` whose rotary embedding is built and kept on the host (module docstring)."""

    host_rotary = True


class _RouterGatingLinear(torch.autograd.Function):
    """Megatron's RouterGatingLinearFunction (moe_utils.py) without Transformer Engine: logits in
    `router_dtype`, gradients returned in the input / weight dtypes, no high-precision copies saved."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, router_dtype: torch.dtype):
        ctx.save_for_backward(inp, weight, bias)
        ctx.router_dtype, ctx.input_dtype, ctx.weight_dtype = router_dtype, inp.dtype, weight.dtype
        flat = inp.reshape(-1, inp.shape[-1]).to(router_dtype)
        out = torch.mm(flat, weight.to(router_dtype).t())
        if bias is not None:
            out = out + bias.to(router_dtype)
        return out.view(*inp.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        inp, weight, bias = ctx.saved_tensors
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = torch.mm(grad, weight.to(ctx.router_dtype)).to(ctx.input_dtype).view(inp.shape)
        flat = inp.reshape(-1, inp.shape[-1]).to(ctx.router_dtype)
        grad_weight = torch.mm(grad.t(), flat).to(ctx.weight_dtype)
        grad_bias = grad.sum(dim=0).to(ctx.weight_dtype) if bias is not None else None
        return grad_input, grad_weight, grad_bias, None


class LocalTopKRouter(TopKRouter):
    """Megatron's TopKRouter whose gating neither moves the weight to CUDA nor needs Transformer Engine.

    0.16.1's `TopKRouter.gating` moves a host weight to CUDA on every call, and its
    `RouterGatingLinearFunction` reads `te_general_gemm`, a name moe_utils.py defines only when Transformer
    Engine imports (NameError otherwise, on any device).
    """

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtypes = {"fp32": torch.float32, "fp64": torch.float64}
        router_dtype = dtypes.get(self.config.moe_router_dtype, input.dtype)
        return _RouterGatingLinear.apply(input, self.weight, self.bias, router_dtype)


def swap_mla_moe_modules(spec, host: bool) -> None:
    """Swap into a decoder block spec (in place): `LocalMLASelfAttention` (`HostMLASelfAttention` when
    `host`) for MLASelfAttention; `LocalTopKRouter` for the MoE layers' TopKRouter when `host` or when
    Transformer Engine is missing."""
    router = LocalTopKRouter if host or not moe_utils.HAVE_TE else TopKRouter
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention
        if attention.module is multi_latent_attention.MLASelfAttention:
            attention.module = HostMLASelfAttention if host else LocalMLASelfAttention
        mlp = layer.submodules.mlp
        if getattr(getattr(mlp, "submodules", None), "router", None) is TopKRouter:
            mlp.submodules.router = router


class MoEAuxLosses:
    """The MoE auxiliary losses of an iteration, reduced and averaged over MoE layers, by Megatron's code.

    `start(device)` resets the aux-loss backward scale and pre-creates the tracker entries on `device` (what
    `track_moe_metrics(force_initialize=True)` does on CUDA), so every pipeline stage reduces the same
    entries even when it holds no MoE layer. `collect()` returns {name: mean over MoE layers} of the
    iteration and clears the tracker (Megatron's `track_moe_metrics`).
    """

    def __init__(self, config) -> None:
        self.config = config
        self.names = list(_AUX_LOSS_NAMES.get(config.moe_router_load_balancing_type, ()))

    @property
    def enabled(self) -> bool:
        return bool(self.config.num_moe_experts) and bool(self.names)

    def start(self, device: torch.device) -> None:
        if not self.config.num_moe_experts:
            return
        # A fresh [1]-shaped scale: Megatron's backward creates a 0-dim one when none is set, into which
        # forward_step's `set_loss_scale(<[1]-shaped>)` then cannot copy.
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.ones(1, device=device)
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        for name in self.names:  # fresh entries: an earlier model of this process may have left its own
            tracker[name] = {"values": torch.zeros(self._num_layers, device=device), "reduce_group": None,
                             "avg_group": None, "reduce_group_has_dp": False}

    @property
    def _num_layers(self) -> int:
        return self.config.num_layers + (self.config.mtp_num_layers or 0)

    def collect(self, iteration: int, num_microbatches: int) -> dict[str, float]:
        if not self.enabled:
            return {}
        totals: dict[str, torch.Tensor] = {}
        moe_utils.track_moe_metrics(
            loss_scale=1.0 / num_microbatches, iteration=iteration, total_loss_dict=totals, track_names=self.names,
            num_layers=self._num_layers, moe_layer_freq=self.config.moe_layer_freq,
            mtp_num_layers=self.config.mtp_num_layers)
        return {name: float(value) for name, value in totals.items()}


_AUX_LOSS_NAMES = {
    "aux_loss": ("load_balancing_loss",),
    "seq_aux_loss": ("seq_load_balancing_loss",),
    "global_aux_loss": ("global_load_balancing_loss",),
}
