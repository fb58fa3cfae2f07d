"""Pass: resolve the scheme at every matched site and record it as ``node.meta["fxquant"]`` (a SiteMeta).

Pre: ``sites.find_sites`` matched the nodes. Post: every matched node carries a SiteMeta whose ``config``
is the scheme's LinearQuant / AttentionQuant for that site (None = high precision). The graph is not
edited. A block format (MX, NVFP4) asked to block along a dimension of static length 0 is a user error
(ValueError naming the site, the GEMM operand and the dimension); symbolic lengths are not checked here.
So is a quantized site whose floating operands have a dtype quantize does not take (float64): ValueError
naming the site, its source line and the dtypes allowed, raised before the graph runs.
"""
from __future__ import annotations

import torch
from torch import fx

from fxquant.formats.base import SUPPORTED_DTYPES
from fxquant.passes.sites import META_KEY, FoundSites, Match, OpKind, SiteMeta, Status, example_value, stack_line
from fxquant.schemes.model import AttentionQuant, LinearQuant, attention_operands
from fxquant.schemes.scheme import Scheme


def resolve_sites(found: FoundSites, scheme: Scheme) -> list[SiteMeta]:
    metas = []
    for m in found.matches:
        config = scheme.attention_for(m.site) if m.op.is_attention else scheme.linear_for(m.site)
        if config is not None and config.quantized:
            check_operand_dtypes(m)
        if isinstance(config, LinearQuant):
            check_blockable_linear(m, config)
        elif isinstance(config, AttentionQuant):
            check_untiled_attention(m, config)
        meta = SiteMeta(m.site, m.op, m.node.name, config, Status.HIGH_PRECISION, stack_line=stack_line(m.node))
        m.node.meta[META_KEY] = meta
        metas.append(meta)
    return metas


def check_untiled_attention(m: Match, aq: AttentionQuant) -> None:
    """Raise ValueError when an operand of ``aq`` has NVFP4's 2-D tiles (``block_2d``): attention's operands have three
    or four dims."""
    tiled = [f"{gemm}.{name}" for gemm, ops in attention_operands(aq).items() for name, tq in ops.items()
             if tq is not None and tq.options.block_2d]
    if tiled:
        raise ValueError(
            f"site {m.site.module_path or '<root>'!r} (attention): operands {', '.join(tiled)} have block_2d, which "
            "takes 2-D tensors (16x16 tiles of a weight); attention's operands have three or four dims")


def check_operand_dtypes(m: Match) -> None:
    """Raise ValueError when a floating operand of a quantized site has a dtype quantize does not take."""
    values = [example_value(a) for a in (*m.node.args, *m.node.kwargs.values()) if isinstance(a, fx.Node)]
    bad = sorted({str(v.dtype) for v in values
                  if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype not in SUPPORTED_DTYPES})
    if bad:
        where = f" [{stack_line(m.node)}]" if stack_line(m.node) else ""
        raise ValueError(
            f"site {m.site.module_path!r} ({m.site.kind.value}, {m.op.value}){where} has operands of dtype "
            f"{', '.join(bad)}; fxquant quantizes {', '.join(str(d) for d in SUPPORTED_DTYPES)} tensors: cast the "
            f"model (e.g. model.float()) or keep this site in high precision"
        )


def _static_len(value: object, dim: int) -> int | None:
    shape = getattr(value, "shape", None)
    if shape is None or len(shape) <= abs(dim) - (dim < 0):
        return None
    n = shape[dim]
    return n if isinstance(n, int) else None


def check_blockable_linear(m: Match, lq: LinearQuant) -> None:
    """Raise ValueError when a block format of ``lq`` would block the weight's K or N of length 0, or fprop's input of
    more than two dims would take NVFP4's 2-D tiles (``block_2d``)."""
    weight = _weight_node(m)
    w = example_value(weight)
    lengths = {"K": _static_len(w, 1), "N": _static_len(w, 0)}
    operands = (("fprop", "x", lq.fprop.a, "K"), ("fprop", "w", lq.fprop.b, "K"), ("dgrad", "dy", lq.dgrad.a, "N"),
                ("dgrad", "w", lq.dgrad.b, "N"))
    # quantized_linear quantizes fprop's x as given and the backward's activation operands as 2-D [M, K] / [M, N]
    # views; Megatron's linears quantize fprop's x and dgrad's dy as they come, [S, B, H]
    x, tq = (example_value(m.node.args[0]) if m.op is OpKind.LINEAR and m.node.args else None), lq.fprop.a
    if tq is not None and tq.options.block_2d and isinstance(x, torch.Tensor) and x.dim() != 2:
        raise ValueError(
            f"site {m.site.module_path!r}: fprop operand x is {x.dim()}-D (input shape {tuple(x.shape)}), and its "
            f"format {tq.spec()!r} has block_2d, which takes 2-D tensors (16x16 tiles of a weight): set block_2d on "
            f"the weight operands (fprop.w, dgrad.w) or the backward GEMMs' operands, which are 2-D views")
    if m.op is OpKind.MEGATRON_LINEAR:
        tiled = [name for name, t in (("fprop.x", lq.fprop.a), ("dgrad.dy", lq.dgrad.a))
                 if t is not None and t.options.block_2d]
        if tiled:
            raise ValueError(
                f"site {m.site.module_path!r} (a Megatron linear): {' and '.join(tiled)} "
                f"{'have' if len(tiled) > 1 else 'has'} block_2d, which takes "
                f"2-D tensors (16x16 tiles of a weight); Megatron's linears quantize their [S, B, H] input and its "
                f"gradient as they come: set block_2d on the weight operands (fprop.w, dgrad.w) or wgrad's")
    for gemm, operand, tq, axis in operands:
        if tq is not None and tq.fmt.block_size is not None and lengths[axis] == 0:
            raise ValueError(
                f"site {m.site.module_path!r}: {gemm} operand {operand} is blocked along {axis}, which has length 0 "
                f"(weight shape {tuple(w.shape)}); block format {tq.format!r} needs blocks of "
                f"{tq.fmt.block_size} elements along a non-empty dimension"
            )


def _weight_node(m: Match) -> fx.Node | None:
    if m.op is OpKind.LINEAR:
        return m.node.kwargs.get("weight", m.node.args[1] if len(m.node.args) > 1 else None)
    if m.op is OpKind.MEGATRON_LINEAR:
        return next((a for a in m.node.args[2:] if isinstance(a, fx.Node) and "weight" in a.name), None)
    return None
