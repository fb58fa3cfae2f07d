#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv and prints its python.
# torch is installed first and pinned: an unpinned torch pulls several GB of CUDA packages.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
torch_pin="${FXQUANT_TORCH:-torch==2.13.0}"
stamp="$venv/.fxquant-stamp"
want=$( (cat "$root/pyproject.toml"; echo "$torch_pin") | sha256sum | cut -c1-16)
if [ ! -x "$venv/bin/python" ]; then
    echo "fxquant: creating $venv" >&2
    python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "fxquant: installing dependencies into $venv (torch pinned: $torch_pin)" >&2
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q "$torch_pin" >&2
    "$venv/bin/python" -m pip install -q -e "$root[triton,megatron,viz,dev]" >&2
    echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
