"""Scheme YAML: the reference grammar (cascade of format and options), every error reported at once with
file:line, dotted path and did-you-mean, and the YAML round trip (hypothesis)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fxquant import schemes
from fxquant.formats.tensor_quant import TensorQuant
from fxquant.schemes import (
    AttentionQuant,
    GemmQuant,
    LayerSpan,
    LinearQuant,
    MatmulQuant,
    Rule,
    Scheme,
    SchemeError,
    Selector,
    Site,
    SiteKind,
)

GOOD = """\
name: my_scheme
description: mixed formats
rules:
  - linear:
      format: mxfp8
      rounding: ta
      dgrad: {dy: mxfp8_e5m2}
      wgrad: none
  - match: {kinds: [fc2], layers: ["1..2", -1]}
    linear: hifp8:saturate=0
  - match: {first_layers: 1}
    priority: 5
    linear: none
    attention: none
  - attention:
      qk: {q: nvfp4, k: {format: mxfp4, scale_mode: rceil}}
      pv: mxint8
"""


def test_good_scheme_parses_with_cascade(tmp_path: Path) -> None:
    path = tmp_path / "good.yaml"
    path.write_text(GOOD)
    s = schemes.get(str(path))
    assert (s.name, s.description, len(s.rules)) == ("my_scheme", "mixed formats", 4)
    m8ta = TensorQuant("mxfp8", rounding="ta")
    e5ta = TensorQuant("mxfp8_e5m2", rounding="ta")
    assert s.rules[0].linear == LinearQuant(GemmQuant(m8ta, m8ta), GemmQuant(e5ta, m8ta), GemmQuant())
    assert s.rules[0].where == f"{path}:4"
    assert s.rules[1].selector == Selector(kinds=(SiteKind.FC2,), layers=(LayerSpan(1, 2), LayerSpan(-1, -1)))
    hi = TensorQuant("hifp8", saturate=False)
    assert s.rules[1].linear == LinearQuant(GemmQuant(hi, hi), GemmQuant(hi, hi), GemmQuant(hi, hi))
    assert s.rules[2].priority == 5 and not s.rules[2].linear.quantized and not s.rules[2].attention.quantized
    mi = TensorQuant("mxint8")
    assert s.rules[3].attention == AttentionQuant(
        qk=MatmulQuant(GemmQuant(TensorQuant("nvfp4"), TensorQuant("mxfp4", scale_mode="rceil"))),
        pv=MatmulQuant(GemmQuant(mi, mi)),  # 'pv' is the forward GEMM only; dp, dv are its backward GEMMs
    )
    fc2_l3 = Site.from_path("decoder.layers.3.mlp.linear_fc2", num_layers=4)
    fc2_l0 = Site.from_path("decoder.layers.0.mlp.linear_fc2", num_layers=4)
    assert s.linear_for(fc2_l3) == s.rules[1].linear
    assert s.linear_for(fc2_l0) is None  # priority 5 beats the more specific kinds+layers rule
    assert Scheme.from_yaml_text(s.to_yaml()) == s
    assert Path(path).stem == Scheme.from_yaml_text(GOOD.replace("name: my_scheme\n", ""), str(path)).name


BAD = """\
name: broken
rule: []
rules:
  - linear:
      fprop: {x: mxfp9, w: mxfp8}
      dgrad: {dy: hifp8, w: {format: hifp8, scale_mode: floor}}
  - match: {kinds: [fc3, qkv], layers: ["5..2"], modulez: foo}
    linear: mxfp8
  - match: {modules: "layers.("}
    attention: {qk: {q: mxfp8, q: mxfp4}, pvv: mxfp8}
  - priority: 1
  - match: {kinds: [qkv]}
    attention: mxfp8
    linear: {format: mxfp4, rounding: ner}
