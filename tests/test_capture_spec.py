"""Capture placement spec: parsing, validation (all problems at once, file:line, did-you-mean), shipped specs, CLI."""
from __future__ import annotations

import pytest

from fxquant.capture import spec as S
from fxquant.cli import main

GOOD = """\
version: 1
name: t
sections:
  - name: mlp
    layers: {module: 'layers\\.\\d+\\.mlp', kinds: [fc1, fc2], indices: [0, '2-4']}
    points:
      - component: linear
        direction: backward
        copies: [hp, quantized]
    when: {iterations: {start: 10, end: 20, every: 5}, micro_batches: [0, 1], ranks: '0-1'}
    what: full
    sampling: {random_rows: 8, seed: 3}
budget: {bytes: 1.5GiB, files: 10, tensors: 100}
on_error: abort
"""


def test_parse_full_spec():
    sp = S.load_spec("good.yaml", text=GOOD)
    (sec,) = sp.sections
    assert sec.layers.kinds == {S.ModuleKind.FC1, S.ModuleKind.FC2}
    assert sec.layers.layers == {0, 2, 3, 4}
    assert sec.layers.matches("decoder.layers.3.mlp.linear_fc1", S.ModuleKind.FC1, 3)
    assert not sec.layers.matches("decoder.layers.1.mlp.linear_fc1", S.ModuleKind.FC1, 1)
    assert not sec.layers.matches("decoder.layers.3.self_attention.linear_qkv", S.ModuleKind.FC1, 3)
    roles = {(p.role, p.copy) for p in sec.points}
    assert roles == {(S.Role.GRAD_OUTPUT, S.Copy.HP), (S.Role.GRAD_INPUT, S.Copy.HP), (S.Role.GRAD_WEIGHT, S.Copy.HP),
                     (S.Role.GRAD_OUTPUT, S.Copy.QUANTIZED)}
    assert all(p.direction is S.Direction.BACKWARD for p in sec.points)
    assert [i for i in range(30) if i in sec.when.iterations] == [10, 15]
    assert sec.when.contains(15, 1, 1) and not sec.when.contains(15, 2, 1) and not sec.when.contains(15, 0, 2)
    assert sec.sampling == S.Sampling(S.SamplingMode.RANDOM_ROWS, 8, 3)
    assert sp.budget == S.Budget(int(1.5 * 2**30), 10, 100)
    assert sp.on_error is S.ErrorPolicy.ABORT and sec.what is S.What.FULL


BAD = """\
version: 1
sections:
  - name: a
    layers: {modul: x, kinds: [qvk], indices: ['3-1']}
    points:
      - component: linear
        phase: pre
        roles: [input, grad_ouput, output]
        copies: [quantised]
    when: {iterations: {start: 5, end: 2}, ranks: [0, x]}
    what: ful
  - name: a
    points: [{component: atention}]
budget: {bytes: lots, files: 0}
on_eror: stop
"""


def test_all_problems_reported_at_once_with_lines_and_suggestions():
    with pytest.raises(S.SpecError) as err:
        S.load_spec("bad.yaml", text=BAD)
    got = err.value.problems
    expected = [
        ("bad.yaml:4: sections[0].layers.modul:", "did you mean 'module'"),
        ("bad.yaml:4: sections[0].layers.kinds[0]:", "did you mean 'qkv'"),
        ("bad.yaml:4: sections[0].layers.indices[0]:", "'3-1'"),
        ("bad.yaml:8: sections[0].points[0].roles[1]:", "did you mean 'grad_output'"),
        ("bad.yaml:8: sections[0].points[0].roles[2]:", "excluded by this point's phase"),
        ("bad.yaml:9: sections[0].points[0].copies[0]:", "did you mean 'quantized'"),
        ("bad.yaml:10: sections[0].when.iterations.end:", "must be greater than start"),
        ("bad.yaml:10: sections[0].when.ranks[1]:", "'x'"),
        ("bad.yaml:11: sections[0].what:", "did you mean 'full'"),
        ("bad.yaml:12: sections[1].name:", "duplicate section name 'a'"),
        ("bad.yaml:13: sections[1].points[0].component:", "did you mean 'attention'"),
        ("bad.yaml:14: budget.bytes:", "'lots'"),
        ("bad.yaml:14: budget.files:", ">= 1"),
        ("bad.yaml:15: on_eror:", "did you mean 'on_error'"),
    ]
    for prefix, fragment in expected:
        assert any(p.startswith(prefix) and fragment in p for p in got), (prefix, fragment, got)
    assert len(got) == len(expected)


