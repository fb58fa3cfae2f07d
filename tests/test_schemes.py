"""fxquant.schemes: presets (what each name quantizes), rule resolution, selectors, unmatched rules."""
from __future__ import annotations

import pytest

from fxquant import formats, schemes
from fxquant.formats.tensor_quant import TensorQuant
from fxquant.schemes import (
    AttentionQuant,
    GemmQuant,
    LayerSpan,
    LinearQuant,
    MatmulQuant,
    Rule,
    Scheme,
    Selector,
    Site,
    SiteKind,
)
from fxquant.schemes.model import attention_operands, linear_operands, site_kind_for
from fxquant.schemes.presets import PREDECESSOR_NAMES, generate

N_LAYERS = 4
LINEAR_SITES = [
    Site.from_path(f"decoder.layers.{i}.{p}", num_layers=N_LAYERS)
    for i in range(N_LAYERS)
    for p in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
]
ATTN_SITES = [Site(f"decoder.layers.{i}.self_attention.core_attention", SiteKind.ATTENTION, i, N_LAYERS) for i in range(N_LAYERS)]
HEAD = Site.from_path("output_layer", num_layers=N_LAYERS)
EMB = Site.from_path("embedding.word_embeddings", num_layers=N_LAYERS)
SITES = LINEAR_SITES + ATTN_SITES + [HEAD, EMB]

LINEAR_OPERANDS = {("fprop", "x"), ("fprop", "w"), ("dgrad", "dy"), ("dgrad", "w"), ("wgrad", "dy"), ("wgrad", "x")}
QK_OPERANDS = {("qk", "q"), ("qk", "k"), ("dq", "ds"), ("dq", "k"), ("dk", "ds"), ("dk", "q")}
PV_OPERANDS = {("pv", "p"), ("pv", "v"), ("dp", "do"), ("dp", "v"), ("dv", "p"), ("dv", "do")}


def quantized_operands(table: dict) -> dict[tuple[str, str], TensorQuant]:
    return {(g, o): tq for g, ops in table.items() for o, tq in ops.items() if tq is not None}


def expected_from_name(name: str) -> tuple[set, set, str | None]:
    """(linear operands, attention operands, format) that a preset's name promises, derived from the name."""
    for prefix, lin, att in (
        ("FA_linear_", LINEAR_OPERANDS, QK_OPERANDS),
        ("FA_QKPV_", set(), QK_OPERANDS | PV_OPERANDS),
        ("FA_QK_", set(), QK_OPERANDS),
        ("FA_PV_", set(), PV_OPERANDS),
        ("FA_", set(), QK_OPERANDS),
        ("linear_", LINEAR_OPERANDS, set()),
    ):
        if name.startswith(prefix):
            return lin, att, name[len(prefix):]
    assert name == "bf16", name
    return set(), set(), None


def test_site_parsing() -> None:
    s = Site.from_path("decoder.layers.3.mlp.linear_fc2", num_layers=8)
    assert (s.kind, s.layer, s.num_layers) == (SiteKind.FC2, 3, 8)
    assert Site.from_path("model.layers.0.self_attn.q_proj").kind is SiteKind.QKV
    assert Site.from_path("model.layers.0.attention.wqkv").kind is SiteKind.QKV  # InternLM2
    assert Site.from_path("transformer.blocks.0.attn.Wqkv").kind is SiteKind.QKV  # MPT
    assert Site.from_path("transformer.h.5.attn.c_proj").kind is SiteKind.PROJ
    assert Site.from_path("transformer.h.5.mlp.c_proj").kind is SiteKind.FC2
    assert Site.from_path("lm_head").kind is SiteKind.LM_HEAD
    assert Site.from_path("lm_head").layer is None
    assert Site.from_path("encoder.my_linear").kind is SiteKind.LINEAR
    with pytest.raises(ValueError, match=r"kind='fc3'.*did you mean 'fc\d'"):
        Site("x", "fc3")


def test_names_cover_every_format_and_family() -> None:
    names = schemes.names()
    assert len(names) == len(set(names))
    for x in formats.names() + list(formats.aliases()):
        for p in ("linear", "FA", "FA_QK", "FA_PV", "FA_QKPV", "FA_linear"):
            assert f"{p}_{x}" in names
    for n in PREDECESSOR_NAMES:
        assert n in names and f"legacy_{n}" in names