"""


def test_every_problem_reported_at_once_with_line_and_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    with pytest.raises(SchemeError) as info:
        Scheme.from_yaml(path)
    problems = info.value.problems
    text = str(info.value)
    f = str(path)
    expected = [
        (f"{f}:2: (top): unknown key 'rule' (did you mean 'rules'?)",),
        (f"{f}:5: rules[0].linear.fprop.x:", "unknown format 'mxfp9'", "did you mean 'mxfp8'"),
        (f"{f}:6: rules[0].linear.dgrad.w:", "scale_mode"),
        (f"{f}:7: rules[1].match: unknown key 'modulez' (did you mean 'modules'?)",),
        (f"{f}:7: rules[1].match.kinds[0]: unknown kind 'fc3'",),
        (f"{f}:7: rules[1].match.layers[0]: layer range 5..2 is empty: start must not exceed stop (write '2..5')",),
        (f"{f}:9: rules[2].match.modules:", "not a valid regular expression"),
        (f"{f}:10: rules[2].attention.qk.q: duplicate key 'q'",),
        (f"{f}:10: rules[2].attention: unknown key 'pvv' (did you mean 'pv'?)",),
        (f"{f}:11: rules[3]: a rule must configure 'linear', 'attention' or both",),
        (f"{f}:14: rules[4].linear:", "rounding='ner'", "did you mean 'rne'"),
        (f"{f}:13: rules[4].attention: kinds ['qkv'] select no attention site: this part could never apply",),
    ]
    for parts in expected:
        assert any(all(p in line for p in parts) for line in problems), (parts, text)
    assert len(problems) == len(expected), text
    assert text.startswith(f"{len(expected)} problems in scheme {f}")


def test_rule_that_can_never_apply_is_an_error() -> None:
    with pytest.raises(SchemeError, match=r"<string>:2: rules\[0\]: kinds \['qkv'\] are linear sites but the rule configures only attention"):
        Scheme.from_yaml_text("- match: {kinds: [qkv]}\n  attention: mxfp8\n".join(["rules:\n", ""]))


def _linear(value: str) -> LinearQuant:
    return Scheme.from_yaml_text(f"rules:\n  - linear: {value}\n").rules[0].linear


def _attention(value: str) -> AttentionQuant:
    return Scheme.from_yaml_text(f"rules:\n  - attention: {value}\n").rules[0].attention


def test_a_part_of_a_rule_its_kinds_never_reach_is_an_error() -> None:
    """kinds [qkv] with linear and attention: the attention part could never apply (it was kept silently and
    the attention stayed in high precision); the Python API refuses the same rule."""
    with pytest.raises(SchemeError, match=r"<string>:4: rules\[0\]\.attention: kinds \['qkv'\] select no attention "
                                          r"site: this part could never apply"):
        Scheme.from_yaml_text("rules:\n  - match: {kinds: [qkv]}\n    linear: mxfp8\n    attention: hifp8\n")
    with pytest.raises(SchemeError, match=r"rules\[0\]\.linear: kinds \['attention'\] select no linear site"):
        Scheme.from_yaml_text("rules:\n  - match: {kinds: [attention]}\n    linear: mxfp8\n    attention: hifp8\n")
    both = Scheme.from_yaml_text("rules:\n  - match: {kinds: [qkv, attention]}\n    linear: mxfp8\n    attention: hifp8\n")
    assert both.rules[0].linear is not None and both.rules[0].attention is not None
    lq, aq = _linear("mxfp8"), _attention("hifp8")
    with pytest.raises(ValueError, match="its attention part could never apply"):
        Rule(Selector(kinds=("qkv",)), lq, aq)


@pytest.mark.parametrize(("kwargs", "error", "needle"), [
    ({"priority": 1.5}, TypeError, "Rule.priority must be an int"),
    ({"priority": "high"}, TypeError, "Rule.priority must be an int"),
    ({"priority": True}, TypeError, "Rule.priority must be an int"),
])
def test_the_python_api_refuses_what_the_yaml_refuses(kwargs: dict, error: type, needle: str) -> None:
    """A Rule / Scheme / Selector the YAML could not hold is refused when built (its to_yaml() did not load, and a
    string priority failed at the first site resolved)."""
    lq = _linear("mxfp8")
    with pytest.raises(error, match=needle):
        Rule(linear=lq, **kwargs)
    with pytest.raises(TypeError, match="Scheme.description must be a str"):
        Scheme("s", None, (Rule(linear=lq),))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Scheme.name must be a non-empty str"):
        Scheme("  ", "d", (Rule(linear=lq),))
    with pytest.raises(ValueError, match="an empty regex selects nothing"):
        Selector(modules=" ")


def test_merge_keys_share_settings_and_keys_beside_them_override() -> None:
    """``<<: *anchor`` (YAML's merge key) crashed with PyYAML's ConstructorError (not a SchemeError: a traceback
    from `fxquant schemes FILE`); its keys count as written, and keys written beside it override them."""
    s = Scheme.from_yaml_text(
        "rules:\n"
        "  - linear: &base {format: mxfp8, rounding: sr}\n"
        "  - match: {kinds: [fc1]}\n"
        "    linear: {<<: *base, rounding: rne}\n"
        "  - match: {kinds: [fc2]}\n"
        "    linear: {<<: [{scale_mode: even}, *base]}\n")
    assert s.rules[0].linear == _linear("{format: mxfp8, rounding: sr}")
    assert s.rules[1].linear == _linear("{format: mxfp8, rounding: rne}") == _linear("mxfp8")
    assert s.rules[2].linear == _linear("{format: mxfp8, rounding: sr, scale_mode: even}")
    with pytest.raises(SchemeError, match=r"<string>:3: rules\[1\]\.linear\.format: duplicate key 'format'"):
        Scheme.from_yaml_text("rules:\n  - linear: &b {format: mxfp8}\n  - linear: {<<: *b, format: hifp8, format: fp8}\n")


@pytest.mark.parametrize(("text", "needle"), [
    ("name: !foo bar\nrules: []\n", "<string>:1: name: unreadable value: could not determine a constructor for the tag '!foo'"),
    ("rules:\n  - linear: !!binary xyz\n", "<string>:2: rules[0].linear: unreadable value: failed to decode base64"),
    ("rules:\n  - linear: {<<: 5, format: mxfp8}\n", "<string>:2: rules[0].linear.<<: expected a mapping or list of mappings"),
    ("rules:\n  - linear: !!set {a: null}\n", "<string>:2: rules[0].linear: tag 'tag:yaml.org,2002:set' is not part of a scheme"),
    ("rules: !!omap [{a: 1}]\n", "<string>:1: rules: tag 'tag:yaml.org,2002:omap' is not part of a scheme"),
])
def test_yaml_beyond_plain_data_is_a_scheme_error(text: str, needle: str) -> None:
    """Custom tags, bad !!binary, a merge key on a scalar: a SchemeError naming line and path (PyYAML's own
    ConstructorError escaped, naming '<unicode string>'), also from `fxquant schemes FILE` (exit 2)."""
    with pytest.raises(SchemeError) as info:
        Scheme.from_yaml_text(text)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("rules: [\n  - linear: mxfp8\n", "<string>:2: invalid YAML"),
        ("", "the file is empty"),
        ("- 1\n", "expected a mapping"),
        ("name: x\n", "rules: missing"),
        ("rules: {linear: mxfp8}\n", "rules: expected a list of rules"),
        ("rules:\n  - linear: 3\n", "rules[0].linear: expected a format"),
        ("rules:\n  - linear: mxfp8\n    priority: high\n", "rules[0].priority: must be an int"),
        ("rules:\n  - match: {first_layers: 0}\n    linear: mxfp8\n", "rules[0].match.first_layers: must be a positive int"),
        ("rules:\n  - linear: {fprop: {x: {format: hifp8, w: mxfp8}}}\n", "unknown key 'w'"),
        ("rules:\n  - linear: 'mxfp8:roundin=ta'\n", "did you mean 'rounding'"),
    ],
)
def test_bad_documents(text: str, needle: str) -> None:
    with pytest.raises(SchemeError) as info:
        Scheme.from_yaml_text(text)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("value", "path", "option", "fmt"),
    [
        ("{format: mxfp8, scaling: tensor}", "rules[0].linear", "scaling='tensor'", "'mxfp8_e4m3', which is block-scaled (blocks of 32)"),
        ("'mxfp8:scaling=tensor'", "rules[0].linear", "scaling='tensor'", "'mxfp8_e4m3', which is block-scaled"),
        ("{format: nvfp4, scale_target: 4}", "rules[0].linear", "scale_target=4", "'nvfp4', which is block-scaled (blocks of 16)"),
        ("{format: fp8_e4m3, scaling: tensor, fprop: {w: mxfp4}}", "rules[0].linear.fprop.w", "scaling='tensor'", "'mxfp4_e2m1'"),
    ],
)
def test_per_tensor_scaling_on_a_block_format_is_a_clear_error(value: str, path: str, option: str, fmt: str) -> None:
    with pytest.raises(SchemeError) as info:
        Scheme.from_yaml_text(f"rules:\n  - linear: {value}\n", "s.yaml")
    (problem,) = info.value.problems
    assert problem.startswith(f"s.yaml:2: {path}: {option} does not apply to format {fmt}"), problem
    assert "per-tensor scaling (scaling, scale_target) applies to element formats only" in problem
    assert "resolve()" not in problem


def test_per_tensor_scaling_on_an_element_format_is_accepted() -> None:
    s = Scheme.from_yaml_text("rules:\n  - linear: {format: fp8_e4m3, scaling: tensor, dgrad: 'fp8_e5m2:scaling=tensor'}\n")
    assert s.rules[0].linear.fprop.a == TensorQuant("fp8_e4m3", scaling="tensor")
    assert s.rules[0].linear.dgrad.a == TensorQuant("fp8_e5m2", scaling="tensor")


@pytest.mark.parametrize(("span", "spelled"), [("-1..2", "N-1..2"), ("-2..0", "N-2..0")])
def test_a_range_from_the_last_layers_to_the_first_ones_is_refused(span: str, spelled: str) -> None:
    text = f"rules:\n  - match: {{layers: [0, '-3..-1', '{span}']}}\n    linear: mxfp8\n"
    with pytest.raises(SchemeError) as info:
        Scheme.from_yaml_text(text, "s.yaml")
    (problem,) = info.value.problems
    assert problem.startswith(f"s.yaml:2: rules[0].match.layers[2]: layer range {span} starts counted from the last "
                              f"layer and stops counted from the first"), problem
    assert f"(here {spelled})" in problem


@pytest.mark.parametrize("span", ["5..2", "5-2", "-1..-3"])
def test_a_reversed_range_says_start_exceeds_stop(span: str) -> None:
    # was "expected a layer index (0, -1) or a range", though it is a range
    with pytest.raises(SchemeError) as info:
        Scheme.from_yaml_text(f"rules:\n  - match: {{layers: ['{span}']}}\n    linear: mxfp8\n", "s.yaml")
    (problem,) = info.value.problems
    assert problem.startswith("s.yaml:2: rules[0].match.layers[0]: layer range "), problem
    assert "is empty: start must not exceed stop" in problem and "expected a layer index" not in problem


@pytest.mark.parametrize(("match", "key", "what"), [
    ("{layers: []}", "layers", "an empty list"),
    ("{kinds: []}", "kinds", "an empty list"),
    ("{modules: ''}", "modules", "an empty regex"),
    ("{kinds: [fc1], layers: []}", "layers", "an empty list"),
])
def test_an_empty_selector_is_refused_not_taken_as_every_site(match: str, key: str, what: str) -> None:
    # Stored as () an empty list would read as "no selector": the rule would match every site.
    with pytest.raises(SchemeError) as info:
        Scheme.from_yaml_text(f"rules:\n  - match: {match}\n    linear: mxfp4\n", "s.yaml")
    (problem,) = info.value.problems
    assert problem == (f"s.yaml:2: rules[0].match.{key}: {what} selects nothing; leave the key out to select "
                       f"every site"), problem


def test_an_empty_match_selects_every_site() -> None:
    s = Scheme.from_yaml_text("rules:\n  - match: {}\n    linear: mxfp4\n")
    assert s.rules[0].selector == Selector()
    assert s.linear_for(Site.from_path("layers.3.mlp.fc1", num_layers=4)) is not None


@pytest.mark.parametrize(("value", "problems"), [
    ("{rounding: ta}", [("rules[0].linear.rounding", "rounding", "rules[0].linear")]),
    ("{saturate: false}", [("rules[0].linear.saturate", "saturate", "rules[0].linear")]),
    ("{format: none, rounding: ta}", [("rules[0].linear.rounding", "rounding", "rules[0].linear")]),
    ("{scale_mode: rceil, fprop: {rounding: sr}}", [("rules[0].linear.scale_mode", "scale_mode", "rules[0].linear"),
                                                   ("rules[0].linear.fprop.rounding", "rounding", "rules[0].linear.fprop")]),
    # every operand with a format sets its own rounding: the outer one applies to nothing
    ("{rounding: sr, fprop: {x: mxfp8, rounding: ta}}", [("rules[0].linear.rounding", "rounding", "rules[0].linear")]),
])
def test_options_that_reach_no_format_are_an_error(value: str, problems: list[tuple[str, str, str]]) -> None:
    # These loaded silently and quantized nothing.
    with pytest.raises(SchemeError) as info:
        Scheme.from_yaml_text(f"rules:\n  - linear: {value}\n", "s.yaml")
    assert len(info.value.problems) == len(problems), info.value
    for problem, (path, key, where) in zip(info.value.problems, problems):
        assert problem.startswith(f"s.yaml:2: {path}: {key} given but no format in force at {where}:"), problem


def test_options_apply_to_a_format_given_further_down() -> None:
    s = Scheme.from_yaml_text("rules:\n  - linear: {rounding: sr, fprop: {x: mxfp8}, dgrad: {format: hifp8, rounding: ta}}\n")
    lq = s.rules[0].linear
    assert lq.fprop == GemmQuant(TensorQuant("mxfp8", rounding="sr"), None)
    assert lq.dgrad == GemmQuant(TensorQuant("hifp8", rounding="ta"), TensorQuant("hifp8", rounding="ta"))
    # options inherited by an operand set to none, or reset with null, are not an error
    s = Scheme.from_yaml_text("rules:\n  - linear: {format: mxfp8, rounding: sr, fprop: {x: none}, dgrad: {rounding: null}}\n")
    assert s.rules[0].linear.fprop == GemmQuant(None, TensorQuant("mxfp8", rounding="sr"))
    assert s.rules[0].linear.dgrad.a == TensorQuant("mxfp8")


def test_an_inherited_option_the_format_refuses_names_where_it_was_written() -> None:
    text = "rules:\n  - linear:\n      format: mxfp8\n      scale_mode: rceil\n      fprop: {x: hifp8}\n"
    with pytest.raises(SchemeError) as info:
        Scheme.from_yaml_text(text, "s.yaml")
    (problem,) = info.value.problems
    assert problem.startswith("s.yaml:5: rules[0].linear.fprop.x: scale_mode='rceil' applies to MX"), problem
    assert problem.endswith("(scale_mode='rceil' is inherited from rules[0].linear; reset it here with "
                            "'scale_mode: null', e.g. {format: hifp8, scale_mode: null})"), problem
    # the reset the message suggests works; an option written at the operand itself is not called inherited
    reset = Scheme.from_yaml_text(text.replace("{x: hifp8}", "{x: {format: hifp8, scale_mode: null}}"))
    assert reset.rules[0].linear.fprop.a == TensorQuant("hifp8")
    with pytest.raises(SchemeError) as info:
        Scheme.from_yaml_text("rules:\n  - linear: {format: hifp8, scale_mode: rceil}\n", "s.yaml")
    assert "inherited" not in str(info.value)


@pytest.mark.parametrize("target", ["1e-50", "1.0e-40", "0.0", "1000.0"])
def test_scale_target_out_of_the_normal_float32_range_is_refused_in_yaml(target: str) -> None:
    with pytest.raises(SchemeError) as info:
        Scheme.from_yaml_text(f"rules:\n  - linear: {{format: fp8_e4m3, scaling: tensor, scale_target: {target}}}\n", "s.yaml")
    (problem,) = info.value.problems
    assert problem.startswith("s.yaml:2: rules[0].linear: scale_target="), problem
    assert "must lie in [2**-126 (1.17549e-38), 448] for 'fp8_e4m3'" in problem


def test_missing_file() -> None:
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        Scheme.from_yaml("nope.yaml")


def test_none_words_and_format_none_cascade() -> None:
    s = Scheme.from_yaml_text("rules:\n  - linear: {format: mxfp8, fprop: {x: none, w: off}, dgrad: {format: null}}\n")
    m8 = TensorQuant("mxfp8")
    assert s.rules[0].linear == LinearQuant(GemmQuant(), GemmQuant(), GemmQuant(m8, m8))
    empty = Scheme.from_yaml_text("rules:\n")
    assert empty.rules == () and not empty.quantizes_anything


# -- round trip ----------------------------------------------------------------------------------------
TQS = [None, TensorQuant("mxfp8"), TensorQuant("mxfp4", rounding="sr", scale_mode="rceil"), TensorQuant("hifp8", saturate=False),
       TensorQuant("fp8_e4m3", scaling="tensor", scale_target=224.0), TensorQuant("nvfp4")]
tq_st = st.sampled_from(TQS)
gemm_st = st.builds(GemmQuant, tq_st, tq_st)
mm_st = st.builds(MatmulQuant, gemm_st, gemm_st, gemm_st)
selector_st = st.builds(
    Selector,
    modules=st.sampled_from([None, r"decoder\.layers\.\d+\.mlp\..*", ".*qkv"]),
    kinds=st.lists(st.sampled_from(list(SiteKind)), unique=True, max_size=3).map(tuple),
    layers=st.lists(st.tuples(st.integers(-3, 3), st.integers(-3, 3)).filter(lambda t: not t[0] < 0 <= t[1])
                    .map(lambda t: LayerSpan(*(sorted(t) if (t[0] < 0) == (t[1] < 0) else t))), max_size=2).map(tuple),
    first_layers=st.sampled_from([None, 1, 2]),
    last_layers=st.sampled_from([None, 1]),
)


@st.composite
def rule_st(draw) -> Rule:
    lin = draw(st.one_of(st.none(), st.builds(LinearQuant, gemm_st, gemm_st, gemm_st)))
    att = draw(st.builds(AttentionQuant, mm_st, mm_st)) if lin is None else draw(st.one_of(st.none(), st.builds(AttentionQuant, mm_st, mm_st)))
    sel = draw(selector_st)
    comps = {k.component.value for k in sel.kinds}
    configured = {"linear": lin is not None, "attention": att is not None}
    # else Rule() rejects it: it, or one of its parts, could never apply
    assume(not comps or (any(configured[c] for c in comps) and all(c in comps for c in configured if configured[c])))
    return Rule(sel, lin, att, draw(st.integers(-2, 2)))


@settings(max_examples=60, deadline=None)
@given(st.lists(rule_st(), max_size=4), st.text("abc_", min_size=1, max_size=8))
def test_yaml_round_trip(rules: list[Rule], name: str) -> None:
    s = Scheme(name, "d", tuple(rules))
    assert Scheme.from_yaml_text(s.to_yaml()) == s


@pytest.mark.parametrize("name", schemes.names())
def test_every_preset_round_trips(name: str) -> None:
    s = schemes.get(name)
    assert Scheme.from_yaml_text(s.to_yaml()) == s


def test_docs_example_parses_and_resolves() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "schemes.md").read_text()
    text = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    s = Scheme.from_yaml_text(text, "docs/schemes.md")
    site = lambda p: Site.from_path(p, num_layers=8)  # noqa: E731
    fc2_5 = s.linear_for(site("decoder.layers.5.mlp.linear_fc2"))
    assert fc2_5.fprop.a == TensorQuant("mxfp4", rounding="sr")
    qkv_2 = s.linear_for(site("decoder.layers.2.self_attention.linear_qkv"))
    assert qkv_2.fprop.a == TensorQuant("mxfp8") and qkv_2.dgrad.a == TensorQuant("mxfp8_e5m2")
    assert s.linear_for(site("decoder.layers.7.mlp.linear_fc2")) is None  # priority: last layer beats fc2 4..7
    assert s.linear_for(site("output_layer")).fprop.a == TensorQuant("mxfp8")
    att = s.attention_for(Site("decoder.layers.3.self_attention.core_attention", SiteKind.ATTENTION, 3, 8))
    assert att.qk.grad_b == GemmQuant(None, TensorQuant("hifp8")) and not att.pv.quantized
