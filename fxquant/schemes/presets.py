"""Preset schemes, generated from format names, and the shipped preset YAML files that show them to users.

Names (X = every format name and alias of ``fxquant.formats``: mxfp8, mxfp4, hifp8, nvfp4, mxfp6_e3m2, ...):

    bf16            nothing quantized
    linear_X        every linear GEMM (fprop, dgrad, wgrad), both operands, in X
    FA_X = FA_QK_X  attention's QK^T GEMM: Q, K in the forward and its backward GEMMs dQ = dS K, dK = dS^T Q
    FA_PV_X         attention's PV GEMM: P, V in the forward and its backward GEMMs dP = dO V^T, dV = P^T dO
    FA_QKPV_X       both attention matmuls
    FA_linear_X     FA_X plus linear_X
    legacy_<name>   for the predecessor's ten names: what it effectively computed (``legacy_rules``)

The ten predecessor names ship as YAML files in ``presets/`` (readable examples); ``get`` reads those and a
test checks they equal what ``generate`` builds here.
"""
from __future__ import annotations

from fxquant import formats
from fxquant.formats.tensor_quant import TensorQuant
from fxquant.schemes.model import HIGH, AttentionQuant, GemmQuant, LinearQuant, MatmulQuant
from fxquant.schemes.rules import Rule
from fxquant.schemes.scheme import Scheme

PREDECESSOR_FORMATS = ("mxfp8", "mxfp4", "hifp8")
PREDECESSOR_NAMES = ("bf16",) + tuple(
    f"{p}_{x}" for p in ("FA", "linear", "FA_linear") for x in PREDECESSOR_FORMATS
)
_PREFIXES = ("linear", "FA", "FA_QK", "FA_PV", "FA_QKPV", "FA_linear")


def format_names() -> list[str]:
    return formats.names() + list(formats.aliases())


def _all(tq: TensorQuant | None) -> MatmulQuant:
    g = GemmQuant(tq, tq)
    return MatmulQuant(g, g, g)


def linear_all(tq: TensorQuant) -> LinearQuant:
    g = GemmQuant(tq, tq)
    return LinearQuant(g, g, g)


def _describe(prefix: str, x: str) -> str:
    what = {
        "linear": "every linear GEMM (fprop, dgrad, wgrad), both operands",
        "FA": "attention's QK^T GEMM: Q, K forward and its backward GEMMs dS*K, dS^T*Q",
        "FA_QK": "attention's QK^T GEMM: Q, K forward and its backward GEMMs dS*K, dS^T*Q",
        "FA_PV": "attention's PV GEMM: P, V forward and its backward GEMMs dO*V^T, P^T*dO",
        "FA_QKPV": "attention's QK^T and PV GEMMs, forward and backward",
        "FA_linear": "attention's QK^T GEMM (forward and backward) and every linear GEMM",
    }[prefix]
    return f"{what}, in {x}"


def _rules(prefix: str, tq: TensorQuant) -> tuple[Rule, ...]:
    lin = Rule(linear=linear_all(tq))
    qk = Rule(attention=AttentionQuant(qk=_all(tq)))
    if prefix == "linear":
        return (lin,)
    if prefix in ("FA", "FA_QK"):
        return (qk,)
    if prefix == "FA_PV":
        return (Rule(attention=AttentionQuant(pv=_all(tq))),)
    if prefix == "FA_QKPV":
        return (Rule(attention=AttentionQuant(qk=_all(tq), pv=_all(tq))),)
    return (lin, qk)  # FA_linear


def legacy_rules(x: str) -> tuple[Rule, ...]:
    """What the predecessor computed for every scheme name of quant type ``x`` (PREDECESSOR.md, FORMATS.md
    last section). Its quant type was a source literal edited by a tool, so FA_x, linear_x and FA_linear_x
    all quantized every site: linear and both attention GEMMs, forward only, rounding ties-away, MX scale
    floor. QK^T used MX-E5M2 for the MX types (also for mxfp4); linear dgrad's dY was MX-E5M2 from a separate
    literal (for every type); wgrad and attention backward GEMMs were not quantized."""
    if x == "hifp8":
        elem = TensorQuant("hifp8", rounding="ta")
        qk_tq = elem
    else:
        elem = TensorQuant(x, rounding="ta", scale_mode="floor")
        qk_tq = TensorQuant("mxfp8_e5m2", rounding="ta", scale_mode="floor")
    dy = TensorQuant("mxfp8_e5m2", rounding="ta", scale_mode="floor")
    lin = LinearQuant(fprop=GemmQuant(elem, elem), dgrad=GemmQuant(dy, None), wgrad=HIGH)
    att = AttentionQuant(qk=MatmulQuant(forward=GemmQuant(qk_tq, qk_tq)), pv=MatmulQuant(forward=GemmQuant(elem, elem)))
    return (Rule(linear=lin, attention=att),)


def generate(name: str) -> Scheme | None:
    """The preset called ``name`` built in code (exact spelling), or None when no preset has that name."""
    if name == "bf16":
        return Scheme("bf16", "nothing quantized: every GEMM in high precision (capture still works)")
    if name.startswith("legacy_"):
        base = name[len("legacy_"):]
        if base not in PREDECESSOR_NAMES:
            return None
        if base == "bf16":
            return Scheme(name, "predecessor's bf16: nothing quantized")
        x = base.rsplit("_", 1)[1]
        return Scheme(
            name,
            f"what the predecessor effectively computed for {base}: linear and attention QK^T/PV, forward GEMMs "
            f"only, {x} (QK^T and dgrad dY in MX-E5M2 where noted), rounding ties-away, MX scale floor",
            legacy_rules(x),
        )
    for prefix in sorted(_PREFIXES, key=len, reverse=True):
        if name.startswith(prefix + "_"):
            x = name[len(prefix) + 1:]
            if x in format_names():
                return Scheme(name, _describe(prefix, x), _rules(prefix, TensorQuant(x)))
    return None


def all_names() -> list[str]:
    """Every preset name: bf16, then per format X the six families, then the legacy presets."""
    out = ["bf16"]
    for x in format_names():
        out.extend(f"{p}_{x}" for p in _PREFIXES)
    out.extend(f"legacy_{n}" for n in PREDECESSOR_NAMES)
    return out
