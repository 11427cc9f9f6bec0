#!/usr/bin/env bash
# Sets up .venv if needed, then runs the test suite (CI runs this after its checks) in two
# phases: first the tests that start no vLLM server, on two workers (pytest-xdist); then, one
# after the other, the slow tests (real vLLM servers, each server pinned to its own core) and the
# tests that assert wall-clock bounds (marked timing). Every test has a time limit (pyproject's
# pytest timeout; a test that needs more says so with @pytest.mark.timeout) and the slowest of
# each phase are listed at its end. Tests marked `full` (long end-to-end runs whose checks
# another test also makes) run only when asked: `./scripts/test.sh -m full`. With arguments,
# runs exactly those in one pass.
#
# The phases do not overlap: running the server-free tests at low priority beside the servers
# was measured slower overall on 2 cores (the demo's end-to-end validate took 757 s instead of
# 513 s beside them).
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
$py -m pytest -q -n "$workers" -m "not slow and not full and not timing" --durations=20
echo "tests: the suite without vLLM servers took $(( $(date +%s) - start )) s" >&2
start=$(date +%s)
$py -m pytest -q -m "(slow or timing) and not full" --durations=20
echo "tests: the slow suite (real vLLM servers) took $(( $(date +%s) - start )) s" >&2