def test_problems_of_a_broken_section_do_not_hide_its_sampling_or_name_problems():
    """A section with a bad window still has its stats-with-sampling and duplicate-name problems reported (they
    appeared only once the first ones were fixed); ``version: true`` is no version 1."""
    text = ("version: 1\nsections:\n  - name: s\n    points: [{component: linear, roles: [input]}]\n"
            "    when: {iterations: {every: 0}}\n    what: stats\n    sampling: {first_rows: 4}\n"
            "  - name: s\n    points: [{component: linear, roles: [inputt]}]\n")
    with pytest.raises(S.SpecError) as err:
        S.load_spec("g.yaml", text=text)
    got = err.value.problems
    for prefix, fragment in (("g.yaml:5: sections[0].when.iterations.every:", ">= 1"),
                             ("g.yaml:7: sections[0].sampling:", "nothing is stored"),
                             ("g.yaml:8: sections[1].name:", "duplicate section name 's'"),
                             ("g.yaml:9: sections[1].points[0].roles[0]:", "did you mean 'input'")):
        assert any(p.startswith(prefix) and fragment in p for p in got), (prefix, got)
    assert len(got) == 4
    with pytest.raises(S.SpecError, match="unsupported version True"):
        S.load_spec("h.yaml", text="version: true\nsections: [{points: [{component: linear}]}]\n")


@pytest.mark.parametrize("text, fragment", [
    ("sections: [\n  - {points: [", "bad.yaml:2: invalid YAML"),
    ("sections:\n  - points: [{component: linear}]\n    what: full\n    what: stats\n", "bad.yaml:4: sections[0].what: duplicate key"),
    ("sections: []\n", "expected a non-empty list 'sections'"),
    ("sections:\n  - points: [{component: linear, roles: [output], copies: [quantized]}]\n", "none of roles ['output'] is a GEMM operand"),
    ("sections:\n  - points: [{component: linear}]\n    what: stats\n    sampling: {first_rows: 3}\n", "nothing is stored"),
    ("sections:\n  - points: [{component: linear}]\n    sampling: {first_rows: 3, random_rows: 2}\n", "give exactly one of"),
    ("sections:\n  - layers: {module: '(unclosed'}\n    points: [{component: linear}]\n", "invalid regular expression"),
    ("sections:\n  - points: [{component: linear, phase: []}]\n", "points[0].phase: an empty list selects no phase"),
    ("sections:\n  - points: [{component: linear, direction: []}]\n", "points[0].direction: an empty list selects no"),
    ("sections:\n  - points: [{component: linear, copies: []}]\n", "points[0].copies: an empty list selects no copy"),
    ("sections:\n  - points: [{component: linear}]\nbudget: {bytes: '0.5'}\n", "budget.bytes: expected a positive size"),
    ("sections:\n  - points: [{component: linear}]\nbudget: {bytes: '0.0004KB'}\n", "budget.bytes: expected a positive size"),
    ("sections:\n  - points: [{component: linear}]\n    when: {iterations: '5-2'}\n", "inclusive range like '4-7'"),
])
def test_single_problems(text, fragment):
    with pytest.raises(ValueError, match=None) as err:
        S.load_spec("bad.yaml", text=text)
    assert fragment in str(err.value), str(err.value)


