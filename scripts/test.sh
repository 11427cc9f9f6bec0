#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite (CI runs this after its checks).
# Every test has a time limit (pyproject's pytest timeout; a test that needs more says so with
# @pytest.mark.timeout) and the slowest 30 are listed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest -q --durations=30 "$@"
