"""`fxquant what-if`: the error any captured high-precision tensor would have in any format, checked against
direct computation with fxquant.formats, with block sizes, groups, filters and the predecessor's .pt files."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from fxquant import formats
from fxquant.analysis.what_if import what_if
from fxquant.capture.export import export_pt
from fxquant.cli import main
from tests.analysis_helpers import write_set, write_tensors


def _direct(xs, quantize):
    e2 = r2 = rel = 0.0
    nz = 0
    for x in xs:
        q, xd = quantize(x).double(), x.double()
        e = q - xd
        e2, r2 = e2 + e.square().sum().item(), r2 + xd.square().sum().item()
        m = xd != 0
        rel, nz = rel + (e[m].abs() / xd[m].abs()).sum().item(), nz + int(m.sum())
    return 10 * math.log10(r2 / e2), math.sqrt(e2 / r2), rel / nz


def test_numbers_equal_direct_computation_for_every_format(tmp_path):
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(16, 96, generator=g) * 10.0 ** k for k in (-3, 0, 2)]
    xs[1][0, :5] = 0.0
    write_tensors(tmp_path / "cap", xs)
    res = what_if(tmp_path / "cap", "all", by=())
    assert res.records == 3 and [r["format"] for r in res.rows] == formats.names()
    for r in res.rows:
        fmt = formats.get(r["format"])
        if r["format"] in ("bf16", "fp16"):
            continue  # fp16 flushes the 1e-3-scaled tail; bf16 of float32 data: both checked by sqnr below
        sqnr, rel, mean_rel = _direct(xs, lambda x: fmt.quantize(x, -1))
        assert r["tensors"] == 3 and r["numel"] == 3 * 16 * 96
        assert r["sqnr_db"] == pytest.approx(sqnr, rel=1e-9) and r["rel_err"] == pytest.approx(rel, rel=1e-9)
        assert r["mean_rel_err"] == pytest.approx(mean_rel, rel=1e-9), r["format"]
    by = {r["format"]: r for r in res.rows}
    assert by["mxfp8_e4m3"]["sqnr_db"] > by["mxfp4_e2m1"]["sqnr_db"] and by["bf16"]["sqnr_db"] > 40


def test_block_size_dim_rounding_and_groups(tmp_path):
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(64, 8, generator=g) * torch.logspace(-4, 4, 64, base=2.0)[:, None] for _ in range(2)]
    write_tensors(tmp_path / "cap", xs)
    res = what_if(tmp_path / "cap", ["mxfp4", "hifp8"], block_size=8, dim=0, rounding="ta", by=("layer",))
    assert [(r["layer"], r["format"]) for r in res.rows] == [(0, "mxfp4_e2m1/b8"), (0, "hifp8"), (1, "mxfp4_e2m1/b8"),
                                                             (1, "hifp8")]
    b8 = dataclasses.replace(formats.get("mxfp4"), block_size=8)
    sqnr, rel, _ = _direct(xs[:1], lambda x: b8.quantize(x, 0, rounding="ta"))
    assert res.rows[0]["sqnr_db"] == pytest.approx(sqnr, rel=1e-9) and res.rows[0]["rel_err"] == pytest.approx(rel)
    b32 = what_if(tmp_path / "cap", ["mxfp4"], dim=0, rounding="ta", by=("layer",)).rows[0]
    assert b32["format"] == "mxfp4_e2m1" and b32["sqnr_db"] < res.rows[0]["sqnr_db"]  # smaller blocks: less error
    last = what_if(tmp_path / "cap", ["mxfp4"], block_size=8, rounding="ta", by=("layer",)).rows[0]
    assert last["sqnr_db"] != res.rows[0]["sqnr_db"]  # blocked along the last dim instead
    with pytest.raises(ValueError, match="block_size=0: must be an integer >= 1"):
        what_if(tmp_path / "cap", ["mxfp4"], block_size=0)
    with pytest.raises(ValueError, match="did you mean 'mxfp4'"):
        what_if(tmp_path / "cap", ["mxfp44"])


def test_pt_directory_where_and_cli(tmp_path, capsys):
    write_set(tmp_path / "cap", ranks=1, layers=2, what="full")
    export_pt(__import__("fxquant").capture.open(tmp_path / "cap"), tmp_path / "pt")
    a = what_if(tmp_path / "cap", ["hifp8", "hifp8_legacy_clamp"], where={"role": "grad_output"})
    b = what_if(tmp_path / "pt", ["hifp8", "hifp8_legacy_clamp"], where={"role": "grad_output"})
    assert a.records == b.records == 2 and a.rows == b.rows  # quantized copies are never "what-if" sources
    assert main(["what-if", str(tmp_path / "pt"), "--formats", "mxfp8,nvfp4", "--by", "role,layer", "--json", "-q",
                 "--per-tensor", "--where", "layer=1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["records"] == 3 and {(r["role"], r["layer"]) for r in out["rows"]} == {
        ("input", 1), ("weight", 1), ("grad_output", 1)}
    assert len(out["tensors"]) == 6 and {t["format"] for t in out["tensors"]} == {"mxfp8_e4m3", "nvfp4"}
    assert main(["what-if", str(tmp_path / "pt"), "--where", "role=nothing", "-q"]) == 1  # as report's empty selection
    assert (f"error: no high-precision records with a stored tensor in {tmp_path / 'pt'} match --where role=nothing: "
            "nothing to analyse") in capsys.readouterr().err


def test_cli_refuses_missing_directories_and_unknown_group_fields(tmp_path, capsys):
    """A mistyped DIR is an error (status 2) as in `report`, not a warning; `--by` names are checked against the
    record fields like `--where`'s, not turned into one group labelled `-`."""
    write_tensors(tmp_path / "cap", [torch.randn(4, 32)])
    assert main(["what-if", str(tmp_path / "cap"), str(tmp_path / "typo"), "-q"]) == 2
    assert f"fxquant what-if: error: capture directory not found: {tmp_path / 'typo'}" in capsys.readouterr().err
    assert main(["what-if", str(tmp_path / "cap"), "--by", "role,nosuch", "-q"]) == 2
    err = capsys.readouterr().err
    assert "by='nosuch': unknown record field" in err and "'layer'" in err
    with pytest.raises(ValueError, match="by='rol': unknown record field.*did you mean 'role'"):
        what_if(tmp_path / "cap", ["hifp8"], by=("rol",))
    assert main(["what-if", str(tmp_path / "cap"), "--formats", "hifp8", "--by", "layer", "-q"]) == 0


