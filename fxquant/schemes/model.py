"""What a scheme resolves to at one site: frozen dataclasses naming every GEMM operand's TensorQuant.

FORMATS.md "Which dimension is blocked" fixes the axes. A generic ``C = A @ B`` (A [.., M, K], B [.., K, N])
has three GEMMs, each with two operands, each blocked along that GEMM's reduction dimension:

    forward  C  = A @ B      (A, B)   along K      A dim -1, B dim -2
    grad_a   dA = dC @ B^T   (dC, B)  along N      dC dim -1, B dim -1
    grad_b   dB = A^T @ dC   (A, dC)  along M      A dim -2, dC dim -2

A linear ``Y = X W^T`` is that matmul with A = X and B = W^T; its GEMMs keep the names of FORMATS.md
(fprop (X, W), dgrad (dY, W), wgrad (dY, X)). Attention is two matmuls: ``qk`` (S = Q K^T) and ``pv``
(O = P V). ``None`` anywhere means "high precision" (the operand is not quantized).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from fxquant.formats.tensor_quant import TensorQuant


class SiteKind(str, enum.Enum):
    """What a matched site is; the selector ``kinds:`` of a scheme rule uses these values."""

    QKV = "qkv"  # query/key/value projection(s)
    PROJ = "proj"  # attention output projection
    FC1 = "fc1"  # MLP up (and gate) projection
    FC2 = "fc2"  # MLP down projection
    LM_HEAD = "lm_head"  # output layer (excluded unless selected explicitly)
    EMBEDDING = "embedding"  # embedding used as a GEMM operand (excluded unless selected explicitly)
    ROUTER = "router"  # MoE router / gate GEMM (excluded unless selected explicitly: it decides routing)
    LINEAR = "linear"  # any other linear
    ATTENTION = "attention"  # core attention (SDPA or unfused)

    @property
    def component(self) -> "Component":
        return Component.ATTENTION if self is SiteKind.ATTENTION else Component.LINEAR


class Component(str, enum.Enum):
    """The two kinds of quantized op a rule can configure."""

    LINEAR = "linear"
    ATTENTION = "attention"


EXPLICIT_ONLY_KINDS = frozenset({SiteKind.LM_HEAD, SiteKind.EMBEDDING, SiteKind.ROUTER})

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?=\.|$)")


def layer_stack(path: str) -> re.Match | None:
    """The outermost layer-stack part of a module path (``layers.N``, ``layer.N``, ``h.N``, ``blocks.N``,
    ``block.N``; group 1 is N), or None: in T5's ``encoder.block.2.layer.1.DenseReluDense.wi`` the layer is block
    2 (``layer.1`` is a sub-layer of that block)."""
    return _LAYER_RE.search(path)


@dataclass(frozen=True)
class Site:
    """One matched op in a model: its module path (``decoder.layers.0.self_attention.linear_qkv``), kind,
    layer index (None outside the layer stack) and the number of layers of the stack (for ``last_layers``
    and negative layer indices)."""

    module_path: str
    kind: SiteKind
    layer: int | None = None
    num_layers: int | None = None
    # the path with its layer stack's index made global (a pipeline stage's stack restarts at 0): what a rule's
    # ``modules`` regex matches; None when it is ``module_path``
    global_path: str | None = field(default=None, compare=False)

    @property
    def rule_path(self) -> str:
        """The path a rule's ``modules`` regex matches: global across pipeline stages."""
        return self.module_path if self.global_path is None else self.global_path

    def __post_init__(self) -> None:
        if not isinstance(self.module_path, str):
            raise TypeError(f"Site.module_path must be a str, got {type(self.module_path).__name__}")
        if not isinstance(self.kind, SiteKind):
            object.__setattr__(self, "kind", parse_kind(self.kind))
        for name in ("layer", "num_layers"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"Site.{name} must be a non-negative int or None, got {v!r}")

    @classmethod
    def from_path(cls, module_path: str, kind: SiteKind | str | None = None, num_layers: int | None = None) -> "Site":
        """A site whose layer index is read from the outermost ``layers.N`` (also ``h.N``, ``blocks.N``, ...) in the
        path (``layer_stack``) and whose
        kind, when not given, is guessed from the module name (``site_kind_for``)."""
        m = layer_stack(module_path)
        layer = int(m.group(1)) if m else None
        k = site_kind_for(module_path) if kind is None else parse_kind(kind)
        return cls(module_path, k, layer, num_layers)


