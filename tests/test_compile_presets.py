"""Each preset quantizes exactly the operands its name says (issue 3, item 7, third bullet).

Megatron GPTModel (2 layers, unfused local attention: the predecessor's setting) is compiled with every
predecessor name, FA_PV_X, FA_QKPV_X and a legacy preset. The rewritten Dynamo graph is then read per
site and per GEMM operand, without fxquant's own resolution code:

- a Megatron linear: the ``fxquant::quantize`` nodes feeding the matmuls in its autograd_function_apply
  bodies (fwd_body's matmul = fprop (x, w^T); bwd_body's ``grad_input`` matmul = dgrad (dy, w),
  ``grad_weight`` matmul = wgrad (dy^T, x), names as Megatron's backward writes them), with the format
  and blocked dim of each;
- unfused attention: the spec tuple of the ``fxquant_baddbmm`` (QK^T) / ``fxquant_bmm`` (PV) call, whose
  positions are (forward a, b, grad_a's dC, B, grad_b's A, dC) = (q, k, ds, k, q, ds) / (p, v, do, v, p, do).

The table is compared with the expectation written here from the name alone, and the quantize calls
executed in a step (fxquant.counters, measured) with the count that expectation implies.
"""
from __future__ import annotations

import pytest
import torch

import fxquant
from fxquant.counters import count_quantize_calls
from fxquant.passes import wrappers
from fxquant.passes.sites import META_KEY, body_modules

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core", reason="needs megatron-core")
from tests.megatron_helpers import single_process  # noqa: E402,F401  (fixture)
from tests.test_compile_megatron import megatron_batch  # noqa: E402

QUANTIZE = torch.ops.fxquant.quantize.default
LINEAR_DIMS = {("fprop", "x"): -1, ("fprop", "w"): -2, ("dgrad", "dy"): -1, ("dgrad", "w"): -2,
               ("wgrad", "dy"): -1, ("wgrad", "x"): -2}  # as the body GEMMs see them: K, K, N, N, M, M
LINEAR = set(LINEAR_DIMS)
QK = {("qk", "q"), ("qk", "k"), ("dq", "ds"), ("dq", "k"), ("dk", "q"), ("dk", "ds")}
PV = {("pv", "p"), ("pv", "v"), ("dp", "do"), ("dp", "v"), ("dv", "p"), ("dv", "do")}
QK_POSITIONS = (("qk", "q"), ("qk", "k"), ("dq", "ds"), ("dq", "k"), ("dk", "q"), ("dk", "ds"))
PV_POSITIONS = (("pv", "p"), ("pv", "v"), ("dp", "do"), ("dp", "v"), ("dv", "p"), ("dv", "do"))
FULL = {"mxfp8": "mxfp8_e4m3", "mxfp4": "mxfp4_e2m1", "hifp8": "hifp8"}
LINEAR_SITES = [f"decoder.layers.{i}.{m}" for i in (0, 1) for m in
                ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
ATTENTION_SITES = [f"decoder.layers.{i}.self_attention.core_attention" for i in (0, 1)]


def expected(name: str) -> dict[tuple[str, str, str], str]:
    """(site, gemm, operand) -> format of every operand the preset ``name`` quantizes, from the name alone."""
    if name == "legacy_FA_mxfp8":  # PREDECESSOR.md: forward GEMMs (+ dgrad's dY in E5M2), QK^T in E5M2
        lin = {("fprop", "x"): "mxfp8_e4m3", ("fprop", "w"): "mxfp8_e4m3", ("dgrad", "dy"): "mxfp8_e5m2"}
        att = {("qk", "q"): "mxfp8_e5m2", ("qk", "k"): "mxfp8_e5m2", ("pv", "p"): "mxfp8_e4m3",
               ("pv", "v"): "mxfp8_e4m3"}
    else:
        family, _, fmt = name.rpartition("_")
        lin_ops = LINEAR if family in ("linear", "FA_linear") else set()
        att_ops = {"FA": QK, "FA_linear": QK, "FA_QK": QK, "FA_PV": PV, "FA_QKPV": QK | PV}.get(family, set())
        lin = {op: FULL.get(fmt, fmt) for op in lin_ops}
        att = {op: FULL.get(fmt, fmt) for op in att_ops}
    out = {(s,) + op: f for s in LINEAR_SITES for op, f in lin.items()}
    out.update({(s,) + op: f for s in ATTENTION_SITES for op, f in att.items()})
    return out


def _fmt(spec: str) -> str:
    return spec.split(":", 1)[0]


def quantized_operands(gm) -> tuple[dict, dict]:
    """Read from the rewritten graph: (site, gemm, operand) -> format, and -> blocked dim (linears)."""
    fmts, dims = {}, {}
    for node in gm.graph.nodes:
        meta = node.meta.get(META_KEY)
        if meta is None:
            continue
        site = meta.site.module_path
        if node.target in (wrappers.fxquant_baddbmm, wrappers.fxquant_bmm):
            positions = QK_POSITIONS if node.target is wrappers.fxquant_baddbmm else PV_POSITIONS
            fmts.update({(site,) + op: _fmt(s) for op, s in zip(positions, node.args[-1]) if s is not None})
            continue
        bodies = body_modules(gm, node)
        if bodies is None:
            continue
        for body in bodies:
            for mm in body.graph.nodes:
                if mm.target not in (torch.matmul, "matmul"):
                    continue
                gemm = "fprop" if body is bodies[0] else "dgrad" if mm.name.startswith("grad_input") else "wgrad"
                names = {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("dy", "x")}[gemm]
                for operand, arg in zip(names, mm.args[:2]):
                    if getattr(arg, "target", None) is QUANTIZE:
                        fmts[(site, gemm, operand)] = _fmt(arg.args[1])
                        dims[(site, gemm, operand)] = arg.args[2]
    return fmts, dims


PRESETS = ["bf16", "FA_mxfp8", "FA_mxfp4", "FA_hifp8", "linear_mxfp8", "linear_mxfp4", "linear_hifp8",
           "FA_linear_mxfp8", "FA_linear_mxfp4", "FA_linear_hifp8", "FA_PV_mxfp8", "FA_QKPV_hifp8", "legacy_FA_mxfp8"]


@pytest.mark.parametrize("name", PRESETS)
def test_preset_quantizes_exactly_the_operands_its_name_says(single_process, name):
    from fxquant.megatron_glue.config import tiny_llama_config
    from fxquant.megatron_glue.graph_breaks import traceable_megatron
    from fxquant.megatron_glue.model import build_gpt_model

    model = build_gpt_model(tiny_llama_config(), attention="local", seed=7)
    compiled = fxquant.compile(model, name, backend="eager", strict=True)
    ids, pos, mask = megatron_batch()

    def step():
        with traceable_megatron():
            compiled(ids, pos, mask, labels=ids).mean().backward()

    step()
    (report,) = fxquant.compile_state(compiled).backend.reports
    fmts, dims = quantized_operands(report.graph_module)
    want = expected(name)
    assert fmts == want
    assert all(dims[k] == LINEAR_DIMS[k[1:]] for k in dims)
    with count_quantize_calls(compiled) as count:
        step()
    assert count.executed == count.expected == len(want)
