"""Global layer numbering (pipeline stages): ``fxquant.compile(..., layer_offset=, num_layers=)`` and the
automatic numbering from Megatron-style ``layer_number`` attributes; scheme layer selectors, explain and
capture records see global indices. The two-process Megatron PP=2 run is in test_tp_compile.py."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import fxquant
from fxquant import capture, schemes
from fxquant.passes.layers import LayerNumbering
from tests.models import make_llama, make_tokens, next_token_loss

# Quantize global layer 2 only; keep the last layer (of 4) in high precision even if a rule selected it.
SCHEME = schemes.Scheme.from_yaml_text("""
name: stage
rules:
  - match: {layers: [2, 3]}
    linear: mxfp8
  - match: {last_layers: 1}
    priority: 1
    linear: none
""", "stage.yaml")


def test_layer_offset_makes_sites_selectors_and_capture_global(tmp_path):
    model = make_llama()  # layers.0, layers.1: the second stage (global layers 2, 3) of a 4-layer model
    tokens = make_tokens(model.cfg)
    spec = capture.load_spec("t.yaml", text="""
sections:
  - layers: {kinds: [fc2], indices: [3]}
    points: [{component: linear, roles: [input]}]
""")
    compiled = fxquant.compile(model, SCHEME, backend="aot_eager", strict=True, capture=spec,
                               capture_dir=tmp_path, layer_offset=2, num_layers=4)
    next_token_loss(compiled(tokens), tokens).backward()
    fxquant.compile_state(compiled).capture_session.close()
    sites = {s.site.module_path: s for s in fxquant.compile_state(compiled).sites()}
    assert sites["layers.0.mlp.down_proj"].site.layer == 2 and sites["layers.1.mlp.down_proj"].site.layer == 3
    assert sites["layers.0.mlp.down_proj"].status.value == "rewritten"
    assert not sites["layers.1.mlp.down_proj"].selected  # global layer 3 is the last of 4
    assert sites["layers.0.mlp.down_proj"].site.num_layers == 4
    (rec,) = capture.open(tmp_path).query(role="input")
    assert rec.module == "layers.1.mlp.down_proj" and rec.layer == 3
    table = str(fxquant.explain(make_llama(), tokens, scheme=SCHEME, layer_offset=2, num_layers=4))
    assert any(row.split()[:2] == ["layers.1.mlp.down_proj", "3"] for row in table.splitlines())


def test_without_the_offset_the_selector_matches_nothing(caplog):
    """The rule error alone: no warning about what the failed call compiled (it said 'compiled no graph')."""
    model = make_llama()
    compiled = fxquant.compile(model, SCHEME, backend="aot_eager")
    tokens = make_tokens(model.cfg)
    with pytest.raises(ValueError, match="match no site"), caplog.at_level("WARNING"):
        compiled(tokens)
    assert not [r for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("fxquant")]


class _Layer(nn.Module):
    def __init__(self, number: int):
        super().__init__()
        self.layer_number = number  # Megatron's TransformerLayer: 1-based, global across pipeline stages
        self.fc = nn.Linear(4, 4)


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(num_layers=8)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([_Layer(6), _Layer(7)])


def test_automatic_numbering_from_layer_number():
    numbering = LayerNumbering.of_model(_Stage())
    site = numbering.site("decoder.layers.1.fc")
    assert (site.layer, site.num_layers) == (6, 8)
    assert numbering.site("embedding").layer is None
    explicit = LayerNumbering.of_model(_Stage(), layer_offset=1)  # an explicit offset wins over layer_number
    assert explicit.site("decoder.layers.1.fc").layer == 2
    assert LayerNumbering.of_model(make_llama()).site("layers.1.attn").layer == 1  # no layer_number: local


@pytest.mark.parametrize("kwargs, match", [
    ({"layer_offset": -1}, "layer_offset=-1"), ({"layer_offset": 1.5}, "layer_offset=1.5"),
    ({"num_layers": 0}, "num_layers=0"), ({"layer_offset": 2, "num_layers": 3}, "global index 3"),
])
def test_bad_numbering_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fxquant.compile(make_llama(), "bf16", backend="aot_eager", **kwargs)


class _MaskedLM(nn.Module):
    """BERT's shape of LM head: ``cls.predictions.decoder``, tied to the word embeddings (no head's name), and a
    second model whose untied head only ``get_output_embeddings()`` names (RoBERTa's ``lm_head.decoder``)."""

    def __init__(self, tied: bool):
        super().__init__()
        self.word_embeddings = nn.Embedding(64, 32)
        self.dense = nn.Linear(32, 32)
        self.cls = nn.Module()
        self.cls.predictions = nn.Module()
        self.cls.predictions.decoder = nn.Linear(32, 64)
        if tied:
            self.cls.predictions.decoder.weight = self.word_embeddings.weight

    def get_output_embeddings(self):
        return self.cls.predictions.decoder

    def forward(self, ids):
        return self.cls.predictions.decoder(torch.relu(self.dense(self.word_embeddings(ids))))


@pytest.mark.parametrize("tied", [True, False])
def test_lm_heads_without_a_heads_name_are_lm_heads(tied):
    """A tied or get_output_embeddings() head is kind lm_head: presets leave it in high precision, as they leave
    a head named lm_head (BERT's and RoBERTa's heads were quantized as plain linears)."""
    torch._dynamo.reset()
    model = _MaskedLM(tied)
    if not tied:
        model.get_output_embeddings = None  # found through the tied weight alone, or not at all
    numbering = LayerNumbering.of_model(model)
    head = "cls.predictions.decoder"
    assert (numbering.site(head).kind is schemes.SiteKind.LM_HEAD) is tied
    model = _MaskedLM(tied)  # with get_output_embeddings: found either way
    compiled = fxquant.compile(model, "linear_mxfp8", backend="aot_eager", strict=True)
    compiled(torch.randint(0, 64, (2, 8))).sum().backward()
    sites = {s.site.module_path: s for s in fxquant.compile_state(compiled).sites()}
    assert sites[head].site.kind is schemes.SiteKind.LM_HEAD and sites[head].status.value != "rewritten"
    assert sites["dense"].status.value == "rewritten"


class _FunctionalTiedHead(nn.Module):
    """A tied LM head written as ``F.linear(h, self.emb.weight)`` at the model's top level (no head module; the
    embedding's name is not a head's)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.dense = nn.Linear(32, 32)

    def forward(self, ids):
        return torch.nn.functional.linear(torch.relu(self.dense(self.emb(ids))), self.emb.weight)


class _FunctionalTiedHeadWritten(_FunctionalTiedHead):
    """The tied head with its weight as a keyword, or cast first."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, ids):
        h = torch.relu(self.dense(self.emb(ids)))
        if self.how == "keyword":
            return torch.nn.functional.linear(h, weight=self.emb.weight)
        if self.how == "all keywords":
            return torch.nn.functional.linear(input=h, weight=self.emb.weight)
        return torch.nn.functional.linear(h, self.emb.weight.to(h.dtype))


@pytest.mark.parametrize("how", ["positional", "keyword", "all keywords", "cast"])
def test_a_functional_linear_on_an_embeddings_weight_is_the_lm_head(how):
    """The site takes the path of the weight's owner ('emb'), which names no head: it was quantized as a plain
    linear by the linear_* presets; its weight being an nn.Embedding's makes it kind lm_head, whether the weight is
    passed positionally, as ``weight=`` or cast first (those two were a plain linear at path '', quantized)."""
    torch._dynamo.reset()
    model = _FunctionalTiedHead() if how == "positional" else _FunctionalTiedHeadWritten(how)
    compiled = fxquant.compile(model, "linear_mxfp8", backend="aot_eager", strict=True)
    compiled(torch.randint(0, 64, (2, 8))).sum().backward()
    sites = {s.site.module_path: s for s in fxquant.compile_state(compiled).sites()}
    assert sites["emb"].site.kind is schemes.SiteKind.LM_HEAD and sites["emb"].status.value == "high"
    assert sites["dense"].status.value == "rewritten" and set(sites) == {"emb", "dense"}


@pytest.mark.parametrize("rule, kept", [
    ("{layers: [0]}", ()),  # the first stage's layer: nothing here, not an error
    ("{first_layers: 1}", ()),
    ("{layers: [3]}", ("layers.1",)),  # global layer 3 is this stage's layers.1
    ("{modules: 'layers\\.3\\..*'}", ("layers.1",)),  # a modules regex names the global path
    ("{modules: 'layers\\.0\\..*'}", ()),  # ... so the first stage's layers.0 is not this stage's
])
def test_rules_on_a_pipeline_stage_select_global_layers(rule, kept):
    """A stage holding global layers 2 and 3 of 4 (local paths layers.0, layers.1): a rule that selects only
    other stages' layers is no error (the check raised 'match no site' on every stage but the right one), and a
    ``modules`` regex matches the global path (it matched the stage-local one: another layer than meant)."""
    scheme = schemes.Scheme.from_yaml_text(f"name: s\nrules:\n  - linear: mxfp8\n  - match: {rule}\n    linear: none\n",
                                           "s.yaml")
    model = make_llama()
    tokens = make_tokens(model.cfg)
    compiled = fxquant.compile(model, scheme, backend="aot_eager", strict=True, layer_offset=2, num_layers=4)
    next_token_loss(compiled(tokens), tokens).backward()
    sites = fxquant.compile_state(compiled).sites()
    high = sorted({s.site.module_path.split(".mlp")[0].split(".self_attn")[0] for s in sites
                   if s.site.kind.value != "attention" and s.site.layer is not None and not s.selected})
    assert tuple(high) == kept
    sel = [s for s in sites if s.site.module_path == "layers.1.mlp.down_proj"][0]
    assert sel.site.global_path == "layers.3.mlp.down_proj" and sel.site.layer == 3


def test_a_rule_no_stage_can_match_is_still_an_error():
    scheme = schemes.Scheme.from_yaml_text("name: s\nrules:\n  - linear: mxfp8\n  - match: {layers: [7]}\n"
                                           "    linear: none\n", "s.yaml")
    model = make_llama()
    compiled = fxquant.compile(model, scheme, backend="aot_eager", layer_offset=2, num_layers=4)
    with pytest.raises(ValueError, match="match no site"):
        compiled(make_tokens(model.cfg))



class _RelativeLogits(nn.Module):
    """An embedding's weight multiplied inside a layer (relative-position logits), not a head."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].rel = nn.Embedding(16, 32)
        self.layers[0].attn = nn.Linear(32, 32)

    def forward(self, x):
        h = self.layers[0].attn(x)
        return torch.nn.functional.linear(h, self.layers[0].rel.weight)


def test_an_embeddings_weight_inside_a_layer_is_not_the_lm_head():
    """The identity rule applies outside the layer stack only: inside a layer such a GEMM stays a linear site and
    is quantized (it became an LM head, kept in high precision without a word)."""
    torch._dynamo.reset()
    compiled = fxquant.compile(_RelativeLogits(), "linear_mxfp8", backend="aot_eager", strict=True)
    compiled(torch.randn(4, 32)).sum().backward()
    kinds = {s.site.module_path: (s.site.kind.value, s.status.value) for s in fxquant.compile_state(compiled).sites()}
    assert kinds == {"layers.0.attn": ("linear", "rewritten"), "layers.0.rel": ("linear", "rewritten")}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc1(x)


class _EncoderDecoder(nn.Module):
    """Two layer stacks of different depths, as T5 names them (encoder.block.N, decoder.block.N)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = nn.Module(), nn.Module()
        self.encoder.block = nn.ModuleList(_Block() for _ in range(4))
        self.decoder.block = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x):
        for block in [*self.encoder.block, *self.decoder.block]:
            x = block(x)
        return x


@pytest.mark.parametrize("selector", ["{last_layers: 1}", "{layers: [-1]}", "{layers: ['-1..-1']}"])
def test_last_layers_count_within_each_stack(selector):
    """An encoder-decoder's stacks are counted on their own: the last block of each is selected (only the
    deeper stack's was, against one count of 4 for both)."""
    scheme = schemes.Scheme.from_yaml_text(f"rules:\n  - match: {selector}\n    linear: mxfp8\n", "last.yaml")
    explained = fxquant.explain(_EncoderDecoder(), torch.randn(2, 16), scheme=scheme)
    assert sorted(s.site.module_path for s in explained.selected) == ["decoder.block.1.fc1", "encoder.block.3.fc1"]
    first = schemes.Scheme.from_yaml_text("rules:\n  - match: {first_layers: 1}\n    linear: mxfp8\n", "first.yaml")
    explained = fxquant.explain(_EncoderDecoder(), torch.randn(2, 16), scheme=first)
    assert sorted(s.site.module_path for s in explained.selected) == ["decoder.block.0.fc1", "encoder.block.0.fc1"]
