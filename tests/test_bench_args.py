"""benchmarks/ at the command line, cheaply: a bad argument ends in one line and exit status 2 before any work
(the measuring functions are replaced by ones that fail the test if called), ``--help`` shows the docstring's
whole first paragraph, the linear and fused rows are labelled with the sizes run, and every result JSON records
its environment (device, host CPU, torch, argv)."""
from __future__ import annotations

import json
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_block_reduction  # noqa: E402
import bench_capture  # noqa: E402
import bench_formats  # noqa: E402
import bench_fused  # noqa: E402
import bench_host  # noqa: E402
import bench_main  # noqa: E402
import bench_report  # noqa: E402
import bench_step  # noqa: E402
import envinfo  # noqa: E402
import run_all  # noqa: E402


def _ran(*args, **kwargs):
    raise AssertionError("the benchmark started work before refusing its arguments")


@pytest.fixture
def dynamo_config():
    """Dynamo's settings restored after a test whose script changes them (bench_step raises its cache limits)."""
    saved = torch._dynamo.config.save_config()
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # loading writes the deprecated settings back too
        torch._dynamo.config.load_config(saved)


@pytest.fixture
def no_work(monkeypatch, tmp_path, dynamo_config):
    """Every script's first expensive step fails the test; the working directory is a temporary one."""
    monkeypatch.chdir(tmp_path)
    for mod, name in ((bench_formats, "bench"), (bench_host, "median_ms"), (bench_capture, "hash_speeds"),
                      (bench_capture, "raw_write"), (bench_capture, "step_times"), (bench_report, "write_set"),
                      (bench_block_reduction, "bench"), (bench_step, "run_model"), (bench_step, "compile_only")):
        monkeypatch.setattr(mod, name, _ran)
    monkeypatch.setattr(run_all, "RUNNERS", {name: _ran for name in run_all.SECTIONS})


BAD = [
    (bench_formats, ["--size", "abc"], "--size"),
    (bench_formats, ["--size", "0"], "--size"),
    (bench_formats, ["--size", "2^-1"], "--size"),
    (bench_formats, ["--formats", "mxfp8_e4m3,bogus"], "bogus"),
    (bench_formats, ["--repeat", "0"], "--repeat"),
    (bench_formats, ["--floor", "--floor-blocks", "0"], "--floor-blocks"),
    (bench_formats, ["--floor", "--floor-blocks", "3000"], "does not divide"),
    (bench_formats, ["--device", "nodevice"], "--device"),
    (bench_host, ["--repeat", "0"], "--repeat"),
    (bench_host, ["--cols", "-1"], "--cols"),
    (bench_capture, ["--steps", "0"], "--steps"),
    (bench_capture, ["--heads", "3"], "--heads"),
    (bench_capture, ["--dim", "100"], "--dim"),
    (bench_capture, ["--skip-io", "--skip-steps"], "nothing to measure"),
    (bench_report, ["--workers", "0"], "--workers"),
    (bench_report, ["--quantized-every", "-1"], "--quantized-every"),
    (bench_block_reduction, ["--elements", "100"], "--elements"),
    (bench_block_reduction, ["--repeat", "0"], "--repeat"),
    (run_all, ["--repeat", "0"], "--repeat"),
    (run_all, ["--repeat", "-1"], "--repeat"),
    (run_all, ["--warmup", "-1"], "--warmup"),
    (run_all, ["--seq", "2048", "0"], "--seq"),
    (run_all, ["--device", "nodevice"], "--device"),
    (bench_step, ["--rounds", "0"], "--rounds"),
    (bench_step, ["--presets", "linear_mxfp8,bogus"], "bogus"),
    (bench_step, ["--dim", "100", "--heads", "8"], "--dim"),
]


@pytest.mark.parametrize("mod, argv, needle", BAD, ids=[f"{m.__name__} {' '.join(a)}" for m, a, _ in BAD])
def test_bad_arguments_are_refused_in_one_line_before_any_work(no_work, tmp_path, capsys, mod, argv, needle):
    extra = ["--json", str(tmp_path / "out.json")] if mod is run_all else []
    with pytest.raises(SystemExit) as exc:
        mod.main([*argv, *extra])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err and needle in err.splitlines()[-1] and "error:" in err.splitlines()[-1], err
    assert not list(tmp_path.iterdir()), "nothing may be written"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of --device cuda where there is none")
def test_cuda_is_refused_where_there_is_none(no_work, tmp_path, capsys):
    for mod in (bench_formats, run_all):
        with pytest.raises(SystemExit) as exc:
            mod.main(["--device", "cuda", "--json", str(tmp_path / "out.json")])
        assert exc.value.code == 2 and "no CUDA device" in capsys.readouterr().err


def test_flash_scripts_refuse_presets_without_flash_attention(tmp_path):
    """Before loading the earlier kernels (bench_flash_ab) or building tensors: an unknown preset and one that
    quantizes no attention."""
    for script, args, needle in (("bench_flash_ab.py", ["--old", str(tmp_path), "--presets", "bf16,bogus"], "bogus"),
                                 ("bench_flash_ab.py", ["--old", str(tmp_path), "--presets", "linear_mxfp8"],
                                  "quantizes no attention"),
                                 ("bench_flash_tiles.py", ["--head-dim", "3"], "--head-dim")):
        run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                             text=True, cwd=tmp_path, timeout=300)
        assert run.returncode == 2 and needle in run.stderr and "Traceback" not in run.stderr, run.stderr


HELP = [bench_block_reduction, bench_capture, bench_host, bench_step, run_all, bench_formats, bench_main, bench_report]


