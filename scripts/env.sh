# Sourced by scripts/demo.sh and scripts/test.sh: make (once) and enter the project's venv.
# --system-site-packages keeps a torch the machine already has (a GPU user's CUDA build);
# where none is importable, torch 2.13.0 (CPU) is installed first so that the wide
# `torch>=2.4` requirement does not pull gigabytes of CUDA packages.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${PIPESIM_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
if ! python -c "import torch" >/dev/null 2>&1; then
    python -m pip install -q "torch==2.13.0"
fi
if [ ! -f "$VENV/.pipesim-installed" ] || [ pyproject.toml -nt "$VENV/.pipesim-installed" ]; then
    python -m pip install -q -e ".[dev]"
    touch "$VENV/.pipesim-installed"
fi