def parse_kind(kind: object) -> SiteKind:
    from fxquant.formats.options import parse_enum

    return parse_enum(SiteKind, kind, "kind")


# Last path component -> kind, for Megatron-core, Hugging Face (Llama, Mistral, Qwen, GPT-2, GPT-NeoX / Falcon /
# BLOOM, InternLM2's wqkv, MPT's Wqkv) and nanoGPT names.
_KIND_BY_NAME = {
    "linear_qkv": SiteKind.QKV, "q_proj": SiteKind.QKV, "k_proj": SiteKind.QKV, "v_proj": SiteKind.QKV,
    "qkv_proj": SiteKind.QKV, "qkv": SiteKind.QKV, "wq": SiteKind.QKV, "wk": SiteKind.QKV, "wv": SiteKind.QKV,
    "wqkv": SiteKind.QKV, "Wqkv": SiteKind.QKV,
    "c_attn": SiteKind.QKV, "linear_q": SiteKind.QKV, "linear_kv": SiteKind.QKV, "query_key_value": SiteKind.QKV,
    "dense_h_to_4h": SiteKind.FC1, "dense_4h_to_h": SiteKind.FC2,  # GPT-NeoX, Falcon, BLOOM
    "linear_q_proj": SiteKind.QKV, "linear_kv_down_proj": SiteKind.QKV, "linear_kv_up_proj": SiteKind.QKV,
    "linear_q_down_proj": SiteKind.QKV, "linear_q_up_proj": SiteKind.QKV,
    "linear_proj": SiteKind.PROJ, "o_proj": SiteKind.PROJ, "out_proj": SiteKind.PROJ, "wo": SiteKind.PROJ,
    "linear_fc1": SiteKind.FC1, "gate_proj": SiteKind.FC1, "up_proj": SiteKind.FC1, "c_fc": SiteKind.FC1,
    "w1": SiteKind.FC1, "w3": SiteKind.FC1, "gate_up_proj": SiteKind.FC1, "fc1": SiteKind.FC1,
    "linear_fc2": SiteKind.FC2, "down_proj": SiteKind.FC2, "w2": SiteKind.FC2, "fc2": SiteKind.FC2,
    "output_layer": SiteKind.LM_HEAD, "lm_head": SiteKind.LM_HEAD,
    "word_embeddings": SiteKind.EMBEDDING, "embed_tokens": SiteKind.EMBEDDING, "wte": SiteKind.EMBEDDING,
    "embedding": SiteKind.EMBEDDING, "tok_embeddings": SiteKind.EMBEDDING,
    "core_attention": SiteKind.ATTENTION,
    "router": SiteKind.ROUTER, "gate": SiteKind.ROUTER,  # Megatron MoE router; HF Mixtral / DeepSeek `mlp.gate`
}
# Module names with a kind only as a child of the model's root: torchtitan's and Meta Llama's LM head is
# ``output``, a name that nested modules use for other things (Hugging Face BERT's ``layer.N.output.dense``).
_ROOT_KIND_BY_NAME = {"output": SiteKind.LM_HEAD}
_ATTN_PARENTS = ("attn", "attention", "self_attn", "self_attention")
# T5's names, by parent module: attention ``SelfAttention`` / ``EncDecAttention`` with children q, k, v, o; the
# feed-forward ``DenseReluDense`` with wi (or gated wi_0, wi_1) and wo (elsewhere, Meta Llama's ``attention.wo``).
_KIND_BY_PARENT = {
    "SelfAttention": {"q": SiteKind.QKV, "k": SiteKind.QKV, "v": SiteKind.QKV, "o": SiteKind.PROJ},
    "EncDecAttention": {"q": SiteKind.QKV, "k": SiteKind.QKV, "v": SiteKind.QKV, "o": SiteKind.PROJ},
    "DenseReluDense": {"wi": SiteKind.FC1, "wi_0": SiteKind.FC1, "wi_1": SiteKind.FC1, "wo": SiteKind.FC2},
}


