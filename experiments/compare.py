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
    """One loss-vs-iteration plot per model/dataset (matplotlib, when installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    done = [r for r in records if r.get("status") == "ok"]
    groups = sorted({(r["model"], r["dataset"]) for r in done})
    if not groups:
        return None
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 3.5 * len(groups)), squeeze=False)
    for ax, (model, dataset) in zip(axes[:, 0], groups):
        for r in done:
            if (r["model"], r["dataset"]) == (model, dataset):
                losses = read_losses(Path(r["run_dir"]) / "metrics.jsonl")
                ax.plot(range(1, len(losses) + 1), losses, label=r["scheme"], lw=2 if r["scheme"] == "bf16" else 1)
        ax.set_title(f"{model} / {dataset}")
        ax.set_xlabel("iteration")
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
