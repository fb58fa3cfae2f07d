"""Megatron on two CPU processes (torchrun, gloo) with fxquant.compile(strict=True) matches one process.

The test launches this file as a torchrun worker twice: one process (TP = PP = 1, the reference), then two
processes that run TP=2 and then, in the same processes, PP=2. Every sharded dimension is a multiple of
32 per rank (hidden 64, FFN 128, 4 heads of 16), so MX blocks are the same in every layout and only the
order of the tensor-parallel sums differs. Each layout writes the per-token losses and every parameter's
full gradient under its global name (TP shards gathered), the sites fxquant quantized (with their layer
index), and the capture records of the fc1 input of global layer 1. Under PP the second stage holds
`decoder.layers.0`, which is global layer 1: scheme selectors, sites and capture records must say 1.

Sequence parallelism is not covered: Megatron 0.16.1 allocates its sequence-parallel buffers on
`torch.cuda.current_device()`, so it cannot run on CPU at all (megatron_glue/graph_breaks.py).
"""
from __future__ import annotations

import json
import os
from collections import Counter
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCHEME = "linear_mxfp8"
SEQ, BATCH, HIDDEN = 32, 2, 64
CAPTURE_SPEC = """
sections:
  - layers: {kinds: [fc1], indices: [1]}
    points: [{component: linear, roles: [input, grad_output, weight]}]
  - name: fc2_input
    layers: {kinds: [fc2], indices: [1]}
    points: [{component: linear, roles: [input], copies: [hp, quantized]}]
"""


def _full_grads(model) -> dict:
    """Every parameter's gradient under its global name, TP shards gathered in the unsplit layout."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from fxquant.megatron_glue.model import global_parameter_name

    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=ps.get_tensor_model_parallel_group())
            if model.config.gated_linear_unit and name.endswith("linear_fc1.weight"):  # [gate; up] per rank
                halves = [t.chunk(2, dim=0) for t in parts]
                g = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            else:
                g = torch.cat(parts, dim=p.partition_dim)
        out[global_parameter_name(name, model, tied=False)] = g.contiguous()
    return out


def _step(compiled, model, ids):
    """One forward+backward of this rank's stage; the per-token losses on the last stage, else None."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from fxquant.megatron_glue.graph_breaks import traceable_megatron
    from fxquant.megatron_glue.model import causal_attention_mask, position_ids

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    args = (ids, position_ids(BATCH, SEQ), causal_attention_mask(SEQ))
    hidden = None
    if not first:  # PP = 2 on two ranks: the peer is the other global rank
        hidden = torch.empty(SEQ, BATCH, HIDDEN)
        dist.recv(hidden, 0)
        model.set_input_tensor(hidden.requires_grad_())
    with traceable_megatron():
        out = compiled(*args, labels=ids) if last else compiled(*args)
    if not last:
        dist.send(out.detach().contiguous(), 1)
        grad = torch.empty_like(out)
        dist.recv(grad, 1)
        out.backward(grad)
        return None
    out.mean().backward()
    if hidden is not None:
        dist.send(hidden.grad.contiguous(), 0)
    return out.detach()


