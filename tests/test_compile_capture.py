"""fxquant.compile(..., capture=...): the public path from a spec to records on disk."""
from __future__ import annotations

import logging

import pytest
import torch

import fxquant
from fxquant import capture
from fxquant.api import compile_state
from tests.models import make_llama, make_tokens, next_token_loss


def train_steps(model, tokens, steps: int) -> None:
    for _ in range(steps):
        next_token_loss(model(tokens), tokens).backward()


def test_capture_dir_starts_a_session_and_counts_iterations(tmp_path):
    model = make_llama()
    tokens = make_tokens(model.cfg)
    compiled = fxquant.compile(model, "linear_hifp8", capture="linear_io", capture_dir=tmp_path, backend="aot_eager")
    train_steps(compiled, tokens, 2)
    session = compile_state(compiled).capture_session
    summary = session.close()
    assert summary is not None
    cs = capture.open(tmp_path)
    assert cs.committed
    assert sorted(set(cs.values("iteration"))) == [0, 1]
    assert set(cs.values("role")) == {"input", "grad_output"}
    assert set(cs.values("scheme")) == {"linear_hifp8"}
    # Every selected linear (q, k, v, o, gate, up, down per layer) in both iterations, both roles.
    n_linears = sum(1 for _, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in _)
    assert len(cs.query(iteration=0, role="input")) == n_linears
    assert len(cs.query(iteration=1, role="grad_output")) == n_linears
    rec = cs.query(iteration=0, role="input", module="layers.0.mlp.down_proj")[0]
    assert cs.load(rec).shape[-1] == model.layers[0].mlp.down_proj.in_features
    assert cs.verify() == []


def test_capture_spec_without_session_warns_and_writes_nothing(tmp_path, caplog):
    model = make_llama()
    tokens = make_tokens(model.cfg)
    compiled = fxquant.compile(model, "bf16", capture="linear_io", backend="aot_eager")
    with caplog.at_level(logging.WARNING, logger="fxquant.api"):
        train_steps(compiled, tokens, 1)
    assert any("no capture session is active" in r.message for r in caplog.records)
    assert list(tmp_path.iterdir()) == []


def test_explicit_session_with_compiled_capture(tmp_path):
    model = make_llama()
    tokens = make_tokens(model.cfg)
    compiled = fxquant.compile(model, "bf16", capture="linear_io", backend="aot_eager")
    with capture.start(capture.load_spec("linear_io"), tmp_path, scheme="bf16") as session:
        for it in (5, 6):
            session.set_iteration(it)
            train_steps(compiled, tokens, 1)
    assert sorted(set(capture.open(tmp_path).values("iteration"))) == [5, 6]


def test_session_with_another_spec_than_the_compiled_one_is_refused(tmp_path):
    """Taps name their sections by index: a session whose spec would read those indices as other sections (here
    weight statistics for the compiled spec's stored inputs) is refused instead of writing mislabelled records;
    one that differs only in its window captures."""
    text = "version: 1\nname: {name}\nsections: [{{name: {sec}, points: [{{component: linear, roles: [{role}]}}], " \
           "what: {what}{when}}}]\n"
    compiled_spec = capture.load_spec("a", text=text.format(name="A", sec="inputs", role="input", what="full", when=""))
    other = capture.load_spec("b", text=text.format(name="B", sec="weights", role="weight", what="stats", when=""))
    windowed = capture.load_spec("c", text=text.format(name="A", sec="inputs", role="input", what="stats",
                                                       when=", when: {iterations: [3]}"))
    assert windowed.placement_digest() == compiled_spec.placement_digest() != other.placement_digest()
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    compiled = fxquant.compile(model, "linear_mxfp8", capture=compiled_spec, backend="aot_eager")
    x = torch.randn(4, 16)
    with pytest.raises(capture.CaptureError, match=r"compiled for another capture spec .* capture.start was given, 'B'"):
        with capture.start(other, tmp_path / "other", scheme="linear_mxfp8"):
            compiled(x).sum().backward()
    assert len(capture.open(tmp_path / "other")) == 0
    with capture.start(windowed, tmp_path / "windowed", scheme="linear_mxfp8") as session:
        for it in (2, 3):
            session.set_iteration(it)
            compiled(x).sum().backward()
    cs = capture.open(tmp_path / "windowed")
    assert [(r.iteration, r.role, r.section, r.has_tensor) for r in cs] == [(3, "input", "inputs", False)]


def test_capture_argument_errors(tmp_path):
    model = make_llama()
    with pytest.raises(ValueError, match="capture_dir is only meaningful"):
        fxquant.compile(model, "bf16", capture_dir=tmp_path)
    with pytest.raises(TypeError, match="capture must be a CaptureSpec"):
        fxquant.compile(model, "bf16", capture=3)
    with pytest.raises(FileNotFoundError, match=r"neither a file nor a shipped spec \['attention_maps', 'linear_io', 'predecessor'"):
        fxquant.compile(model, "bf16", capture="no_such_spec")


def test_points_that_cannot_be_captured_give_one_warning_per_graph(tmp_path, caplog):
    """The predecessor spec asks for attention probabilities, which fused SDPA never materialises: the
    pass says so once per graph (the full list is in the tap report), not once per point. Quantized copies of
    operands the scheme keeps in high precision (every one under bf16) are expected, counted in that warning, and
    a graph missing only those says so at INFO."""
    model = make_llama()
    compiled = fxquant.compile(model, "bf16", capture="predecessor", capture_dir=tmp_path, backend="aot_eager")
    with caplog.at_level(logging.INFO, logger="fxquant.passes.capture_taps"):
        train_steps(compiled, make_tokens(model.cfg), 1)
    said = [r for r in caplog.records if r.name == "fxquant.passes.capture_taps" and r.levelno >= logging.INFO]
    warnings = [r for r in said if r.levelno == logging.WARNING]
    reports = compile_state(compiled).backend.tap_reports
    unavailable = [u for r in reports for u in r.unavailable]
    assert len(unavailable) > len(warnings) >= 1 and len(said) == sum(1 for r in reports if r.unavailable)
    kept = [r for r in reports if r.unavailable and all(u.endswith("(no quantized copy)") for u in r.unavailable)]
    assert len(warnings) == sum(1 for r in reports if r.unavailable) - len(kept)
    assert "cannot be captured in this graph" in warnings[0].getMessage()
    assert "quantized copies of operands the scheme keeps in high precision" in warnings[0].getMessage()
    assert all("(no quantized copy)" not in w.getMessage() for w in warnings)  # counted, not listed
    listed = compile_state(compiled).uncapturable()
    assert len(listed) == len(set(unavailable)) and set(listed) == set(unavailable)
    assert any(".probs" in line for line in listed)  # fused SDPA has no probabilities to tap
    compile_state(compiled).capture_session.close()
