"""The capture fast paths: one op call and one stored copy per tapped tensor (taps grouped by the pass, with a
mutation guard), CPU tensor work in the writer thread on pooled copies, XXH3 checksums written on the fly
(older CRC-32 sets still verify), failures of deferred work stopping capture cleanly; and, on a GPU, the
pinned-memory path that never synchronises the device per tensor."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from fxquant import capture, schemes
from fxquant.backend import FxquantBackend
from fxquant.capture import layout
from fxquant.capture.hostpool import HostPool
from fxquant.capture.spec import Component, Copy, ModuleKind, Role
from fxquant.capture.tap import Tap, decode_tap, decode_taps, encode_taps

from tests.capture_helpers import spec_text, tap


def _taps(n: int) -> str:
    base = decode_tap(tap())
    return encode_taps([dataclasses.replace(base, module=f"layers.0.m{i}") for i in range(n)])


def test_one_tensor_tapped_at_three_sites_is_one_call_three_records_one_stored_copy(tmp_path):
    text = _taps(3)
    assert len(decode_taps(text)) == 3 and decode_taps(tap()) == (decode_tap(tap()),)
    x = torch.randn(64, 32)
    with capture.start(spec_text(), tmp_path) as s:
        torch.ops.fxquant.capture(x, text)
        s.set_iteration(10**6)  # outside the window: no copy is even made
        torch.ops.fxquant.capture(x, text)
        assert (s.pool.hits, s.pool.misses) == (0, 1)
    cs = capture.open(tmp_path)
    assert cs.verify() == [] and [r.module for r in cs] == [f"layers.0.m{i}" for i in range(3)]
    assert len({(r.file, r.key, r.checksum) for r in cs}) == 1 and len({r.seq for r in cs}) == 3
    with safe_open(str(cs[0].path), "pt") as f:
        assert list(f.keys()) == [cs[0].key]  # stored once
    for rec in cs:
        assert torch.equal(cs.load(rec, check=True), x) and rec.stats["max"] == x.max().item()


def test_tensor_budget_counts_records_of_a_shared_copy(tmp_path):
    with capture.start(spec_text(budget="{tensors: 2}"), tmp_path) as s:
        torch.ops.fxquant.capture(torch.randn(4, 8), _taps(3))
        assert s.stop_reason is None  # 2 of the 3 records admitted
        torch.ops.fxquant.capture(torch.randn(4, 8), _taps(1))
        assert s.stop_reason == "budget.tensors=2 reached"
    assert [r.module for r in capture.open(tmp_path)] == ["layers.0.m0", "layers.0.m1"]


class SharedInput(nn.Module):
    """q and k read one tensor (one capture call); an in-place op before v keeps v's tap separate."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = x * 2.0
        y = self.q_proj(h) + self.k_proj(h)
        h.mul_(3.0)
        return (y + self.v_proj(h)).sum()


def test_pass_groups_taps_of_one_tensor_but_not_across_an_inplace_op(tmp_path):
    spec = capture.load_spec("t.yaml", text="sections: [{points: [{component: linear, roles: [input]}]}]")
    model = SharedInput()
    x = torch.randn(4, 8)
    be = FxquantBackend(schemes.get("bf16"), capture=spec, inner="aot_eager", root=model)
    with capture.start(spec, tmp_path), torch.no_grad():  # (autograd would refuse h's in-place change)
        torch.compile(model, backend=be)(x)
    cs = capture.open(tmp_path)
    by = {r.module: r for r in cs}
    assert set(by) == {"q_proj", "k_proj", "v_proj"}
    assert by["q_proj"].key == by["k_proj"].key != by["v_proj"].key  # q, k: one call, one copy; v: its own
    assert torch.equal(cs.load(by["q_proj"]), x * 2.0) and torch.equal(cs.load(by["v_proj"]), x * 6.0)


def test_host_pool_reuses_released_buffers_and_keeps_at_most_its_cap():
    pool = HostPool(max_free_bytes=4096)
    x = torch.arange(256, dtype=torch.float32).reshape(16, 16)
    a = pool.copy(x.t())  # non-contiguous source: a contiguous copy of the same values
    assert a.tensor.is_contiguous() and torch.equal(a.tensor, x.t())
    a.hold()
    a.release()
    assert pool.copy(x).tensor.data_ptr() != a.tensor.data_ptr()  # still held once: not reused
    ptr = a.tensor.data_ptr()
    a.release()
    with pytest.raises(RuntimeError, match="already returned"):
        a.hold()
    b = pool.copy(x + 1)
    assert b.tensor.data_ptr() == ptr and torch.equal(b.tensor, x + 1) and pool.hits == 1
    big = pool.copy(torch.zeros(2048))  # 8 KiB: over the cap, dropped when released
    big.release()
    assert pool.copy(torch.zeros(2048)).tensor is not None and pool.hits == 1


