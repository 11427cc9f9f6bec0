#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite (CI runs this after its checks):
# the tests that start no vLLM server on two workers (pytest-xdist), then the slow tests (real
# vLLM servers, each pinned to its own core) one after the other. Every test has a time limit
# (pyproject's pytest timeout; a test that needs more says so with @pytest.mark.timeout) and the
# slowest of each phase are listed at its end. With arguments, runs exactly those in one pass.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
py=.venv/bin/python
if [ $# -gt 0 ]; then
  exec $py -m pytest -q --durations=30 "$@"
fi
workers=$(( $(nproc) < 2 ? 1 : 2 ))
start=$(date +%s)
$py -m pytest -q -n "$workers" -m "not slow" --durations=20
echo "tests: the suite without vLLM servers took $(( $(date +%s) - start )) s" >&2
start=$(date +%s)
$py -m pytest -q -m slow --durations=20
echo "tests: the slow suite (real vLLM servers) took $(( $(date +%s) - start )) s" >&2
