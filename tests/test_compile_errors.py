"""Bad input to fxquant.compile / explain (issue 3, item 8) and strict-mode failures (item 5)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxquant
from fxquant.passes.strict import QuantizationError
from tests.models import make_llama, make_tokens


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_unknown_scheme_has_did_you_mean():
    with pytest.raises(ValueError, match="did you mean.*linear_mxfp8"):
        fxquant.compile(make_llama(), "linear_mxpf8", backend="aot_eager")


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="backend='aot-eager'.*aot_eager"):
        fxquant.compile(make_llama(), "bf16", backend="aot-eager")


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nrules:\n  - match: {kinds: [fc1]}\n    linear: {fprop: {x: mxfp9}}\n")
    with pytest.raises(ValueError, match=r"bad\.yaml:\d+.*mxfp9"):
        fxquant.compile(make_llama(), str(path), backend="aot_eager")


def test_selector_matching_nothing_lists_nearest_module_paths(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("name: typo\nrules:\n  - match: {modules: 'layers\\.0\\.mlp\\.up_prj'}\n    linear: mxfp8\n")
    model = fxquant.compile(make_llama(), str(path), backend="aot_eager")
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj"):
        model(make_tokens(make_llama().cfg))


class NoGemm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        return (x * self.scale).relu().sum(-1)


def test_model_without_linear_or_attention_is_a_clear_error():
    model = fxquant.compile(NoGemm(), "linear_mxfp8", backend="aot_eager")
    with pytest.raises(ValueError, match="no linear .* or attention"):
        model(torch.randn(2, 8))
    with pytest.raises(ValueError, match="nothing to quantize"):
        fxquant.explain(NoGemm(), torch.randn(2, 8), scheme="linear_mxfp8")


class EmptyK(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(0, 8)

    def forward(self, x):
        return self.fc1(x)


def test_block_format_along_a_zero_length_dimension_is_rejected():
    model = fxquant.compile(EmptyK(), "linear_mxfp8", backend="aot_eager")
    with pytest.raises(ValueError, match="blocked along K, which has length 0"):
        model(torch.randn(3, 0))


class SplitLinear(torch.nn.Linear):
    """A linear whose GEMM ends up after a graph break, as a bare matmul nobody recognises."""

    def forward(self, x):
        torch._dynamo.graph_break()
        return torch.matmul(x, self.weight.t()) + self.bias


class WithSplit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = SplitLinear(32, 32)
        self.down_proj = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)))


def test_strict_raises_when_a_selected_site_is_not_rewritten(caplog):
    strict = fxquant.compile(WithSplit(), "linear_hifp8", backend="aot_eager", strict=True)
    with pytest.raises(QuantizationError, match="'up_proj' was not rewritten.*graph_break"):
        strict(torch.randn(4, 32))
    torch._dynamo.reset()
    lenient = fxquant.compile(WithSplit(), "linear_hifp8", backend="aot_eager")
    with caplog.at_level("WARNING", logger="fxquant"):
        lenient(torch.randn(4, 32))
    assert "'up_proj' was not rewritten" in caplog.text
    assert "down_proj" not in caplog.text


def test_strict_raises_when_a_frame_hits_the_recompile_limit(caplog):
    model = fxquant.compile(make_llama(), "linear_hifp8", backend="aot_eager", strict=True, dynamic=False)
    cfg = make_llama().cfg
    with torch._dynamo.config.patch(recompile_limit=1):
        model(make_tokens(cfg, seq_len=8))
        with pytest.raises(Exception, match="recompile_limit|Hard failure"):
            model(make_tokens(cfg, seq_len=12))
    torch._dynamo.reset()
    lenient = fxquant.compile(make_llama(), "linear_hifp8", backend="aot_eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level("WARNING", logger="fxquant"):
        lenient(make_tokens(cfg, seq_len=8))
        lenient(make_tokens(cfg, seq_len=12))
    assert "recompile limit" in caplog.text


def test_explain_lists_sites_and_unmatched_ops():
    text = str(fxquant.explain(WithSplit(), torch.randn(4, 32), scheme="linear_mxfp8"))
    assert "down_proj" in text and "fc2" in text and "x=mxfp8_e4m3" in text
    assert "unmatched matmul-like ops" in text and "matmul" in text


def test_explain_cli_bad_model_factory_is_a_clear_error(capsys):
    from fxquant.cli import main

    assert main(["explain", "--scheme", "bf16", "--model", "no_such_pkg.mod:make"]) == 2
    assert "cannot import 'no_such_pkg.mod'" in capsys.readouterr().err
    assert main(["explain", "--scheme", "bf16", "--model", "tests.models"]) == 2
    assert "expected 'package.module:factory'" in capsys.readouterr().err