@pytest.mark.parametrize("name", [n for n in schemes.names() if not n.startswith("legacy_")])
def test_preset_quantizes_exactly_what_its_name_says(name: str) -> None:
    scheme = schemes.get(name)
    lin_exp, att_exp, x = expected_from_name(name)
    tq = None if x is None else TensorQuant(x)
    for site in LINEAR_SITES:
        lq = scheme.linear_for(site)
        got = {} if lq is None else quantized_operands(linear_operands(lq))
        assert set(got) == lin_exp, (name, site)
        assert all(v == tq for v in got.values())
    for site in ATTN_SITES:
        aq = scheme.attention_for(site)
        got = {} if aq is None else quantized_operands(attention_operands(aq))
        assert set(got) == att_exp, (name, site)
        assert all(v == tq for v in got.values())
    # LM head and embeddings are never selected by a preset
    assert scheme.linear_for(HEAD) is None and scheme.linear_for(EMB) is None


def test_mxfp8_is_e4m3_everywhere_and_aliases_agree() -> None:
    s = schemes.get("linear_mxfp8")
    lq = s.linear_for(LINEAR_SITES[0])
    assert {tq.format for tq in quantized_operands(linear_operands(lq)).values()} == {"mxfp8_e4m3"}
    assert s.rules == schemes.get("linear_mxfp8_e4m3").rules
    assert schemes.get("FA_hif8").rules == schemes.get("FA_hifp8").rules
    assert schemes.get("FA_QK_mxfp4").rules == schemes.get("FA_mxfp4").rules


def test_shipped_yaml_equals_generated() -> None:
    files = sorted(p.stem for p in schemes.preset_dir().glob("*.yaml"))
    assert files == sorted(PREDECESSOR_NAMES)
    for n in PREDECESSOR_NAMES:
        from_file = Scheme.from_yaml(schemes.preset_dir() / f"{n}.yaml")
        assert from_file == generate(n), n
        assert schemes.get(n) == from_file and schemes.get(n).source is not None


@pytest.mark.parametrize("x", ["mxfp8", "mxfp4", "hifp8"])
def test_legacy_presets(x: str) -> None:
    schemes_ = [schemes.get(f"legacy_{p}_{x}") for p in ("FA", "linear", "FA_linear")]
    # the predecessor's quant type was one edited literal: all three names computed the same thing
    assert schemes_[0].rules == schemes_[1].rules == schemes_[2].rules
    lq = schemes_[0].linear_for(LINEAR_SITES[5])
    aq = schemes_[0].attention_for(ATTN_SITES[1])
    elem = TensorQuant(x, rounding="ta") if x == "hifp8" else TensorQuant(x, rounding="ta", scale_mode="floor")
    e5m2 = TensorQuant("mxfp8_e5m2", rounding="ta", scale_mode="floor")
    assert lq == LinearQuant(fprop=GemmQuant(elem, elem), dgrad=GemmQuant(e5m2, None))
    qk = elem if x == "hifp8" else e5m2
    assert aq == AttentionQuant(qk=MatmulQuant(GemmQuant(qk, qk)), pv=MatmulQuant(GemmQuant(elem, elem)))
    assert all(tq.options.rounding.value == "ta" for tq in quantized_operands(linear_operands(lq)).values())
    assert schemes.get("legacy_bf16").rules == ()
    assert "forward GEMMs only" in schemes_[0].description


def test_get_errors_and_case() -> None:
    assert schemes.get("fa_linear_MXFP8").name == "FA_linear_mxfp8"
    with pytest.raises(ValueError, match=r"unknown scheme 'FA_mxfp9' \(did you mean 'FA_mxfp8'\?\)"):
        schemes.get("FA_mxfp9")
    with pytest.raises(ValueError, match="linear_hifp8"):  # the message lists the predecessor's names
        schemes.get("nonsense")
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        schemes.get("/no/such/dir/missing.yaml")
    with pytest.raises(TypeError, match="preset name"):
        schemes.get(3)  # type: ignore[arg-type]



