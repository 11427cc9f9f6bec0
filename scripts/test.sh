#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite (CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest -q "$@"