def run_layout(tp: int, pp: int, out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import fxquant
    from fxquant import capture
    from fxquant.megatron_glue import parallel
    from fxquant.megatron_glue.config import tiny_llama_config
    from fxquant.capture.runtime import RankInfo
    from fxquant.megatron_glue.model import build_gpt_model, layer_offset
    from fxquant.megatron_glue.run_config import ParallelLayout

    torch._dynamo.reset()
    info = parallel.initialize_parallel(ParallelLayout(tp=tp, pp=pp))
    model = build_gpt_model(tiny_llama_config(ffn_hidden_size=128), attention="sdpa", seed=7)
    spec = capture.load_spec("tp_pp.yaml", text=CAPTURE_SPEC)
    tag = f"tp{tp}pp{pp}"
    compiled = fxquant.compile(model, SCHEME, backend="aot_eager", strict=True, capture=spec)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    # The stage's layer offset is recorded in the run info only: taps already carry global layers.
    rank = RankInfo(rank=info.rank, world_size=info.world_size, tp_rank=info.tp_rank, tp_size=info.tp_size,
                    pp_rank=info.pp_rank, pp_size=info.pp_size, layer_offset=layer_offset(model))
    with capture.start(spec, out_dir / f"capture-{tag}", scheme=SCHEME, rank=rank):
        losses = _step(compiled, model, ids)
    state = fxquant.compile_state(compiled)
    grads = _full_grads(model)
    if losses is not None:
        grads["__per_token_loss__"] = losses.contiguous()
    sites = [{"module": s.site.module_path, "layer": s.site.layer, "status": s.status.value}
             for s in state.sites() if s.op.value == "megatron_linear"]
    if info.tp_rank == 0:
        save_file(grads, str(out_dir / f"{tag}-stage{info.pp_rank}.safetensors"))
        (out_dir / f"{tag}-stage{info.pp_rank}.json").write_text(json.dumps({"sites": sites}))


def worker(out_dir: str) -> None:
    from fxquant.megatron_glue import parallel

    layouts = [(1, 1)] if int(os.environ["WORLD_SIZE"]) == 1 else [(2, 1), (1, 2)]
    for tp, pp in layouts:
        run_layout(tp, pp, Path(out_dir))
    parallel.destroy_parallel()


def _launch(nproc: int, out: Path, port: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}",
           "--tee=3", str(Path(__file__)), str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def _load(out: Path, tag: str, stages: int) -> tuple[dict, list]:
    from safetensors.torch import load_file

    tensors, sites = {}, []
    for stage in range(stages):
        tensors.update(load_file(str(out / f"{tag}-stage{stage}.safetensors")))
        sites += json.loads((out / f"{tag}-stage{stage}.json").read_text())["sites"]
    return tensors, sites


def _assert_matches(ref: dict, got: dict, what: str) -> None:
    import torch

    assert ref.keys() == got.keys(), what
    for name, a in ref.items():
        torch.testing.assert_close(got[name], a, rtol=1e-4, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.slow
def test_tp2_and_pp2_match_one_process(tmp_path):
    import torch

    from fxquant import capture

    _launch(1, tmp_path, 29611)
    _launch(2, tmp_path, 29612)
    ref, ref_sites = _load(tmp_path, "tp1pp1", 1)
    assert len(ref_sites) == 9 and sum(s["status"] == "rewritten" for s in ref_sites) == 8  # LM head in HP
    for tag, stages in (("tp2pp1", 1), ("tp1pp2", 2)):
        got, sites = _load(tmp_path, tag, stages)
        torch.testing.assert_close(got["__per_token_loss__"], ref["__per_token_loss__"], rtol=1e-5, atol=0)
        _assert_matches(ref, got, tag)
        assert Counter((s["layer"], s["status"]) for s in sites) == Counter((s["layer"], s["status"]) for s in ref_sites)
    # PP=2: stage 1's `decoder.layers.0` is global layer 1 in the sites and in the capture records.
    stage1 = json.loads((tmp_path / "tp1pp2-stage1.json").read_text())["sites"]
    assert {s["layer"] for s in stage1 if s["module"].startswith("decoder.layers.0.")} == {1}
    records = {}
    for tag in ("tp1pp1", "tp2pp1", "tp1pp2"):
        cs = capture.open(tmp_path / f"capture-{tag}")
        records[tag] = cs
        assert {(r.layer, r.kind, r.role) for r in cs} == {
            (1, "fc1", "input"), (1, "fc1", "grad_output"), (1, "fc1", "weight"), (1, "fc2", "input")}, tag
        assert {r.gemm for r in cs.query(kind="fc2", copy="quantized")} == {"fprop", "wgrad"}, tag
    # shard_dim under TP = 2 only: column-parallel fc1 splits its weight's rows and its output (so its output
    # gradient) along the last dim, its input is whole; row-parallel fc2 splits its input along the last dim
    for tag in ("tp1pp1", "tp1pp2"):
        assert {r.fields["shard_dim"] for r in records[tag]} == {None}, tag
    tp2 = records["tp2pp1"]
    assert {(r.kind, r.role, r.copy, r.fields["shard_dim"]) for r in tp2} == {
        ("fc1", "input", "hp", None), ("fc1", "grad_output", "hp", 2), ("fc1", "weight", "hp", 0),
        ("fc2", "input", "hp", 2), ("fc2", "input", "quantized", 1)}  # a quantized copy is the GEMM's 2-D view
    assert all(len(r.shape) == 2 for r in tp2.query(kind="fc2", copy="quantized"))
    shards = sorted(tp2.query(kind="fc2", role="input", copy="hp"), key=lambda r: r.tp_rank)
    whole = torch.cat([tp2.load(r) for r in shards], dim=shards[0].fields["shard_dim"])
    torch.testing.assert_close(whole, records["tp1pp1"].load(records["tp1pp1"].query(kind="fc2", role="input",
                                                                                      copy="hp")[0]),
                               rtol=1e-5, atol=1e-6)
    (pp_rec,) = records["tp1pp2"].query(role="input", kind="fc1")
    (ref_rec,) = records["tp1pp1"].query(role="input", kind="fc1")
    assert (pp_rec.module, pp_rec.pp_rank, ref_rec.module) == (
        "decoder.layers.0.mlp.linear_fc1", 1, "decoder.layers.1.mlp.linear_fc1")
    torch.testing.assert_close(records["tp1pp2"].load(pp_rec), records["tp1pp1"].load(ref_rec), rtol=1e-5, atol=1e-6)
    assert len(records["tp2pp1"].query(role="input", kind="fc1")) == 2  # one record per TP rank


if __name__ == "__main__":
    worker(sys.argv[1])
