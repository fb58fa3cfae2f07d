"""fxquant.capture.save: an arbitrary tensor into the active capture session, with a tap's manifest fields."""
from __future__ import annotations

import pytest
import torch

from fxquant import capture
from fxquant.capture.runtime import RankInfo
from tests.capture_helpers import spec_text, tap


def test_save_stores_the_tensor_with_the_session_coordinates(tmp_path):
    x = torch.randn(3, 40).bfloat16()
    assert capture.save(x, "before_session") is False  # no session: nothing stored, no error
    with capture.start(spec_text(end=1), tmp_path, scheme="FA_mxfp8", rank=RankInfo(rank=0, world_size=1)) as s:
        s.set_iteration(7)  # outside the spec's window: explicit saves still happen
        s.set_micro_batch(2)
        torch.ops.fxquant.capture(torch.ones(2, 2), tap())  # a tap outside its window: not stored
        assert capture.save(x, "router_logits", module="layers.3.mlp.router", layer=3)
        assert capture.save(x.float() * 2, "residual", direction="backward", phase="pre")
    cs = capture.open(tmp_path)
    assert len(cs) == 2
    rec = cs.query(role="router_logits")[0]
    assert (rec.module, rec.layer, rec.iteration, rec.micro_batch, rec.scheme, rec.rank, rec.copy, rec.section) == (
        "layers.3.mlp.router", 3, 7, 2, "FA_mxfp8", 0, "hp", "user")
    assert rec.component == "user" and rec.direction == "forward" and rec.phase == "post" and rec.dtype == "bfloat16"
    assert torch.equal(cs.load(rec, check=True), x)
    assert rec.stats["min"] == x.float().min().item() and rec.stats["max"] == x.float().max().item()
    res = cs.query(role="residual")[0]
    assert torch.equal(cs.load(res), x.float() * 2) and res.direction == "backward"
    assert cs.verify() == []


def test_save_counts_against_the_budget_and_validates(tmp_path):
    with capture.start(spec_text(budget="{tensors: 1}"), tmp_path) as s:
        assert s.save(torch.zeros(4), "a")
        assert not s.save(torch.zeros(4), "b")  # budget reached: capture stops
        assert s.stop_reason == "budget.tensors=1 reached"
        with pytest.raises(TypeError, match="floating torch.Tensor .*got torch.int64"):
            s.save(torch.zeros(4, dtype=torch.long), "c")
        with pytest.raises(ValueError, match="name must be a non-empty string"):
            s.save(torch.zeros(4), "")
        with pytest.raises(ValueError, match="direction='sideways'"):
            s.save(torch.zeros(4), "d", direction="sideways")
    assert [r.role for r in capture.open(tmp_path)] == ["a"]
