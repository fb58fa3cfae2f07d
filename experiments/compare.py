"""Loss-curve comparison of runs against the bf16 run of the same model and dataset."""
from __future__ import annotations

import json
from pathlib import Path


def read_losses(metrics: Path, key: str = "loss") -> list[float]:
    """The `key` values of a metrics JSONL in iteration order (records without `key` are skipped)."""
    if not metrics.is_file():
        return []
    records = (json.loads(line) for line in metrics.read_text().splitlines() if line.strip())
    return [r[key] for r in records if key in r]


def mean_relative_error(losses: list[float], reference: list[float]) -> float | None:
    n = min(len(losses), len(reference))
    if n == 0:
        return None
    return sum(abs(a - b) / abs(b) for a, b in zip(losses[:n], reference[:n]) if b != 0) / n


def against_bf16(records: list[dict], last_n: int) -> dict[str, dict]:
    """{run: {mre_all, mre_last}} for each finished run whose model/dataset has a finished bf16 run."""
    curves = {r["run"]: read_losses(Path(r["run_dir"]) / "metrics.jsonl") for r in records if r.get("status") == "ok"}
    result = {}
    for r in records:
        if r.get("status") != "ok" or r["scheme"] == "bf16":
            continue
        ref = curves.get(f"{r['model']}/{r['dataset']}/bf16")
        if not ref:
            continue
        ours = curves[r["run"]]
        n = min(len(ours), len(ref))
        result[r["run"]] = {"mre_all": mean_relative_error(ours[:n], ref[:n]),
                            "mre_last": mean_relative_error(ours[max(0, n - last_n):n], ref[max(0, n - last_n):n])}
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