def test_shipped_specs_load_and_predecessor_names():
    for name, path in S.shipped_specs().items():
        assert S.load_spec(path).sections, name
    pred = S.load_spec("predecessor")
    got = {(p.component.value, p.role.value, p.copy.value) for s in pred.sections for p in s.points}
    for role in ("query", "key", "value", "probs", "output", "grad_query", "grad_key", "grad_value", "grad_probs",
                 "grad_output"):
        assert ("attention", role, "hp") in got
    for role in ("input", "weight", "output", "grad_output", "grad_input", "grad_weight"):
        assert ("linear", role, "hp") in got
    for role in ("input", "weight", "grad_output"):
        assert ("linear", role, "quantized") in got
    kinds = set().union(*(s.layers.kinds for s in pred.sections))
    assert S.ModuleKind.LM_HEAD not in kinds  # the predecessor kept the LM head out


def test_unknown_spec_name_did_you_mean():
    with pytest.raises(FileNotFoundError, match="did you mean 'predecessor'"):
        S.load_spec("predecesor")


def test_capture_point_rejects_role_of_other_component():
    with pytest.raises(ValueError, match="not a linear role"):
        S.CapturePoint(S.Component.LINEAR, S.Role.QUERY)
    with pytest.raises(ValueError, match="no GEMM operand"):
        S.CapturePoint(S.Component.LINEAR, S.Role.OUTPUT, S.Copy.QUANTIZED)