def site_kind_for(module_path: str) -> SiteKind:
    """Guess a linear site's kind from its module path; ``LINEAR`` when the name is not a known one.

    GPT-2's ``c_proj`` is the attention projection under ``attn`` and FC2 under ``mlp``; ``output`` is the
    LM head at the model's root only; T5's names are read with their parent's (``_KIND_BY_PARENT``), BERT's and
    GPT-NeoX's ``dense`` / ``query`` with their parent's and grandparent's (``_bert_kind``).
    """
    parts = module_path.split(".")
    last = parts[-1] if parts else ""
    if len(parts) == 1 and last in _ROOT_KIND_BY_NAME:
        return _ROOT_KIND_BY_NAME[last]
    by_parent = _KIND_BY_PARENT.get(parts[-2]) if len(parts) > 1 else None
    if by_parent is not None and last in by_parent:
        return by_parent[last]
    if last == "c_proj":
        return SiteKind.PROJ if len(parts) > 1 and parts[-2] in _ATTN_PARENTS else SiteKind.FC2
    bert = _bert_kind(parts)
    return bert if bert is not None else _KIND_BY_NAME.get(last, SiteKind.LINEAR)


def _bert_kind(parts: list[str]) -> SiteKind | None:
    """BERT's (RoBERTa's, ViT's) names: ``attention.self.query`` (ViT: ``attention.attention.query``),
    ``attention.output.dense`` (the projection), ``intermediate.dense`` (FC1), ``layer.N.output.dense`` (FC2); and
    GPT-NeoX's / Falcon's ``attention.dense`` / ``self_attention.dense`` (the projection)."""
    if len(parts) < 2:
        return None
    last, parent = parts[-1], parts[-2]
    grand = parts[-3] if len(parts) > 2 else None
    if last in ("query", "key", "value") and parent in ("self", "attention") and grand == "attention":
        return SiteKind.QKV
    if last != "dense":
        return None
    if parent in _ATTN_PARENTS:
        return SiteKind.PROJ
    if parent == "intermediate":
        return SiteKind.FC1
    if parent == "output" and grand == "attention":
        return SiteKind.PROJ
    if parent == "output" and grand is not None and grand.isdigit():
        return SiteKind.FC2
    return None


# -- what one site resolves to ----------------------------------------------------------------------------
def _check_fields(obj: object, names: tuple[str, ...], cls: type) -> None:
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, cls):
            raise TypeError(f"{type(obj).__name__}.{name} must be a {cls.__name__}, got {type(v).__name__}")


@dataclass(frozen=True)
class GemmQuant:
    """The two operands of one GEMM, each quantized per its TensorQuant or kept in high precision (None)."""

    a: TensorQuant | None = None
    b: TensorQuant | None = None

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, TensorQuant):
                raise TypeError(f"GemmQuant.{name} must be a TensorQuant or None, got {type(v).__name__}")

    @property
    def quantized(self) -> bool:
        return self.a is not None or self.b is not None

    def swapped(self) -> "GemmQuant":
        return GemmQuant(self.b, self.a)


HIGH = GemmQuant()


@dataclass(frozen=True)
class MatmulQuant:
    """``C = A @ B`` with its three GEMMs: forward (A, B), grad_a (dC, B), grad_b (A, dC)."""

    forward: GemmQuant = HIGH
    grad_a: GemmQuant = HIGH
    grad_b: GemmQuant = HIGH

    def __post_init__(self) -> None:
        _check_fields(self, ("forward", "grad_a", "grad_b"), GemmQuant)

    @property
    def quantized(self) -> bool:
        return self.forward.quantized or self.grad_a.quantized or self.grad_b.quantized

    def transposed(self) -> "MatmulQuant":
        """The MatmulQuant of ``C^T = B^T @ A^T`` that quantizes exactly the same operands along the same axes."""
        return MatmulQuant(self.forward.swapped(), self.grad_b.swapped(), self.grad_a.swapped())


