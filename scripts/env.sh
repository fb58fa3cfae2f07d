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
    "$venv/bin/python" -m pip install -q -e "$root[triton,megatron,dev]" >&2
    # Triton before 3.7 cannot interpret fxquant's flash and GEMM kernels with numpy 2.4 (the pair a torch pin
    # such as torch==2.11.0 brings): numpy is held below 2.4 then.
    if ! "$venv/bin/python" -c 'import sys; from importlib.metadata import version as v
from fxquant.kernels import interpreter_loop_problem as p
sys.exit(1 if p(v("triton"), v("numpy")) else 0)'; then
        "$venv/bin/python" -m pip install -q "numpy<2.4" >&2
    fi
    echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