def test_overflow_to_inf_is_counted_and_not_reported_as_lossless(tmp_path):
    """bf16 values above fp16's 65504 become Inf in fp16: inf_pct counts them (nan_pct does not), and the
    error metrics are unbounded, not the lossless numbers of the elements that stayed finite."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    x[0, :8] = 1e5
    write_tensors(tmp_path / "cap", [x])
    rows = {r["format"]: r for r in what_if(tmp_path / "cap", "fp16,fp8_e4m3", by=()).rows}
    fp16 = rows["fp16"]
    assert fp16["inf_pct"] == 100 * 8 / 1024 and fp16["nan_pct"] == 0.0
    assert fp16["sqnr_db"] == -math.inf and fp16["cosine"] is None
    assert fp16["rel_err"] == fp16["mse"] == fp16["rmse"] == fp16["mae"] == fp16["max_err"] == math.inf
    assert fp16["mean_rel_err"] == math.inf
    e4m3 = rows["fp8_e4m3"]  # saturates: finite everywhere, a finite error
    assert e4m3["inf_pct"] == e4m3["nan_pct"] == 0.0 and 0 < e4m3["sqnr_db"] < 1
    fine = what_if(tmp_path / "cap", "fp8_e4m3", by=(), per_tensor=True).tensors[0]
    assert fine["sqnr_db"] == e4m3["sqnr_db"]


def test_the_table_shows_nan_and_inf_percentages(tmp_path, capsys):
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    x[0, :8] = 1e5
    write_tensors(tmp_path / "cap", [x])
    assert main(["what-if", str(tmp_path / "cap"), "--formats", "fp16", "-q"]) == 0
    header, _, row = capsys.readouterr().out.splitlines()[:3]
    cells = dict(zip(header.split(), row.split()))
    assert cells["inf_pct"] == f"{100 * 8 / 1024:.4g}" and float(cells["nan_pct"]) == 0


def _truncate_shards(rank_dir):
    for shard in (rank_dir / "shards").glob("*.safetensors"):
        shard.write_bytes(shard.read_bytes()[:64])


def test_unreadable_tensors_are_named_and_not_counted(tmp_path, capsys):
    """A truncated shard's tensors are problems and left out: the footer counts the tensors that were read; when
    none could be read the command says so and exits 1, as `report` does, instead of printing an empty table."""
    write_set(tmp_path / "cap", ranks=2, layers=3, what="full", quantized=False)  # 9 high-precision tensors a rank
    _truncate_shards(tmp_path / "cap" / "rank-00000")
    res = what_if(tmp_path / "cap", "mxfp8", by=())
    assert (res.records, res.loaded, res.rows[0]["tensors"]) == (18, 9, 9)
    assert len(res.problems) == 9 and all("rank-00000" in p and "unreadable" in p for p in res.problems)
    assert main(["what-if", str(tmp_path / "cap"), "--formats", "mxfp8", "-q"]) == 0
    out = capsys.readouterr()
    assert "\n9 high-precision tensor(s); 9 of the 18 selected could not be read" in out.out
    assert out.err.count("warning: ") == 9
    assert main(["what-if", str(tmp_path / "cap"), "--formats", "mxfp8", "-q", "--json"]) == 0
    assert {k: v for k, v in json.loads(capsys.readouterr().out).items() if k in ("records", "loaded")} == {
        "records": 18, "loaded": 9}

    _truncate_shards(tmp_path / "cap" / "rank-00001")
    assert main(["what-if", str(tmp_path / "cap"), "--formats", "mxfp8", "-q"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and "fxquant what-if: error: none of the 18 selected high-precision tensor(s) could be " \
        "read" in out.err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tensors_get_the_formats_own_values(tmp_path, dtype):
    """An fp16 tensor was quantized in fp16: bf16 of 65504 is 65536, which fp16 storage made Inf (reported 50 %
    Inf, SQNR -inf); a bf16 tensor's NVFP4 values were rounded to bf16. The formats' values are float32's."""
    noise = torch.randn(1, 32, generator=torch.Generator().manual_seed(0)) * 100
    x = torch.cat([torch.tensor([[65504.0, 1.0, -65504.0, 3.0] * 8]), noise], 1).to(dtype)
    write_tensors(tmp_path / "cap", [x])
    res = {r["format"]: r for r in what_if(tmp_path / "cap", ["bf16", "nvfp4"], by=()).rows}
    if dtype == torch.bfloat16:
        assert res["bf16"]["sqnr_db"] == math.inf  # bf16 values are bf16's
    for name in ("bf16", "nvfp4") if dtype == torch.float16 else ("nvfp4",):
        sqnr, _, _ = _direct([x.float()], lambda t: formats.get(name).quantize(t, -1))
        assert res[name]["inf_pct"] == 0 and res[name]["sqnr_db"] == pytest.approx(sqnr, rel=1e-12), name