@dataclass(frozen=True)
class LinearQuant:
    """``Y = X W^T`` (+ bias in high precision), named as FORMATS.md does:
    fprop (a=X, b=W) along K; dgrad ``dX = dY W`` (a=dY, b=W) along N; wgrad ``dW = dY^T X`` (a=dY, b=X) along M."""

    fprop: GemmQuant = HIGH
    dgrad: GemmQuant = HIGH
    wgrad: GemmQuant = HIGH

    def __post_init__(self) -> None:
        _check_fields(self, ("fprop", "dgrad", "wgrad"), GemmQuant)

    @property
    def quantized(self) -> bool:
        return self.fprop.quantized or self.dgrad.quantized or self.wgrad.quantized

    def as_matmul(self) -> MatmulQuant:
        """As ``C = A @ B`` with A = X, B = W^T: grad_a is dgrad; grad_b (dB = dW^T = X^T dY) is wgrad swapped."""
        return MatmulQuant(self.fprop, self.dgrad, self.wgrad.swapped())


@dataclass(frozen=True)
class AttentionQuant:
    """Attention's two matmuls. ``qk``: S = Q K^T (forward (Q, K) along d; grad_a dQ = dS K (dS, K) along Lk;
    grad_b dK = dS^T Q (Q, dS) along Lq). ``pv``: O = P V (forward (P, V) along Lk; grad_a dP = dO V^T (dO, V)
    along d; grad_b dV = P^T dO (P, dO) along Lq)."""

    qk: MatmulQuant = MatmulQuant()
    pv: MatmulQuant = MatmulQuant()

    def __post_init__(self) -> None:
        _check_fields(self, ("qk", "pv"), MatmulQuant)

    @property
    def quantized(self) -> bool:
        return self.qk.quantized or self.pv.quantized


# -- operand tables: (gemm, operand) names as the YAML and describe() spell them ------------------------------
# Linear GEMMs -> (field, operand names (a, b)).
LINEAR_GEMMS: dict[str, tuple[str, str]] = {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("dy", "x")}
# Attention GEMMs -> (matmul, GEMM of that matmul, operand names in the order (a, b) of that GemmQuant).
ATTENTION_GEMMS: dict[str, tuple[str, str, tuple[str, str]]] = {
    "qk": ("qk", "forward", ("q", "k")),
    "dq": ("qk", "grad_a", ("ds", "k")),
    "dk": ("qk", "grad_b", ("q", "ds")),
    "pv": ("pv", "forward", ("p", "v")),
    "dp": ("pv", "grad_a", ("do", "v")),
    "dv": ("pv", "grad_b", ("p", "do")),
}


def linear_operands(lq: LinearQuant) -> dict[str, dict[str, TensorQuant | None]]:
    """``{"fprop": {"x": tq, "w": tq}, ...}``: the operand table of a LinearQuant."""
    out = {}
    for gemm, (an, bn) in LINEAR_GEMMS.items():
        g = getattr(lq, gemm)
        out[gemm] = {an: g.a, bn: g.b}
    return out


def attention_operands(aq: AttentionQuant) -> dict[str, dict[str, TensorQuant | None]]:
    """``{"qk": {"q": tq, "k": tq}, "dq": {"ds": .., "k": ..}, ...}``: the operand table of an AttentionQuant."""
    out = {}
    for gemm, (mm, field_, (an, bn)) in ATTENTION_GEMMS.items():
        g = getattr(getattr(aq, mm), field_)
        out[gemm] = {an: g.a, bn: g.b}
    return out


def linear_from_operands(table: dict[str, dict[str, TensorQuant | None]]) -> LinearQuant:
    kw = {}
    for gemm, (an, bn) in LINEAR_GEMMS.items():
        ops = table.get(gemm, {})
        kw[gemm] = GemmQuant(ops.get(an), ops.get(bn))
    return LinearQuant(**kw)


def attention_from_operands(table: dict[str, dict[str, TensorQuant | None]]) -> AttentionQuant:
    mms: dict[str, dict[str, GemmQuant]] = {"qk": {}, "pv": {}}
    for gemm, (mm, field_, (an, bn)) in ATTENTION_GEMMS.items():
        ops = table.get(gemm, {})
        mms[mm][field_] = GemmQuant(ops.get(an), ops.get(bn))
    return AttentionQuant(MatmulQuant(**mms["qk"]), MatmulQuant(**mms["pv"]))
