#!/usr/bin/env bash
# The whole test suite (CI calls this through .ci/run).
source "$(dirname "$0")/env.sh"
ruff check .
python -m pytest -q "$@"
