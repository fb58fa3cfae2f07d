"""Loss-curve comparison of runs against the bf16 run of the same model and dataset."""
from __future__ import annotations

from pathlib import Path


def read_losses(metrics: Path, key: str = "loss") -> list[float]:
    """The `key` values of a metrics JSONL in iteration order (records without `key`, and lines that are not JSON,
    as the torn last line of a cell killed at its timeout, are skipped)."""
    from fxquant.analysis.loss_curves import metric_records

    if not metrics.is_file():
        return []
    return [r[key] for r in metric_records(metrics) if key in r]


def reference_run(record: dict, records: list[dict]) -> Path | None:
    """The bf16 run directory a cell is compared with: the bf16 cell of the same model and dataset in this matrix
    when it finished (one that failed or was interrupted: none, its metrics are not this matrix's), else, when the
    matrix has no such cell, the bf16 run an earlier matrix left beside the cell's own directory
    (OUT/<model name>/<dataset>/bf16), when it holds metrics."""
    same = [r for r in records if r.get("scheme") == "bf16" and (r.get("model"), r.get("dataset")) == (
        record["model"], record["dataset"])]
    if same:
        return Path(same[0]["run_dir"]) if same[0].get("status") == "ok" else None
    earlier = Path(record["run_dir"]).parent / "bf16"
    return earlier if (earlier / "metrics.jsonl").is_file() else None


def against_bf16(records: list[dict], last_n: int) -> dict[str, dict]:
    """{run: {reference, mre_all, mre_last, nonfinite_loss}} for each finished run with a bf16 reference
    (``reference_run``), by the rules of ``fxquant report``'s training comparison
    (``fxquant.analysis.loss_curves.loss_error``: iterations where the reference's loss is zero or not finite are
    left out; a run whose loss is NaN or Inf where the reference's is finite gets ``inf``)."""
    from fxquant.analysis import loss_curves

    result, references = {}, {}
    for r in records:
        if r.get("status") != "ok" or r["scheme"] == "bf16":
            continue
        ref_dir = reference_run(r, records)
        if ref_dir is None:
            continue
        if ref_dir not in references:  # each reference's metrics read once
            references[ref_dir] = loss_curves.load_run(ref_dir)
        run, ref = loss_curves.load_run(Path(r["run_dir"])), references[ref_dir]
        mre, nonfinite = loss_curves.loss_error(run, ref)
        result[r["run"]] = {"reference": str(ref_dir), "mre_all": mre,
                            "mre_last": loss_curves.mean_relative_error(run, ref, last_n), "nonfinite_loss": nonfinite}
    return result


def plot_curves(records: list[dict], path: Path) -> Path | None:
    """One loss-vs-iteration panel per model/dataset (SVG, fxquant.analysis.svg); None when no run succeeded."""
    from fxquant.analysis import svg

    done = [r for r in records if r.get("status") == "ok"]
    groups = sorted({(r["model"], r["dataset"]) for r in done})
    if not groups:
        return None
    fig = svg.Figure(len(groups), 1, panel=(560, 240), title="Training loss per scheme")
    schemes = sorted({r["scheme"] for r in done})
    for row, (model, dataset) in zip(fig.axes, groups):
        ax = row[0]
        for r in done:
            if (r["model"], r["dataset"]) == (model, dataset):
                losses = read_losses(Path(r["run_dir"]) / "metrics.jsonl")
                ax.plot(range(1, len(losses) + 1), losses, label=r["scheme"],
                        color=svg.TAB10[schemes.index(r["scheme"]) % len(svg.TAB10)],
                        lw=2.2 if r["scheme"] == "bf16" else 1.3)
        ax.set_title(f"{model} / {dataset}")
        ax.set_xlabel("iteration")
        ax.integer_x = True
        ax.set_ylabel("loss")
        ax.grid()
        ax.legend("outside")
    fig.save(path)
    return path
