#!/usr/bin/env bash
# Sets up .venv if needed, then runs the main job: `k3ft validate` on the embedded default
# profile (cpu-demo: two real vLLM CPU servers, real lm-eval, a real sweep, a signed bundle).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/k3ft validate "$@"
