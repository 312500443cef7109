#!/usr/bin/env bash
# The whole test suite: ruff, mypy, pytest (CI calls this through .ci/run).
source "$(dirname "$0")/env.sh"
ruff check .
python -m mypy          # settings in pyproject.toml
python -m pytest -q "$@"