def test_host_pool_keeps_no_buffer_returned_after_the_window_closed(tmp_path):
    """Leaving the window clears the pool, and the copies the writer finishes afterwards are dropped as they come
    back rather than kept for a window that may never come again (they stayed until the session closed)."""
    s = capture.start(spec_text(end=1), tmp_path)
    try:
        for i in range(4):
            torch.ops.fxquant.capture(torch.randn(256, 256), tap(f"layers.{i}.mlp.down_proj", layer=i))  # 256 KiB
        s.set_iteration(1)  # out of the window, the writer still holding the copies
        s.writer.wait_idle()
        s.flush()
        assert s.pool._free_bytes == 0 and not s.pool._free
        s.set_iteration(0)  # the window again: copies are pooled once more
        torch.ops.fxquant.capture(torch.randn(256, 256), tap())
        s.writer.wait_idle()
        s.flush()
        assert s.pool._free_bytes == 256 * 256 * 4
    finally:
        s.close()
    assert s.pool._free_bytes == 0
    pool = HostPool()
    lease = pool.copy(torch.ones(64))
    pool.clear()
    lease.release()
    assert pool.free_bytes == 0
    pool.copy(torch.ones(64)).release()
    assert pool.free_bytes == 256


@pytest.mark.parametrize("policy", ["stop", "abort"])
def test_failure_of_deferred_tensor_work_stops_capture_cleanly(tmp_path, policy):
    bad = Tap(Component.LINEAR, Role.INPUT, "layers.0.fc2", (0,), ModuleKind.FC2, 0, copy=Copy.QUANTIZED,
              qspec="no_such_format", dim=1).encode()
    spec = capture.load_spec("t.yaml", text=f"""
sections: [{{points: [{{component: linear, roles: [input], copies: [hp, quantized]}}]}}]
on_error: {policy}
""")
    s = capture.start(spec, tmp_path)
    torch.ops.fxquant.capture(torch.randn(4, 8), tap())
    torch.ops.fxquant.capture(torch.randn(4, 8), bad)  # re-quantized in the writer thread: fails there
    s.writer.wait_idle()
    if policy == "stop":
        torch.ops.fxquant.capture(torch.randn(4, 8), tap())  # noticed here: capture stops, training goes on
        assert "capture preparation failed" in s.stop_reason and "no_such_format" in s.stop_reason
        s.close()
    else:
        with pytest.raises(capture.CaptureError, match="capture preparation failed"):
            torch.ops.fxquant.capture(torch.randn(4, 8), tap())
        s.close()
    committed = json.loads((tmp_path / "rank-00000" / layout.COMMITTED).read_text())
    assert committed["clean"] is False and "no_such_format" in committed["error"]
    assert not list(tmp_path.rglob("*.tmp"))


def test_checksums_are_xxh3_written_on_the_fly_and_crc32_sets_still_verify(tmp_path):
    with capture.start(spec_text(), tmp_path, shard_bytes=1):
        torch.ops.fxquant.capture(torch.randn(8, 16), tap())
        torch.ops.fxquant.capture(torch.randn(8, 16), tap())
    cs = capture.open(tmp_path)
    for rec in cs:
        assert rec.checksum.startswith("xxh3_64:") and rec.checksum == layout.checksum(cs.load(rec))
    manifest = tmp_path / "rank-00000" / layout.MANIFEST
    recs = [json.loads(line) for line in manifest.read_text().splitlines()]
    for r in recs:  # an older set's lines carry no crc
        del r["crc"]
    import zlib

    recs[0]["checksum"] = f"crc32:{zlib.crc32(layout.tensor_bytes(cs.load(cs[0]))):08x}"  # an older set
    recs[1]["checksum"] = "crc32:00000000"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in recs))
    problems = capture.open(tmp_path).verify()
    assert len(problems) == 1 and recs[1]["key"] in problems[0] and "checksum mismatch" in problems[0]


def test_a_crc32_set_verifies_a_checksum_with_leading_zero_digits(tmp_path):
    """Older sets wrote CRC-32 as 8 hex digits: 0x02d0df35 is "crc32:02d0df35", and verifies (an unpadded
    "crc32:2d0df35" compared against it was a false mismatch)."""
    import zlib

    x = torch.full((4, 8), 13.0)
    assert zlib.crc32(layout.tensor_bytes(x)) == 0x02D0DF35
    with capture.start(spec_text(), tmp_path):
        torch.ops.fxquant.capture(x, tap())
    manifest = tmp_path / "rank-00000" / layout.MANIFEST
    (rec,) = [json.loads(line) for line in manifest.read_text().splitlines()]
    del rec["crc"]  # an older set's line carries no crc
    rec["checksum"] = "crc32:02d0df35"
    manifest.write_text(json.dumps(rec) + "\n")
    cs = capture.open(tmp_path)
    assert cs.verify() == [] and torch.equal(cs.load(cs[0], check=True), x)


