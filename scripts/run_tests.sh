#!/usr/bin/env bash
# The README's test command: sets up .venv when missing, then runs the whole test suite on CPU.
# Tests run in pytest-xdist workers: one per core, at most 4, none on a single core (then in this process).
# FXQUANT_TEST_WORKERS sets the number (0: this process); a -n among the arguments comes later and wins.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$root/scripts/env.sh")
cd "$root"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$root/.venv/inductor-cache}"
workers=$(nproc 2>/dev/null || echo 1)
[ "$workers" -gt 4 ] && workers=4
[ "$workers" -lt 2 ] && workers=0
workers="${FXQUANT_TEST_WORKERS:-$workers}"
exec "$py" -m pytest -n "$workers" "$@"