def test_a_preset_name_wins_over_a_file_of_that_name_in_the_working_directory(tmp_path, monkeypatch) -> None:
    """A log written as `tee FA_linear_mxfp8` does not hide the preset; ./NAME, a path with a "/", reads the file,
    and a name that is no preset reads the file of that name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FA_linear_mxfp8").write_text("step 1 loss 3.2\n")
    assert schemes.get("FA_linear_mxfp8") == generate("FA_linear_mxfp8")
    with pytest.raises(schemes.SchemeError, match="expected a mapping"):
        schemes.get("./FA_linear_mxfp8")
    (tmp_path / "mine").write_text(generate("linear_hifp8").to_yaml().replace("name: linear_hifp8", "name: mine"))
    assert schemes.get("mine").name == "mine"


def test_scheme_and_spec_errors_survive_pickle_and_deepcopy() -> None:
    """A worker process's scheme or capture-spec error reaches its parent whole (problems and message): pickle
    rebuilds it from ``__reduce__``, as deepcopy does."""
    import copy

    from fxquant.capture._yaml import SpecError

    for err in (schemes.SchemeError("s.yaml", ["s.yaml:1: (top): bad", "s.yaml:2: rules: worse"]),
                SpecError(["spec.yaml:3: sites: bad"])):
        build, args = err.__reduce__()
        for back in (build(*args), copy.deepcopy(err)):
            assert type(back) is type(err) and back.problems == err.problems and str(back) == str(err)
    assert copy.deepcopy(schemes.SchemeError("s.yaml", ["x"])).source == "s.yaml"


# -- resolution --------------------------------------------------------------------------------------------
M8, M4, HI = TensorQuant("mxfp8"), TensorQuant("mxfp4"), TensorQuant("hifp8")


def lin(tq):
    return LinearQuant(GemmQuant(tq, tq), GemmQuant(tq, tq), GemmQuant(tq, tq))


def test_specificity_order_and_ties() -> None:
    rules = (
        Rule(Selector(), linear=lin(M8)),
        Rule(Selector(kinds=(SiteKind.FC1,)), linear=lin(M4)),
        Rule(Selector(first_layers=1, last_layers=1), linear=LinearQuant()),
        Rule(Selector(modules=r"decoder\.layers\.0\.mlp\.linear_fc1"), linear=lin(HI)),
        Rule(Selector(kinds=(SiteKind.QKV,)), linear=lin(HI)),  # later among equals wins over rule 1? no: other kind
    )
    s = Scheme("t", rules=rules)
    site = {(x.layer, x.kind): x for x in LINEAR_SITES}
    assert s.linear_for(site[1, SiteKind.FC2]) == lin(M8)  # only the catch-all
    assert s.linear_for(site[1, SiteKind.FC1]) == lin(M4)  # kinds beats no selector
    assert s.linear_for(site[0, SiteKind.FC2]) is None  # layers beats kinds and catch-all: high precision
    assert s.linear_for(site[3, SiteKind.FC1]) is None  # last layer
    assert s.linear_for(site[0, SiteKind.FC1]) == lin(HI)  # modules beats layers
    assert s.rule_for(site[0, SiteKind.FC2]) is rules[2]
    # ties go to the later rule; priority overrides specificity
    tie = Scheme("t", rules=(Rule(Selector(kinds=(SiteKind.FC1,)), linear=lin(M8)), Rule(Selector(kinds=(SiteKind.FC1,)), linear=lin(M4))))
    assert tie.linear_for(site[1, SiteKind.FC1]) == lin(M4)
    prio = Scheme("t", rules=(Rule(Selector(), linear=lin(M8), priority=1), Rule(Selector(modules=".*"), linear=lin(M4))))
    assert prio.linear_for(site[2, SiteKind.QKV]) == lin(M8)


def test_root_output_is_the_lm_head_and_nested_output_is_not() -> None:
    """torchtitan / Meta Llama name the LM head ``output`` at the root; BERT's ``layer.N.output.dense`` is its FC2."""
    assert site_kind_for("output") is SiteKind.LM_HEAD
    assert site_kind_for("bert.encoder.layer.0.output.dense") is SiteKind.FC2
    for path in ("encoder.layer.3.output", "model.output", "output.dense"):
        assert site_kind_for(path) is SiteKind.LINEAR, path
    preset = schemes.get("linear_mxfp8")
    assert preset.linear_for(Site.from_path("output", num_layers=2)) is None  # presets never quantize the LM head
    assert preset.linear_for(Site.from_path("bert.encoder.layer.0.output.dense", num_layers=2)) is not None
    head = Scheme("head", rules=(Rule(Selector(kinds=(SiteKind.LM_HEAD,)), linear=lin(M8)),))
    assert head.linear_for(Site.from_path("output")) == lin(M8)


