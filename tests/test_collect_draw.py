"""`fxquant collect` (single / batch / quick) and `fxquant draw` (collect / visualize / both): real short
training runs with capture through `python -m experiments run`, counted per pattern, then `fxquant report`."""
from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core", reason="needs megatron-core")

FAST = ["--backend", "eager"]  # fxquant's rewritten graph interpreted: the same captures, less compile time


def _collections(root):
    return json.loads((root / "collection_summary.json").read_text())["collections"]


def _summary(root):
    """The latest collection under `root`."""
    return _collections(root)[-1]


def _check_counts(row, scheme_field=True):
    """The per-pattern counts agree with the capture set they were read from."""
    from fxquant import capture

    cs = capture.open(row["captures"])
    assert cs.committed and cs.verify() == []
    assert row["records"] == len(cs) == row["forward"] + row["backward"] == row["pre"] + row["post"] \
        == row["FA"] + row["linear"]
    assert row["FA"] > 0 and row["linear"] > 0
    assert row["quantized"] == len(cs.query(copy="quantized"))
    if scheme_field:
        assert cs.values("scheme") == [row["scheme"]]
    return cs


@pytest.mark.dist
def test_collect_quick_then_draw_visualize(tmp_path, capsys):
    from fxquant.cli import main

    logs = tmp_path / "enhanced_tensor_logs"
    assert main(["collect", "quick", "hifp8", "--tensor-save-dir", str(logs), "--out", str(tmp_path / "runs"),
                 "--export-pt", str(tmp_path / "pt"), *FAST]) == 0
    summary = _summary(logs)
    assert summary["mode"] == "quick" and [r["scheme"] for r in summary["runs"]] == ["FA_linear_hifp8"]
    (row,) = summary["runs"]
    assert row["status"] == "ok" and (row["iterations"], row["micro_batches"]) == ([0], [0])
    cs = _check_counts(row)
    assert row["quantized"] > 0 and set(cs.query(copy="quantized").values("format")) == {"hifp8"}
    metrics = (tmp_path / "runs" / "llama32-1b-tiny" / "mock" / "FA_linear_hifp8" / "metrics.jsonl").read_text()
    assert len(metrics.splitlines()) == 1
    assert "FA_linear_hifp8" in (logs / "collection_summary.txt").read_text()
    pts = sorted((tmp_path / "pt" / "FA_linear_hifp8").glob("*.pt"))  # the predecessor's files, safely loadable
    assert len(pts) == row["tensors"]
    first = torch.load(pts[0], weights_only=True)
    assert set(first) == {"tensor", "tensor_info", "metadata"} and first["metadata"]["quant_type"] == "FA_linear_hifp8"

    # a second collection into the same directory keeps the first one's summary; visualize compares both
    first = _collections(logs)
    assert main(["collect", "--mode", "batch", "--quant-types", "bf16", "--collect-micro-batches", "1", "--nproc",
                 "2", "--tensor-save-dir", str(logs), "--out", str(tmp_path / "runs"), *FAST]) == 0
    collections = _collections(logs)
    assert collections[:1] == first and [c["mode"] for c in collections] == ["quick", "batch"]
    (bf16,) = collections[1]["runs"]
    assert (bf16["scheme"], bf16["status"]) == ("bf16", "ok")
    _check_counts(bf16)
    assert (bf16["iterations"], bf16["micro_batches"], bf16["quantized"]) == ([0], [0], 0)  # bf16: no quantized copies
    assert bf16["ranks"] == [0, 1] and row["ranks"] == [0]  # torchrun, DP=2: both ranks' shards are counted
    text = (logs / "collection_summary.txt").read_text()
    assert "collection 1: quick" in text and "collection 2: batch" in text and "FA_linear_hifp8" in text

    draw = tmp_path / "draw"
    assert main(["draw", "--tensor-dir", str(logs), "--output-dir", str(draw), "--no-plots"]) == 0  # visualize
    assert "2 capture set(s) and 2 training run(s) of 2 collection(s)" in capsys.readouterr().out
    report = json.loads((draw / "report.json").read_text())
    assert report["records"] == row["records"] + bf16["records"] and report["problems"] == []
    assert (draw / "index.html").is_file()
    curves = json.loads((draw / "training" / "loss_vs_reference.json").read_text())
    assert curves["reference"] == "bf16" and sorted(r["run"] for r in curves["runs"]) == ["FA_linear_hifp8", "bf16"]
    (quantized,) = [r for r in curves["runs"] if r["run"] == "FA_linear_hifp8"]
    assert quantized["mre_all"] is not None  # compared with the bf16 collection's loss

    assert main(["draw", "visualize", "--tensor-dir", str(tmp_path / "runs"), "--output-dir", str(draw)]) == 2
    assert "holds no capture set" in capsys.readouterr().err