def test_check_spec_cli(tmp_path, capsys):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(GOOD)
    bad.write_text(BAD)
    assert main(["check-spec", str(good), "predecessor"]) == 0
    assert "ok: spec 't'" in capsys.readouterr().out
    assert main(["check-spec", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}: 14 problems:\n") and f"{bad}:15: on_eror" in err and err.count("\n") == 15


HIDDEN = """\
sections:
  - name: a
    points:
      - component: atention
        roles: [inptu]
  - name: b
    layers: {module: '(unclosed', kinds: [fc9], indices: ['3-1']}
    points: [{component: linear}]
  - name: c
    layers: {kinds: [router, embedding, linear]}
    points: [{component: linear}]
"""


def test_one_problem_does_not_hide_another_in_the_same_block(tmp_path, capsys):
    """A bad regex no longer hides `kinds: [fc9]` and a bad indices range; a bad component no longer hides a
    misspelt role; problems come sorted by line with a count; every scheme kind is a capture kind."""
    with pytest.raises(S.SpecError) as err:
        S.load_spec("h.yaml", text=HIDDEN)
    got = err.value.problems
    assert [p.split(": ")[0:2] for p in got] == [
        ["h.yaml:4", "sections[0].points[0].component"], ["h.yaml:5", "sections[0].points[0].roles[0]"],
        ["h.yaml:7", "sections[1].layers.module"], ["h.yaml:7", "sections[1].layers.kinds[0]"],
        ["h.yaml:7", "sections[1].layers.indices[0]"]]
    assert "'inptu' is not a role of any component" in got[1] and "did you mean 'input'" in got[1]
    path = tmp_path / "h.yaml"
    path.write_text(HIDDEN)
    assert main(["check-spec", str(path)]) == 1
    assert capsys.readouterr().err.startswith(f"{path}: 5 problems:\n  {path}:4: ")


def test_capture_kinds_are_the_scheme_kinds():
    from fxquant.schemes import SiteKind

    assert {k.value for k in S.ModuleKind} == {k.value for k in SiteKind}


def test_check_spec_checks_every_file_and_names_unreadable_ones(tmp_path, capsys):
    """A missing first FILE does not stop the others being checked; a file that is not UTF-8 is a problem naming
    it (status 1, not 2); an empty list that selects nothing (`roles: []`) is a problem like the others."""
    bad, latin, empty = tmp_path / "bad.yaml", tmp_path / "latin.yaml", tmp_path / "empty.yaml"
    bad.write_text(BAD)
    latin.write_bytes(b"sections: [{name: a, points: [{component: linear}]}]\n# caf\xe9\n")
    empty.write_text("sections:\n  - name: a\n    points:\n      - component: linear\n        roles: []\n")
    missing = tmp_path / "missing.yaml"
    assert main(["check-spec", "-q", str(missing), str(bad), str(latin), str(empty), "predecessor"]) == 1
    err = capsys.readouterr().err
    assert f"{missing}: error: capture spec {str(missing)!r} is neither a file nor a shipped spec" in err
    assert f"{bad}: 14 problems:" in err
    assert f"{latin}: 1 problem:\n  {latin}:2: not UTF-8 text: byte 0xe9" in err
    assert f"{empty}: 1 problem:\n  {empty}:5: sections[0].points[0].roles: an empty list selects no linear role" in err
    with pytest.raises(S.SpecError, match="kinds: an empty list selects no module kind"):
        S.load_spec("k.yaml", text="sections: [{name: a, layers: {kinds: []}, points: [{component: linear}]}]\n")


def test_a_window_given_as_one_range_string():
    """``iterations: '0-5'`` (one inclusive range, as ``ranks: '0-3'`` takes) selects 0..5."""
    spec = S.load_spec("r.yaml", text="sections:\n  - points: [{component: linear}]\n    when: {iterations: '2-4'}\n")
    when = spec.sections[0].when
    assert [i for i in range(8) if when.contains(i, 0, 0)] == [2, 3, 4]
    spec = S.load_spec("b.yaml", text="sections:\n  - points: [{component: linear}]\nbudget: {bytes: '1.5KiB'}\n")
    assert spec.budget.bytes == 1536


@pytest.mark.parametrize("module, fragment", [
    ("[mlp, attn]", "got list ['mlp', 'attn']; for any of several paths write one regex with '|', e.g. 'mlp|attn'"),
    ("0", "got int 0"),
    ("{re: mlp}", "got dict {'re': 'mlp'}"),
])
def test_a_module_that_is_not_a_string_is_refused(module, fragment):
    """``module`` is a regex: a list (or any non-string) was turned into the regex of its text, which matched every
    module path (``"['mlp', 'attn']"`` is a character class)."""
    text = f"sections:\n  - name: a\n    layers: {{module: {module}, kinds: [fc9]}}\n    points: [{{component: linear}}]\n"
    with pytest.raises(S.SpecError) as err:
        S.load_spec("m.yaml", text=text)
    got = err.value.problems
    assert got[0].startswith("m.yaml:3: sections[0].layers.module: expected a regular expression (a string)")
    assert fragment in got[0] and "layers.kinds[0]" in got[1]  # kinds are still checked


def test_kinds_of_another_component_than_a_point_are_refused():
    """A point whose component no site of the section's kinds has (attention sites are of kind ``attention``, all
    others linear) could never capture anything."""
    text = """\
sections:
  - name: a
    layers: {kinds: [fc1, fc2]}
    points:
      - component: attention
      - component: linear
  - name: b
    layers: {kinds: [attention, fc1]}
    points: [{component: attention}, {component: linear}]
  - name: c
    layers: {kinds: [attention]}
    points: [{component: linear, roles: [input]}]
"""
    with pytest.raises(S.SpecError) as err:
        S.load_spec("k.yaml", text=text)
    got = err.value.problems
    assert [p.split(": ")[0:2] for p in got] == [["k.yaml:5", "sections[0].points[0].component"],
                                               ["k.yaml:12", "sections[2].points[0].component"]]
    assert "component 'attention' never matches: the section's layers.kinds ['fc1', 'fc2'] are linear sites" in got[0]
    assert "linear sites are of kind qkv | proj | fc1 | fc2 | lm_head | embedding | router | linear" in got[1]
    assert all(k.component is (S.Component.ATTENTION if k is S.ModuleKind.ATTENTION else S.Component.LINEAR)
               for k in S.ModuleKind)
    # a bad module or indices beside the kinds hides neither problem (docs/capture.md: one problem hides no other)
    both = "version: 1\nsections:\n  - name: s\n    layers: {module: [mlp], kinds: [fc1], indices: [x]}\n" \
           "    points: [{component: attention}]\n"
    with pytest.raises(S.SpecError) as err:
        S.load_spec("b.yaml", text=both)
    keys = [p.split(": ")[1] for p in err.value.problems]
    assert keys == ["sections[0].layers.module", "sections[0].layers.indices[0]", "sections[0].points[0].component"], \
        err.value.problems