def test_bert_vit_and_neox_names_have_their_kinds() -> None:
    """BERT-style encoders (BERT, RoBERTa, ViT) name q/k/v ``query``/``key``/``value`` and their other linears
    ``dense`` under a telling parent; they were all kind ``linear``, so kind selectors (and capture specs such as
    ``predecessor``) missed them."""
    bert = "bert.encoder.layer.2"
    for path, kind in ((f"{bert}.attention.self.query", SiteKind.QKV), (f"{bert}.attention.self.value", SiteKind.QKV),
                       ("vit.encoder.layer.0.attention.attention.key", SiteKind.QKV),
                       (f"{bert}.attention.output.dense", SiteKind.PROJ), (f"{bert}.intermediate.dense", SiteKind.FC1),
                       (f"{bert}.output.dense", SiteKind.FC2), ("gpt_neox.layers.1.attention.dense", SiteKind.PROJ),
                       ("transformer.h.0.self_attention.dense", SiteKind.PROJ),
                       ("gpt_neox.layers.1.attention.query_key_value", SiteKind.QKV),
                       ("gpt_neox.layers.1.mlp.dense_h_to_4h", SiteKind.FC1),
                       ("gpt_neox.layers.1.mlp.dense_4h_to_h", SiteKind.FC2),
                       ("bert.pooler.dense", SiteKind.LINEAR), ("cls.predictions.transform.dense", SiteKind.LINEAR),
                       ("model.self.query", SiteKind.LINEAR)):
        assert site_kind_for(path) is kind, path


def test_t5_paths_number_their_block_and_name_their_kinds() -> None:
    """T5 nests sub-layers in blocks (``block.N.layer.M``): the layer is the block, the outermost stack, for a
    site and for the global numbering alike; its q/k/v/o, wi/wo names get their kinds from their parents."""
    from torch import nn

    from fxquant.passes.layers import LayerNumbering

    ffn = "encoder.block.2.layer.1.DenseReluDense"
    for path, kind in ((f"{ffn}.wi", SiteKind.FC1), (f"{ffn}.wi_0", SiteKind.FC1), (f"{ffn}.wo", SiteKind.FC2),
                       ("decoder.block.3.layer.1.EncDecAttention.q", SiteKind.QKV),
                       ("decoder.block.3.layer.0.SelfAttention.o", SiteKind.PROJ)):
        assert site_kind_for(path) is kind, path
        assert Site.from_path(path).layer == LayerNumbering().site(path).layer == int(path.split(".")[2]), path
    assert site_kind_for("layers.0.attention.wo") is SiteKind.PROJ  # Meta Llama's attention output keeps its kind
    model = nn.Module()
    model.encoder = nn.Module()
    model.encoder.block = nn.ModuleList(nn.Module() for _ in range(4))
    for b in model.encoder.block:
        b.layer = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    numbering = LayerNumbering.of_model(model)
    assert numbering.num_layers == 4 and numbering.site("encoder.block.3.layer.1").layer == 3
    first = Scheme("first", rules=(Rule(Selector(first_layers=1), linear=lin(M8)),))
    assert first.linear_for(numbering.site(f"{ffn.replace('block.2', 'block.0')}.wo")) == lin(M8)
    assert first.linear_for(numbering.site("encoder.block.1.layer.0.SelfAttention.q")) is None


def test_a_span_from_the_last_layers_to_the_first_ones_is_refused() -> None:
    for start, stop, spelled in ((-1, 2, "N-1..2"), (-3, 0, "N-3..0")):
        with pytest.raises(ValueError, match=rf"layer range {start}\.\.{stop} starts counted from the last .*"
                                             rf"\(here {spelled}\)"):
            LayerSpan(start, stop)
    assert LayerSpan(-3, -1).contains(5, 8) and LayerSpan(0, 2).contains(2, None)
    from_two = LayerSpan(2, -1)  # layer 2 to the last
    assert [from_two.contains(i, 6) for i in range(6)] == [False, False, True, True, True, True]
    assert not from_two.contains(3, None)  # the end needs num_layers


