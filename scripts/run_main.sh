#!/usr/bin/env bash
# The README's main command: sets up .venv (scripts/env.sh), then trains the embedded default on CPU:
# a tiny Llama-style Megatron-core model on mock data, scheme FA_linear_hifp8, a few dozen iterations,
# capturing with the shipped `predecessor` spec (first micro-batch of the first iteration, every rank;
# Megatron's unfused attention, so the attention probabilities exist to be captured), checks the
# captures, writes the report (`fxquant report`) and prints where everything went.
# Extra arguments go to `python -m experiments run`. FXQUANT_ITERS, FXQUANT_OUT override.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$root/scripts/env.sh")
cd "$root"
out="${FXQUANT_OUT:-$root/runs/main}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$root/.venv/inductor-cache}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::UserWarning}"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$py" -m experiments run --model llama31-8b --variant tiny --dataset mock --scheme FA_linear_hifp8 \
    --config cpu --iters "${FXQUANT_ITERS:-30}" --out "$out" --attention local --capture predecessor "$@" | tee "$log"
# The run's own summary line names its directory and captures (extra arguments may change both).
result=$(sed -n 's/^FXQUANT_RESULT //p' "$log" | tail -n 1)
if [ -z "$result" ]; then  # --dry-run or --help: nothing was trained
    exit 0
fi
field() { "$py" -c 'import json, sys; print(json.loads(sys.argv[1]).get(sys.argv[2]) or "")' "$result" "$1"; }
run_dir=$(field run_dir)
captures=$(field captures)
if [ -n "$captures" ]; then
    "$py" -m fxquant capture verify "$captures"
    "$py" -m fxquant report "$captures" --metrics "$run_dir" -o "$run_dir/report" --quiet
else
    "$py" -m fxquant report --metrics "$run_dir" -o "$run_dir/report" --quiet
fi
echo
echo "fxquant main run finished:"
echo "  run directory   $run_dir"
echo "  metrics (JSONL) $run_dir/metrics.jsonl"
echo "  training log    $run_dir/train.log"
echo "  resolved config $run_dir/run_config.json"
if [ -n "$captures" ]; then
    echo "  captures        $captures (fxquant capture ls $captures)"
fi
echo "  report          $run_dir/report/index.html"
