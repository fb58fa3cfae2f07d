#!/usr/bin/env bash
# The GPU check, in one command of at most 10 minutes (H100 / H200; the machine's own python3, torch and triton):
#   1. the environment (GPU, driver, clocks, torch, triton);
#   2. the CUDA tests, two pytest runs side by side: the Triton kernels (quantize, flash attention, quantized
#      GEMM) against the pure-torch reference bit for bit, and Inductor's lowering of the quantize op (Triton
#      code generation) against the same reference: the element rounding, op by op, and through
#      fxquant.compile (checkpointed regions too);
#   3. benchmarks/run_all.py over SECTIONS, alone on the GPU.
# Every step has a wall-clock cap, so the whole command ends inside 10 minutes; logs, JUnit XML and the
# benchmark JSON/markdown go to $OUT (else ./gpu-out).
#
#   bash scripts/gpu_check.sh                                   # everything, about 9 minutes
#   SECTIONS=attention,fused,compile TESTS_S=0 bash scripts/gpu_check.sh   # benchmarks only
#   KERNEL_TESTS="tests/test_flash_attention.py tests/test_flash_op.py" LOWERING_TESTS=tests/test_formats_lowering.py \
#       SECTIONS=model,attention BENCH_ARGS="--seq 2048" bash scripts/gpu_check.sh      # a subset of each
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
py=${PYTHON:-python3}
tests_s=${TESTS_S:-240}        # cap on the test step (both runs in parallel); 0 skips it
bench_s=${BENCH_S:-300}        # cap on the benchmark step; 0 skips it
sections=${SECTIONS:-ceilings,quantize,linear,model}
budget_scale=${BUDGET_SCALE:-1}
bench_args=${BENCH_ARGS:-}    # more run_all.py arguments, e.g. "--seq 2048"
kernels_tests=${KERNEL_TESTS:-tests/test_kernels.py tests/test_kernels_op.py tests/test_flash_attention.py tests/test_flash_op.py tests/test_qgemm.py tests/test_capture_fastpath.py}
lowering_tests=${LOWERING_TESTS:-tests/test_formats_lowering.py tests/test_compile_inductor.py tests/test_formats_steps.py tests/test_compile_checkpoint.py tests/test_formats_nvfp4_2d.py}
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fxquant-inductor}
status=0

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
    "$py" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
    nproc
} 2>&1 | tee "$out/env.txt"

if [ "$tests_s" -gt 0 ]; then
    # 14 pytest workers share the 16 cores: two Inductor compile workers each, not one per core each
    export TORCHINDUCTOR_COMPILE_THREADS=2
    rm -f "$out"/failures_*.txt
    # each failure's traceback as it happens: a run cut at the cap prints no summary (tests/conftest.py)
    # shellcheck disable=SC2086
    FXQUANT_FAILURE_LOG="$out/failures_kernels.txt" \
    timeout "$tests_s" "$py" -m pytest -v -p no:cacheprovider -m "triton or gpu" -n 8 $kernels_tests \
        --junitxml="$out/tests_kernels.xml" > "$out/tests_kernels.log" 2>&1 &
    k=$!
    # shellcheck disable=SC2086
    FXQUANT_FAILURE_LOG="$out/failures_lowering.txt" \
    timeout "$tests_s" "$py" -m pytest -v -p no:cacheprovider -m gpu -n 6 $lowering_tests \
        --junitxml="$out/tests_lowering.xml" > "$out/tests_lowering.log" 2>&1 &
    l=$!
    wait $k; rk=$?
    wait $l; rl=$?
    for f in kernels lowering; do
        echo "== tests_$f: $(tail -1 "$out/tests_$f.log")"
        grep -E "^(FAILED|ERROR)" "$out/tests_$f.log" | head -20
        [ -s "$out/failures_$f.txt" ] && grep -E "^E   " "$out/failures_$f.txt" | head -20
    done
    echo "== pytest exit: kernels $rk, lowering $rl (124 = cut at ${tests_s} s)"
    [ "$rk" -ne 0 ] || [ "$rl" -ne 0 ] && status=1
    unset TORCHINDUCTOR_COMPILE_THREADS
fi

if [ "$bench_s" -gt 0 ]; then
    # shellcheck disable=SC2086
    timeout "$bench_s" "$py" benchmarks/run_all.py --sections "$sections" --budget-scale "$budget_scale" $bench_args \
        --json "$out/run_all.json" --markdown "$out/run_all.md" > "$out/bench.log" 2>&1
    rb=$?
    echo "== run_all exit $rb (124 = cut at ${bench_s} s; what it measured is in run_all.json)"
    grep -E "^ERROR" "$out/bench.log" | head -20
    cat "$out/run_all.md" 2>/dev/null
    [ "$rb" -ne 0 ] && status=1
fi
exit $status
