#!/usr/bin/env bash
# The README's test command: sets up .venv when missing, then runs the whole test suite on CPU.
# Tests run in pytest-xdist workers, one per core up to 4, none on one core (FXQUANT_TEST_WORKERS overrides; 0 runs them in
# this process); a -n given among the arguments comes after this one and wins.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$root/scripts/env.sh")
cd "$root"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$root/.venv/inductor-cache}"
cores=$(nproc 2>/dev/null || echo 1)
workers="${FXQUANT_TEST_WORKERS:-$(( cores < 2 ? 0 : cores < 4 ? cores : 4 ))}"
exec "$py" -m pytest -n "$workers" "$@"
