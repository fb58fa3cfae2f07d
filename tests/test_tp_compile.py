"""Megatron TP=2 on two CPU processes (torchrun, gloo) with fxquant.compile matches TP=1 within fp32 tolerance.

The test launches this file as a torchrun worker twice (1 and 2 processes). Every sharded dimension of the
model is a multiple of 32 per rank (hidden 64, FFN 128, 4 heads of 16), so MX blocks are the same under
both layouts and only the order of the tensor-parallel sums differs. Each worker writes the loss and, per
global parameter name, the squared norm of the full gradient (sharded parameters summed over TP ranks).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCHEME = "linear_mxfp8"
STRICT = True


def worker(out_path: str) -> None:
    import torch
    import torch.distributed as dist

    import fxquant
    from fxquant.megatron_glue import parallel
    from fxquant.megatron_glue.config import tiny_llama_config
    from fxquant.megatron_glue.graph_breaks import traceable_megatron
    from fxquant.megatron_glue.model import build_gpt_model, causal_attention_mask, position_ids
    from fxquant.megatron_glue.run_config import ParallelLayout

    tp = int(os.environ["WORLD_SIZE"])
    info = parallel.initialize_parallel(ParallelLayout(tp=tp))
    model = build_gpt_model(tiny_llama_config(ffn_hidden_size=128), attention="sdpa", seed=7)
    compiled = fxquant.compile(model, SCHEME, backend="aot_eager", strict=STRICT)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with traceable_megatron():
        loss = compiled(ids, position_ids(2, 32), causal_attention_mask(32), labels=ids).mean()
    loss.backward()
    norms = {}
    for name, p in model.named_parameters():
        sq = p.grad.double().pow(2).sum()
        if getattr(p, "tensor_model_parallel", False):
            dist.all_reduce(sq)
        norms[name] = sq.item()
    rewritten = sum(s.status.value == "rewritten" for s in fxquant.compile_state(compiled).sites())
    if info.rank == 0:
        Path(out_path).write_text(json.dumps({"loss": loss.item(), "grad_sq": norms, "rewritten": rewritten}))
    parallel.destroy_parallel()


def _launch(nproc: int, out: Path, port: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}",
           "--tee=3", str(Path(__file__)), str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.slow
def test_tp2_matches_tp1(tmp_path):
    tp1 = _launch(1, tmp_path / "tp1.json", 29611)
    tp2 = _launch(2, tmp_path / "tp2.json", 29612)
    assert tp1["rewritten"] == tp2["rewritten"] == 8  # the 8 linears, in both layouts
    assert abs(tp1["loss"] - tp2["loss"]) <= 1e-5 * abs(tp1["loss"])
    assert tp1["grad_sq"].keys() == tp2["grad_sq"].keys()
    for name, a in tp1["grad_sq"].items():
        b = tp2["grad_sq"][name]
        assert abs(a - b) <= 1e-4 * abs(a) + 1e-12, (name, a, b)


if __name__ == "__main__":
    worker(sys.argv[1])