@pytest.mark.parametrize("mod", HELP, ids=[m.__name__ for m in HELP])
def test_help_shows_the_whole_first_paragraph(mod, capsys):
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exc.value.code == 0
    assert " ".join(mod.__doc__.split("\n\n")[0].split()) in out


def test_linear_and_fused_rows_name_the_sizes_run(monkeypatch):
    m, shapes = bench_fused.linear_shapes(quick=True)
    assert m == 256 and [(k, n) for _, k, n in shapes] == [(512, 512), (256, 1024), (1024, 256)]
    assert [label for label, _, _ in shapes] == ["square / 8: K=512 N=512 M=256",
                                                 "llama1b fc1 (gate/up) / 8: K=256 N=1024 M=256",
                                                 "llama1b fc2 (down) / 8: K=1024 N=256 M=256"]
    assert bench_fused.linear_shapes(quick=False)[1][1][0] == "llama1b fc1 (gate/up): K=2048 N=8192 M=8192"
    # the linear section's rows carry those labels (nothing timed: the timer returns at once, no preset runs)
    monkeypatch.setattr(run_all, "LINEAR_PRESETS", ())
    rows = run_all.linear(types.SimpleNamespace(quick=True), torch.device("cpu"), lambda fn: 1e-3)
    assert list(dict.fromkeys(r["shape"] for r in rows)) == [label for label, _, _ in shapes]


def _has_environment(env: dict, argv: list[str]) -> None:
    assert env["argv"] == argv
    assert env["torch"] == torch.__version__ and env["device"] and "threads" in env["host"]


def test_environment_names_device_host_torch_and_argv():
    env = envinfo.environment("cpu", ["--x", "1"])
    _has_environment(env, ["--x", "1"])
    assert env["device"] == env["host"] and env["device_type"] == "cpu" and env["date"].endswith("+00:00")


def test_bench_fused_runs_its_section_and_records_the_environment(tmp_path, capsys):
    out = tmp_path / "fused.json"
    argv = ["--quick", "--device", "cpu", "--json", str(out)]
    assert bench_fused.main(argv) == 0
    result = json.loads(out.read_text())
    assert list(result["sections"]) == ["fused"]
    rows = result["sections"]["fused"]["rows"]
    if not torch.cuda.is_available():
        assert [r["shape"] for r in rows] == [label for label, _, _ in bench_fused.linear_shapes(True)[1]]
        assert all(r["note"] == bench_fused.NO_GPU for r in rows)
    _has_environment(result["environment"], ["--sections", "fused", "--json", "bench_fused.json", *argv])
    assert "triton" in result["environment"] and "torchao" in result["environment"]
    assert bench_fused.main(["--sections", "quantize"]) == 2 and "fused section only" in capsys.readouterr().err


def test_bench_formats_json_has_the_environment(tmp_path):
    out = tmp_path / "formats.json"
    argv = ["--size", "2^12", "--formats", "fp8_e4m3", "--impls", "eager", "--repeat", "1", "--device", "cpu",
            "--json", str(out)]
    assert bench_formats.main(argv) == 0
    result = json.loads(out.read_text())
    _has_environment(result["environment"], argv)
    assert result["device"] == result["environment"]["device"]  # the earlier keys stay


def test_bench_main_and_block_reduction_json_have_the_environment(monkeypatch, tmp_path):
    fake = {"wall_s": 1.0, "first_step_s": 1.0, "median_step_ms": 1.0, "iterations": 2, "final_loss": 1.0}
    monkeypatch.setattr(bench_main, "run_variant", lambda *a: fake)
    out = tmp_path / "main.json"
    argv = ["--variants", "default", "--iters", "2", "--json", str(out)]
    assert bench_main.main(argv) == 0
    env = json.loads(out.read_text())["environment"]
    _has_environment(env, argv)
    assert env["cpu"] == env["host"] and env["iters"] == 2

    monkeypatch.setattr(bench_block_reduction, "bench", lambda args: {
        "device": "d", "torch": "t", "vec_isa": "v", "date": "now", "elements": args.elements, "rows": []})
    out = tmp_path / "block.json"
    argv = ["--elements", "128", "--repeat", "1", "--json", str(out)]
    assert bench_block_reduction.main(argv) == 0
    _has_environment(json.loads(out.read_text())["environment"], argv)


def test_bench_step_capture_and_host_json_have_the_environment(monkeypatch, tmp_path, dynamo_config):
    pytest.importorskip("numba", reason="bench_host compares the numba kernels with their torch twins")
    monkeypatch.setattr(bench_step, "run_model", lambda *a: [])
    out = tmp_path / "step.json"
    argv = ["--models", "torch", "--rounds", "1", "--json", str(out)]
    assert bench_step.main(argv) == 0
    env = json.loads(out.read_text())["environment"]
    _has_environment(env, argv)
    assert len(env["load_average"]) == 3

    monkeypatch.setattr(bench_capture, "hash_speeds", lambda: {"crc32 (zlib)": 1.0})
    out = tmp_path / "capture.json"
    argv = ["--skip-steps", "--write-mib", "1", "--repeats", "1", "--dir", str(tmp_path / "w"), "--out", str(out)]
    bench_capture.main(argv)
    _has_environment(json.loads(out.read_text())["environment"], argv)

    monkeypatch.setattr(bench_host, "median_ms", lambda fn, repeat: 1.0)
    out = tmp_path / "host.json"
    argv = ["--rows", "4", "--cols", "64", "--repeat", "1", "--json", str(out)]
    threads = torch.get_num_threads()
    try:
        assert bench_host.main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # bench_host measures on one thread
    _has_environment(json.loads(out.read_text())["environment"], argv)