def test_layer_spans_and_negative_indices() -> None:
    sel = Selector(layers=(LayerSpan(1, 2), LayerSpan(-1, -1)))
    assert [sel.matches(Site("a.layers.0.b", SiteKind.FC1, i, 4)) for i in range(4)] == [False, True, True, True]
    assert not sel.matches(Site("a", SiteKind.FC1, 3, None))  # -1 needs num_layers
    assert not sel.matches(Site("a", SiteKind.FC1, None, 4))  # no layer: layer selectors do not match
    last2 = Selector(last_layers=2)
    assert [last2.matches(Site("a", SiteKind.FC1, i, 4)) for i in range(4)] == [False, False, True, True]


def test_selector_takes_kind_names_and_layer_indices_as_the_yaml_does() -> None:
    # kinds=("fc1",) failed later in Rule() ('str' object has no attribute 'component'), layers=(0,) in linear_for
    sel = Selector(kinds=["fc1", "FC2", SiteKind.FC1], layers=[0, "2..-1", " 3 ", LayerSpan(1, 1)])
    assert sel.kinds == (SiteKind.FC1, SiteKind.FC2)
    assert sel.layers == (LayerSpan(0, 0), LayerSpan(2, -1), LayerSpan(3, 3), LayerSpan(1, 1))
    assert sel == Scheme.from_yaml_text("rules:\n  - match: {kinds: [fc1, fc2], layers: [0, '2..-1', 3, 1]}\n"
                                        "    linear: mxfp8\n").rules[0].selector
    hash(sel)  # lists become tuples: a Selector stays hashable
    rule = Rule(Selector(kinds=("fc1",), layers=(0,)), linear=lin(M8))
    s = Scheme("s", rules=(rule,))
    assert [s.linear_for(site) is not None for site in LINEAR_SITES[:8]] == [False, False, True, False] + [False] * 4


@pytest.mark.parametrize(("kwargs", "error", "needle"), [
    ({"kinds": ("fc",)}, ValueError, "kind='fc' is not allowed; choose one of .* \\(did you mean 'fc2'\\?\\)"),
    ({"kinds": (3,)}, ValueError, "kind=3 is not allowed"),
    ({"kinds": "fc1"}, TypeError, "Selector.kinds must be a tuple \\(or list\\), e.g. kinds=\\('fc1', 'fc2'\\), got 'fc1'"),
    ({"layers": 0}, TypeError, "Selector.layers must be a tuple"),
    ({"layers": (0.5,)}, ValueError, "expected a layer index \\(0, -1\\) or a range .* got 0.5"),
    ({"layers": ("x",)}, ValueError, "expected a layer index"),
    ({"layers": ("5..2",)}, ValueError, "layer range 5..2 is empty: start must not exceed stop"),
    ({"layers": (True,)}, ValueError, "expected a layer index"),
    ({"modules": 3}, TypeError, "Selector.modules must be a regular expression string or None, got 3"),
])
def test_selector_refuses_what_is_no_kind_or_layer(kwargs: dict, error: type, needle: str) -> None:
    with pytest.raises(error, match=needle):
        Selector(**kwargs)


def test_lm_head_and_embedding_need_explicit_selection() -> None:
    base = (Rule(Selector(), linear=lin(M8)),)
    assert Scheme("a", rules=base).linear_for(HEAD) is None
    by_kind = Scheme("b", rules=base + (Rule(Selector(kinds=(SiteKind.LM_HEAD,)), linear=lin(HI)),))
    assert by_kind.linear_for(HEAD) == lin(HI) and by_kind.linear_for(EMB) is None
    by_path = Scheme("c", rules=base + (Rule(Selector(modules="embedding.*"), linear=lin(M4)),))
    assert by_path.linear_for(EMB) == lin(M4) and by_path.linear_for(HEAD) is None


def test_component_mismatch_raises() -> None:
    s = schemes.get("FA_linear_mxfp8")
    with pytest.raises(ValueError, match="not a linear kind"):
        s.linear_for(ATTN_SITES[0])
    with pytest.raises(ValueError, match="not 'attention'"):
        s.attention_for(LINEAR_SITES[0])


