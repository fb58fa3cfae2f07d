#!/usr/bin/env bash
# The README's main command: sets up .venv (scripts/env.sh), then trains the embedded default on CPU:
# a tiny Llama-style Megatron-core model on mock data, scheme FA_linear_hifp8, a few dozen iterations,
# and prints where everything went. Extra arguments go to `python -m experiments run`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$root/scripts/env.sh")
cd "$root"
out="${FXQUANT_OUT:-$root/runs/main}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$root/.venv/inductor-cache}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::UserWarning}"
capture_args=()
spec="$root/fxquant/capture/specs/predecessor.yaml"
# Capture joins the run once fxquant.compile accepts a capture spec (issue 4).
if "$py" -c "import inspect, sys, fxquant.api as a; sys.exit(0 if 'not available' not in inspect.getsource(a.compile) else 1)" 2>/dev/null \
   && [ -f "$spec" ]; then
    capture_args=(--capture "$spec")
fi
"$py" -m experiments run --model llama31-8b --variant tiny --dataset mock --scheme FA_linear_hifp8 \
    --config cpu --iters "${FXQUANT_ITERS:-30}" --out "$out" "${capture_args[@]}" "$@"
run_dir="$out/llama31-8b-tiny/mock/FA_linear_hifp8"
echo
echo "fxquant main run finished:"
echo "  run directory   $run_dir"
echo "  metrics (JSONL) $run_dir/metrics.jsonl"
echo "  training log    $run_dir/train.log"
echo "  resolved config $run_dir/run_config.json"
if [ ${#capture_args[@]} -gt 0 ]; then echo "  captures        see $run_dir (capture spec $spec)"; fi