def test_first_rows_sampling_stores_only_the_rows(tmp_path):
    spec = capture.load_spec("t.yaml", text="""
sections: [{points: [{component: linear, roles: [input]}], sampling: {first_rows: 2}, what: full}]
""")
    x = torch.randn(1024, 64)
    with capture.start(spec, tmp_path):
        torch.ops.fxquant.capture(x, tap())
    cs = capture.open(tmp_path)
    assert torch.equal(cs.load(cs[0]), x[:2]) and cs[0].stored_shape == [2, 64]
    assert cs[0].path.stat().st_size < 4096  # the rows, not the whole copy


def test_first_rows_of_pooled_copies_stay_each_captures_own_when_the_buffers_are_reused_before_the_commit(tmp_path):
    """what: both with first_rows: the writer releases each pooled copy once its rows are taken, and the next
    capture reuses that buffer while the rows still wait for their shard: every stored row is the one captured
    (the stored rows were views of the buffer, all overwritten by the last capture; verify() saw nothing), and
    each record's statistics are those of its whole tensor."""
    spec = capture.load_spec("t.yaml", text="""
sections: [{points: [{component: linear, roles: [input]}], sampling: {first_rows: 2}, what: both}]
""")
    g = torch.Generator().manual_seed(0)
    sent = []
    with capture.start(spec, tmp_path) as cap:
        for i in range(6):
            cap.set_iteration(i)
            x = torch.randn(64, 32, generator=g) + 10 * i
            torch.ops.fxquant.capture(x, tap())
            sent.append(x.clone())
            cap.writer.wait_idle()  # processed and buffered, not committed: its pooled copy is free again
        assert cap.pool.hits == 5 and cap.pool.misses == 1  # one buffer, reused by every later capture
    cs = capture.open(tmp_path)
    assert len(cs) == 6 and len({rec.file for rec in cs}) == 1 and cs.verify() == []  # one shard, at close
    for i, (rec, x) in enumerate(zip(cs, sent)):
        assert rec.iteration == i and rec.stored_shape == [2, 32] and rec.shape == [64, 32]
        assert torch.equal(cs.load(rec, check=True), x[:2]), i
        assert rec.stats["max"] == x.max().item() and rec.stats["min"] == x.min().item()
        assert rec.stats["mean"] == pytest.approx(x.double().mean().item(), rel=1e-9)


@pytest.mark.gpu
def test_cuda_capture_goes_through_pinned_memory_without_a_sync_per_tensor(tmp_path):
    spec = capture.load_spec("t.yaml", text="""
sections: [{points: [{component: linear, roles: [input]}], what: full}]
""")
    x = torch.randn(256, 64, device="cuda")
    sent = []
    with capture.start(spec, tmp_path) as s:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call on this path raises
        try:
            for i in range(3):
                s.set_iteration(i)
                torch.ops.fxquant.capture(x, _taps(2))
                sent.append(x.clone())
                x.mul_(2.0)  # the device buffer changes right after: the copy was ordered before it
        finally:
            torch.cuda.set_sync_debug_mode("default")
    cs = capture.open(tmp_path)
    assert len(cs) == 6 and cs.verify() == []
    for rec in cs:
        assert torch.equal(cs.load(rec), sent[rec.iteration].cpu())


@pytest.mark.gpu
def test_cuda_statistics_match_the_cpu_ones(tmp_path):
    spec = capture.load_spec("t.yaml", text="sections: [{points: [{component: linear, roles: [input]}]}]")
    x = torch.randn(128, 32)
    with capture.start(spec, tmp_path / "gpu"):
        torch.ops.fxquant.capture(x.cuda(), tap())
    with capture.start(spec, tmp_path / "cpu"):
        torch.ops.fxquant.capture(x, tap())
    g, c = capture.open(tmp_path / "gpu")[0], capture.open(tmp_path / "cpu")[0]
    assert g.stats["exp_hist"] == c.stats["exp_hist"] and g.stats["max"] == c.stats["max"]
    assert g.stats["mean"] == pytest.approx(c.stats["mean"], rel=1e-9, abs=1e-12)


def test_mutation_guard_recognises_inplace_nodes():
    import operator

    from torch import fx

    from fxquant.passes.capture_taps import _may_mutate

    g = fx.Graph()
    x = g.placeholder("x")
    methods = {"add_": True, "masked_fill_": True, "__setitem__": True, "__iadd__": True, "add": False,
               "view": False, "__getitem__": False, "__iter__": False}
    for name, want in methods.items():
        assert _may_mutate(g.create_node("call_method", name, (x,))) is want, name
    functions = {operator.setitem: True, operator.iadd: True, torch.relu_: True, torch.ops.aten.add_.Tensor: True,
                 operator.getitem: False, torch.relu: False, torch.ops.aten.add.Tensor: False}
    for fn, want in functions.items():
        assert _may_mutate(g.call_function(fn, (x,))) is want, fn
    assert _may_mutate(g.call_function(torch.add, (x, x), {"out": x}))