def test_unmatched_rules_with_suggestions() -> None:
    s = Scheme(
        "t",
        rules=(
            Rule(Selector(), linear=lin(M8)),
            Rule(Selector(modules=r"decoder\.layer\.0\.mlp\.linear_fc1"), linear=lin(M4)),  # typo: layer
            Rule(Selector(modules=r"linear_fc2"), linear=lin(M4)),  # needs .* to match the whole path
            Rule(Selector(layers=(LayerSpan(7, 9),)), linear=lin(HI)),
            Rule(Selector(kinds=(SiteKind.LM_HEAD,)), linear=lin(HI)),
        ),
    )
    bad = s.unmatched_rules(LINEAR_SITES + ATTN_SITES)
    assert [u.index for u in bad] == [1, 2, 3, 4]
    assert bad[0].nearest[0] == "decoder.layers.0.mlp.linear_fc1"
    assert "whole path" in bad[1].reason and all(p.endswith("linear_fc2") for p in bad[1].nearest)
    assert "layers are 0..3" in bad[2].reason
    assert "no site of kind lm_head" in str(bad[3])
    assert s.unmatched_rules(SITES)[-1].index == 3  # with the output layer present rule 4 matches
    attn_only = Scheme("a", rules=(Rule(attention=AttentionQuant(qk=MatmulQuant(GemmQuant(M8, M8)))),))
    assert "no attention sites" in attn_only.unmatched_rules(LINEAR_SITES)[0].reason
    assert schemes.get("FA_linear_hifp8").unmatched_rules(SITES) == []


def test_dataclass_validation() -> None:
    with pytest.raises(TypeError, match="GemmQuant.a must be a TensorQuant"):
        GemmQuant("mxfp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must configure"):
        Rule(Selector())
    for selector in (None, {"kinds": ["fc1"]}):
        with pytest.raises(TypeError, match=r"Rule.selector must be a Selector \(Selector\(\) selects every site\)"):
            Rule(selector, linear=lin(M8))  # type: ignore[arg-type]
    padded = Scheme(" mine ", "MXFP8 linears\n", (Rule(Selector(), linear=lin(M8)),))
    assert (padded.name, padded.description) == ("mine", "MXFP8 linears")
    assert Scheme.from_yaml_text(padded.to_yaml()) == padded
    with pytest.raises(ValueError, match="not a valid regular expression"):
        Selector(modules="layers.(")
    with pytest.raises(ValueError, match="first_layers=0"):
        Selector(first_layers=0)
    mq = MatmulQuant(GemmQuant(M8, HI), GemmQuant(M4, None), GemmQuant(None, HI))
    assert mq.transposed().transposed() == mq
    lq = LinearQuant(GemmQuant(M8, HI), GemmQuant(M4, None), GemmQuant(None, HI))
    assert lq.as_matmul().grad_b == GemmQuant(HI, None)  # dW^T = X^T dY: (x, dy)


def test_describe_lists_every_gemm() -> None:
    text = schemes.get("FA_linear_hifp8").describe()
    for gemm in ("fprop", "dgrad", "wgrad", "qk", "dq", "dk", "pv", "dp", "dv"):
        assert f" {gemm} " in text
    assert "ds=hifp8" in text and "p=-" in text
    assert "no rules" in schemes.get("bf16").describe()


def test_an_unmatched_rule_names_the_root_module_readably():
    """The root module's path is '' (a model that is itself an nn.Linear): shown by name, not as an empty entry."""
    from fxquant.schemes.rules import UnmatchedRule

    rule = schemes.get("linear_mxfp8").rules[0]
    text = str(UnmatchedRule(0, rule, ("", "fc"), "no module path matches"))
    assert text.endswith("nearest module paths: <the model itself>, fc")


def test_an_unmatched_rule_names_each_nearest_path_once():
    """explain passes the compiled sites and the model's possible sites together, so one path can come twice: a
    layer-range rule that selects nothing named layers.0.down_proj twice among its nearest paths."""
    from fxquant.schemes import Site
    from fxquant.schemes.rules import explain_unmatched
    from fxquant.schemes.yaml_io import load_text

    scheme = load_text("rules:\n  - match: {kinds: [fc2], layers: ['4..7']}\n    linear: mxfp4\n")
    sites = [Site.from_path(p) for p in ("layers.0.mlp.down_proj", "layers.1.mlp.down_proj", "layers.0.mlp.down_proj",
                                         "layers.1.mlp.down_proj", "layers.0.mlp.up_proj")]
    why = explain_unmatched(0, scheme.rules[0], sites)
    assert why.nearest == ("layers.0.mlp.down_proj", "layers.1.mlp.down_proj")
    assert "no site in the selected layers; the model's layers are 0..1" in why.reason