def test_collect_batch_every_quant_type(tmp_path, capsys):
    from experiments.catalog import PREDECESSOR_SCHEMES
    from fxquant.cli import main

    logs = tmp_path / "logs"
    common = ["--tensor-save-dir", str(logs), "--out", str(tmp_path / "runs"), "--collect-micro-batches", "1", *FAST]
    assert main(["collect", "batch", *common, "--dry-run"]) == 0  # the predecessor's four quant types by default
    out = capsys.readouterr().out
    assert out.count("torch.distributed.run") == 4
    for scheme in ("bf16", "FA_linear_mxfp8", "FA_linear_mxfp4", "FA_linear_hifp8"):
        assert f'"dir": "{logs / scheme}"' in out
    assert main(["collect", "batch", "--quant-types", *PREDECESSOR_SCHEMES, *common, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("torch.distributed.run") == len(PREDECESSOR_SCHEMES) == 10
    for scheme in PREDECESSOR_SCHEMES:
        assert f'"dir": "{logs / scheme}"' in out

    assert main(["collect", "batch", "--legacy", *common, "--dry-run"]) == 0  # the predecessor's four quant types
    out = capsys.readouterr().out
    assert out.count("torch.distributed.run") == 4
    for scheme in ("legacy_bf16", "legacy_FA_linear_mxfp8", "legacy_FA_linear_mxfp4", "legacy_FA_linear_hifp8"):
        assert f'"scheme": "{scheme}"' in out and f'"dir": "{logs / scheme}"' in out

    assert main(["collect", "batch", "mxfp8", *common]) == 2
    assert "use --quant-types" in capsys.readouterr().err
    assert main(["collect", "single", "--quant-type", "mxfp9", *common]) == 2
    assert "did you mean 'mxfp8'" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["collect", "draw"])
def test_every_option_has_help_with_its_default(verb):
    """`fxquant collect|draw --help`: each option has a help line naming its default; the spec flag is
    --capture, as in `experiments run`; the predecessor's flag names are accepted."""
    import argparse

    from fxquant.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[verb]
    for action in sub._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            assert action.help and "default" in action.help, action.option_strings
    flags = {s for a in sub._actions for s in a.option_strings}
    assert {"--capture", "--tensor-path", "--tokenizer-path", "--data-path", "--dtype", "--control-micro-batches",
            "--legacy"} <= flags



def test_draw_collect_dry_run_without_quant_types(tmp_path, capsys):
    """`draw collect` has no --quant-types (draw's parser leaves it out) and still plans its one collection."""
    from fxquant.cli import main

    logs = tmp_path / "logs"
    assert main(["draw", "collect", "mxfp8", "--tensor-dir", str(logs), "--out", str(tmp_path / "runs"),
                 "--dry-run"]) == 0
    assert f'"dir": "{logs / "FA_linear_mxfp8"}"' in capsys.readouterr().out

def test_summary_keeps_every_collection(tmp_path):
    """A summary in the one-collection layout becomes the first entry; later ones are appended; each run
    directory with metrics is listed once, in order."""
    from fxquant.cli import collect_summary

    runs = [tmp_path / n for n in ("a", "b")]
    for r in runs:
        r.mkdir()
        (r / "metrics.jsonl").write_text('{"iteration": 1, "loss": 1.0}\n')
    old = {"mode": "single", "model": "m", "variant": "tiny", "dataset": "mock",
           "runs": [{"scheme": "x", "run_dir": str(runs[0])}]}
    (tmp_path / "collection_summary.json").write_text(json.dumps(old))
    new = {**old, "mode": "batch", "started": "t", "runs": [{"scheme": "y", "run_dir": str(runs[1])},
                                                            {"scheme": "x", "run_dir": str(runs[0])},
                                                            {"scheme": "z", "run_dir": str(tmp_path / "gone")}]}
    assert collect_summary.append(tmp_path, new, "table") == 2
    assert collect_summary.read(tmp_path) == [old, new]
    assert collect_summary.run_dirs(tmp_path) == [str(runs[0]), str(runs[1])]
    assert "collection 2: batch at t" in (tmp_path / "collection_summary.txt").read_text()
    (tmp_path / "collection_summary.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected {'collections'"):
        collect_summary.read(tmp_path)


def _dry_config(out):
    """The resolved configuration that `collect --dry-run` printed for its one run."""
    return json.loads(out[out.index("\n{") + 1:out.rindex("}") + 1])


def test_collect_plan_custom_quant_type_predecessor_flags_and_refusals(tmp_path, capsys, monkeypatch):
    from fxquant.cli import main

    logs = tmp_path / "logs"
    common = ["--tensor-save-dir", str(logs), "--out", str(tmp_path / "runs"), "--dry-run"]
    monkeypatch.setenv("CUSTOM_QUANT_TYPE", "hifp8")
    assert main(["collect", "single", *common]) == 0  # honoured when the command line names no quant type
    out = capsys.readouterr().out
    assert "quant type hifp8 from CUSTOM_QUANT_TYPE" in out and _dry_config(out)["scheme"] == "FA_linear_hifp8"
    assert main(["collect", "single", "mxfp4", *common]) == 0
    out = capsys.readouterr().out
    assert "CUSTOM_QUANT_TYPE=hifp8 not used: the command line names mxfp4" in out
    assert _dry_config(out)["scheme"] == "FA_linear_mxfp4"
    assert main(["collect", "batch", "--quant-types", "bf16", *common]) == 0
    assert "CUSTOM_QUANT_TYPE=hifp8 not used: batch collects bf16" in capsys.readouterr().out
    monkeypatch.setenv("CUSTOM_QUANT_TYPE", "hifp9")
    assert main(["collect", "quick", *common]) == 2
    assert "'hifp9' (did you mean 'hifp8'?)" in capsys.readouterr().err
    monkeypatch.delenv("CUSTOM_QUANT_TYPE")

    # the predecessor's flags, mapped: --tensor-path --tokenizer-path --data-path --dtype --control-micro-batches
    src = tmp_path / "wiki.jsonl"
    src.write_text("".join(json.dumps({"text": f"article {i} " * 40}) + "\n" for i in range(8)))
    prefix = tmp_path / "wiki" / "wikipedia_text_document"
    assert main(["prepare-data", str(src), "--dataset", "wikipedia", "-o", str(prefix), "-q"]) == 0
    capsys.readouterr()
    assert main(["collect", "single", "mxfp8", "--tensor-path", str(logs), "--tokenizer-path", "byte",
                 "--dataset", "wikipedia", "--data-path", str(prefix), "--dtype", "bf16", "--control-micro-batches",
                 "1", "--out", str(tmp_path / "runs"), "--dry-run"]) == 0
    config = _dry_config(capsys.readouterr().out)
    assert config["capture"]["dir"] == str((logs / "FA_linear_mxfp8").resolve())
    assert (config["tokenizer"], config["data"]["prefixes"], config["train"]["precision"]) == \
        ("byte", [str(prefix)], "bf16")
    assert (config["capture"]["iterations"], config["capture"]["micro_batches"]) == (1, 1)
    for argv, message in [
        (["single", "mxfp8", "--dtype", "fp8"], "emulates low-precision GEMMs by scheme"),
        (["single", "mxfp8", "--dtype", "fp16"], "allowed: bf16, fp32"),
        (["single", "mxfp8", "--data-path", str(prefix)], "needs exactly one indexed dataset"),  # dataset mock
        (["single", "FA_PV_mxfp8", "--legacy"], "no legacy preset for 'FA_PV_mxfp8'"),
        (["single", str(tmp_path / "s.yaml"), "--legacy"], "used as written: drop --legacy"),
        (["single", str(tmp_path / "absent.yaml")], "absent.yaml' does not exist"),
    ]:
        assert main(["collect", *argv, *common]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert main(["collect", "single", "FA_mxfp8", "--legacy", *common]) == 0
    assert _dry_config(capsys.readouterr().out)["scheme"] == "legacy_FA_mxfp8"

    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - linear: {format: mxfp9}\n")
    assert main(["collect", "single", str(bad), *common]) == 2  # read before any run, with file:line
    assert f"{bad}:2" in capsys.readouterr().err


def test_collect_scheme_yaml(tmp_path, capsys):
    """A scheme YAML is collected under its own name; each quantized copy is in the file's format."""
    from fxquant.cli import collect_plan, main

    yaml = tmp_path / "lin4.yaml"
    yaml.write_text("name: lin_mxfp4\nrules:\n  - linear: {format: mxfp4}\n")
    assert collect_plan.collection_for(str(yaml)) == collect_plan.Collection("lin_mxfp4", str(yaml.resolve()))
    logs = tmp_path / "logs"
    common = ["--tensor-save-dir", str(logs), "--out", str(tmp_path / "runs"), *FAST]
    if main(["collect", "quick", str(yaml), *common, "--dry-run"]) != 0:
        err = capsys.readouterr().err
        assert "unknown scheme" in err, err  # the only acceptable reason: `experiments run` predates YAML schemes
        pytest.skip("`experiments run --scheme FILE.yaml` is not accepted by this checkout's launcher")
    assert main(["collect", "quick", str(yaml), *common]) == 0
    (row,) = _summary(logs)["runs"]
    assert (row["scheme"], row["scheme_file"], row["captures"]) == ("lin_mxfp4", str(yaml.resolve()),
                                                                    str(logs / "lin_mxfp4"))
    assert row["scheme_text"] == yaml.read_text()
    cs = _check_counts(row, scheme_field=False)  # records name the scheme as `experiments run` records it
    quantized = cs.query(copy="quantized")
    assert len(quantized) > 0 and set(quantized.values("component")) == {"linear"}
    assert set(quantized.values("format")) == {"mxfp4_e2m1"}


def test_draw_both_legacy_on_wikitext(wikitext_dir, tmp_path, capsys):
    """`draw both --legacy mxfp8` on WikiText-2 (the predecessor's --data-path): training stops after
    --control-iter, and the captured quantized copies are what the predecessor computed for mxfp8: forward
    GEMMs in MXFP8 with QK^T in MX-E5M2, linear dgrad's dY in MX-E5M2, no wgrad and no attention backward GEMM."""
    from fxquant.cli import main

    prefix = tmp_path / "wiki" / "wikipedia_text_document"
    assert main(["prepare-data", str(wikitext_dir / "valid.txt"), "--format", "wikitext", "--dataset", "wikipedia",
                 "-o", str(prefix), "-q"]) == 0
    logs, draw = tmp_path / "logs", tmp_path / "draw"
    assert main(["draw", "both", "mxfp8", "--legacy", "--control-iter", "2", "--collect-micro-batches", "2",
                 "--dataset", "wikipedia", "--data-path", str(prefix), "--tensor-dir", str(logs), "--output-dir",
                 str(draw), "--out", str(tmp_path / "runs"), "--no-plots", *FAST]) == 0
    summary = _summary(logs)
    (row,) = summary["runs"]
    assert (summary["mode"], summary["control_iter"], summary["legacy"], row["scheme"]) == \
        ("single", 2, True, "legacy_FA_linear_mxfp8")
    assert (row["iterations"], row["micro_batches"]) == ([0, 1], [0, 1])
    cs = _check_counts(row)
    metrics = (tmp_path / "runs" / "llama32-1b-tiny" / "wikipedia" / "legacy_FA_linear_mxfp8" / "metrics.jsonl")
    assert len(metrics.read_text().splitlines()) == 2  # --control-iter 2 stopped training, as the predecessor's did
    formats = {}
    for rec in cs.query(copy="quantized"):
        formats.setdefault((rec.fields["component"], rec.fields["gemm"]), set()).add(rec.fields["format"])
        assert "rounding=ta" in rec.fields["qspec"]
    assert set(formats) <= {("linear", "fprop"), ("linear", "dgrad"), ("attention", "qk"), ("attention", "pv")}
    assert formats[("linear", "fprop")] == {"mxfp8_e4m3"} and formats[("linear", "dgrad")] == {"mxfp8_e5m2"}
    assert formats[("attention", "qk")] == {"mxfp8_e5m2"}
    assert json.loads((draw / "report.json").read_text())["records"] == row["records"]


@pytest.mark.parametrize("verb", [["collect", "single", "mxfp8"], ["draw", "collect", "mxfp8"]])
def test_control_iter_zero_is_refused(verb, tmp_path, capsys):
    """`--control-iter 0` would mean "no limit" to experiments run (train and capture every iteration), not
    "collect 0 iterations": refused before anything runs."""
    from fxquant.cli import main

    for bad in ("0", "-1"):
        with pytest.raises(SystemExit) as exit_:
            main([*verb, "--control-iter", bad, "--tensor-save-dir", str(tmp_path / "logs"), "--out",
                  str(tmp_path / "runs"), "--dry-run"])
        assert exit_.value.code == 2 and f"argument --control-iter: {bad}: must be >= 1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_collect_tp_defaults_nproc_and_draw_visualize_dry_run_writes_nothing(tmp_path, capsys):
    """`collect --tp 2` without --nproc runs tp*pp processes (as experiments run) instead of refusing an --nproc 1
    the user never gave; `draw visualize --dry-run` prints the report command and writes nothing."""
    from fxquant.cli import main

    common = ["--tensor-save-dir", str(tmp_path / "logs"), "--out", str(tmp_path / "runs"), "--dry-run"]
    assert main(["collect", "single", "mxfp8", "--tp", "2", *common]) == 0
    out = capsys.readouterr().out
    assert "--nproc-per-node=2" in out and _dry_config(out)["layout"]["tp"] == 2
    from tests.analysis_helpers import write_tensors

    write_tensors(tmp_path / "logs" / "mxfp8", [torch.randn(4, 32)])
    assert main(["draw", "visualize", "--tensor-dir", str(tmp_path / "logs"), "--output-dir", str(tmp_path / "o"),
                 "--dry-run"]) == 0
    assert "[draw visualize] fxquant report" in capsys.readouterr().out and not (tmp_path / "o").exists()


def test_collect_and_draw_command_line_mistakes(tmp_path, capsys):
    """A scheme named twice by --quant-types (one run directory: the second replaced the first's captures), a quant
    type given as positional and option with different values (the positional was dropped), a quant type or
    --legacy given to draw visualize (ignored), --timeout 0 (refused by experiments with its own usage) and
    --collect-micro-batches 0 in quick mode (became 1) are refused by collect / draw themselves; `--mode quick
    hifp8` takes hifp8 as the quant type (it was refused as a MODE)."""
    from fxquant.cli import main

    common = ["--tensor-save-dir", str(tmp_path / "logs"), "--out", str(tmp_path / "runs"), "--dry-run"]
    for argv, message in [
        (["batch", "--quant-types", "mxfp8", "FA_linear_mxfp8"],
         "--quant-types name a scheme more than once: 'mxfp8' and 'FA_linear_mxfp8' are both FA_linear_mxfp8"),
        (["single", "mxfp4", "--quant-type", "hifp8"], "quant type given twice: 'mxfp4' and --quant-type 'hifp8'"),
        (["hifp8"], "MODE 'hifp8': choose from single, batch, quick (a quant type goes after MODE"),
    ]:
        assert main(["collect", *argv, *common]) == 2, argv
        assert message in capsys.readouterr().err, argv
    for argv, message in [
        (["collect", "single", "mxfp8", "--timeout", "0"], "fxquant collect: error: argument --timeout: 0: must be a "
                                                           "finite number of seconds > 0"),
        (["collect", "quick", "--collect-micro-batches", "0"], "argument --collect-micro-batches/--control-micro-"
                                                               "batches: 0: must be >= 1"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main([*argv, *common])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and "experiments" not in err, argv
    assert main(["collect", "--mode", "quick", "hifp8", *common]) == 0
    assert _dry_config(capsys.readouterr().out)["scheme"] == "FA_linear_hifp8"
    for extra, given in ((["hifp8"], "quant type 'hifp8'"), (["--legacy"], "--legacy")):
        assert main(["draw", "visualize", *extra, "--tensor-dir", str(tmp_path), "--dry-run"]) == 2
        assert f"fxquant draw: error: {given} chooses what to collect" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_collect_records_the_collections_that_finished(tmp_path, capsys, monkeypatch):
    """Interrupted (experiments exits 130), collect appends the runs done so far to the summary, the interrupted one
    marked, and exits as interrupted (nothing was recorded: `draw visualize` lost the finished runs)."""
    import experiments.__main__ as experiments_cli
    from fxquant.cli import main
    from tests.analysis_helpers import write_tensors

    logs = tmp_path / "logs"
    real = []

    def run(argv):
        if "--dry-run" in argv:
            return 0
        scheme = argv[argv.index("--scheme") + 1]
        if real:
            raise SystemExit(130)
        real.append(scheme)
        write_tensors(logs / scheme, [torch.randn(4, 32)], scheme=scheme)
        return 0

    monkeypatch.setattr(experiments_cli, "main", run)
    with pytest.raises(SystemExit) as exit_:
        main(["collect", "batch", "--quant-types", "bf16", "hifp8", "--tensor-save-dir", str(logs),
              "--out", str(tmp_path / "runs")])
    assert exit_.value.code == 130
    (collection,) = _collections(logs)
    assert [(r["scheme"], r["status"]) for r in collection["runs"]] == [("bf16", "ok"), ("FA_linear_hifp8", "interrupted")]
    assert collection["runs"][0]["records"] == 1


def test_draw_visualize_compares_legacy_collections_with_legacy_bf16(tmp_path, capsys):
    """After `collect batch --legacy` the reference run is legacy_bf16 (the default bf16 matched nothing: every
    relative loss error was null, and the warning named a --reference draw did not have)."""
    from fxquant.cli import main
    from tests.analysis_helpers import write_tensors

    logs, runs = tmp_path / "logs", []
    for scheme in ("legacy_bf16", "legacy_FA_linear_mxfp8"):
        write_tensors(logs / scheme, [torch.randn(4, 32)], scheme=scheme)
        run_dir = tmp_path / "runs" / scheme
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text('{"iteration": 1, "loss": 5.0}\n')
        runs.append({"scheme": scheme, "status": "ok", "run_dir": str(run_dir)})
    (logs / "collection_summary.json").write_text(json.dumps({"collections": [{"mode": "batch", "runs": runs}]}))
    common = ["draw", "visualize", "--tensor-dir", str(logs), "--output-dir", str(tmp_path / "o"), "--dry-run"]
    assert main(common) == 0
    assert capsys.readouterr().out.rstrip().endswith("--reference legacy_bf16")
    assert main([*common, "--reference", "legacy_FA_linear_mxfp8"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("--reference legacy_FA_linear_mxfp8")
