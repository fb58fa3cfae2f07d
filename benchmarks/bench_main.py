"""The README's main command (`bash scripts/run_main.sh`) timed under each compile choice, in fresh processes.

Each run has an empty Inductor cache; measured: wall time in all (training, capture check and report), the first
step (the compile), and the median step of iterations 2..N from the run's `metrics.jsonl`. Variants run one after the other;
`--rounds` repeats the sequence (alternated), and each figure in the JSON keeps every round.

    python benchmarks/bench_main.py --json benchmarks/results/bench_main_cpu.json
    python benchmarks/bench_main.py --variants default,fused --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from envinfo import environment  # noqa: E402
from fxquant.analysis.outputs import strict_dumps  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "default": [],  # aot_eager, the quantizes running the reference
    "opaque": ["--backend", "inductor", "--kernels", "reference"],  # Inductor, the quantize op opaque
    "fused": ["--backend", "inductor"],  # Inductor, the quantizes lowered into its kernels
}


def run_variant(name: str, iters: int, work: Path) -> dict:
    """One run of the main command for ``name`` in a fresh process, an empty Inductor cache and its own output."""
    out, cache = work / f"{name}-out", work / f"{name}-cache"
    env = {**os.environ, "FXQUANT_OUT": str(out), "FXQUANT_ITERS": str(iters), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "run_main.sh"), *VARIANTS[name]], cwd=REPO, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RuntimeError(f"{name}: run_main.sh exited {proc.returncode}:\n{tail}")
    metrics = next(out.rglob("metrics.jsonl"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r["step_time_s"] for r in rows if "step_time_s" in r]
    return {"wall_s": wall, "first_step_s": steps[0], "median_step_ms": 1e3 * statistics.median(steps[1:]),
            "iterations": len(steps), "final_loss": rows[-1].get("loss")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--iters", type=int, default=30, help="training iterations per run (default 30, the README's)")
    p.add_argument("--rounds", type=int, default=1, help="times the variants run, alternated (default 1)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or not names:
        p.error(f"--variants: unknown {unknown}; allowed {list(VARIANTS)}")
    if args.iters < 2 or args.rounds < 1:
        p.error("--iters must be >= 2 and --rounds >= 1")
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="bench_main-") as tmp:
        for r in range(args.rounds):
            for name in names:
                work = Path(tmp) / f"round{r}"
                work.mkdir(exist_ok=True)
                results[name].append(run_variant(name, args.iters, work))
                print(f"round {r + 1}/{args.rounds} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    env = environment("cpu", argv)
    env.update(cpu=env["host"], iters=args.iters, rounds=args.rounds)  # "cpu": the key earlier results use
    table = [[n, " / ".join(f"{x['wall_s']:.0f}" for x in rs), " / ".join(f"{x['first_step_s']:.1f}" for x in rs),
              " / ".join(f"{x['median_step_ms']:.0f}" for x in rs), rs[-1]["final_loss"]] for n, rs in results.items()]
    print(f"# {env['cpu']} ({env['cpus']} CPUs), {env['date']}, {args.iters} iterations, empty Inductor cache per run")
    print(tabulate(table, headers=["variant", "total s", "first step s", "step ms (median 2..N)", "final loss"]))
    if args.json is not None:
        args.json.write_text(strict_dumps({"environment": env, "variants": VARIANTS, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
