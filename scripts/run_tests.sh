#!/usr/bin/env bash
# The README's test command: sets up .venv when missing, then runs the whole test suite on CPU.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$root/scripts/env.sh")
cd "$root"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$root/.venv/inductor-cache}"
exec "$py" -m pytest "$@"
