#!/usr/bin/env bash
# Sets up .venv if needed, then runs the test suite (CI runs this after its checks) in two
# phases at once. Foreground, at normal priority, one after the other: the slow tests (real vLLM
# servers, each server pinned to its own core) and the tests that assert wall-clock bounds
# (marked timing). Beside them, at the lowest CPU priority (nice 19) on two workers
# (pytest-xdist): every other test. The slow tests leave a core idle most of the time (one side
# of a pair decodes while the other waits) and the background phase runs in those gaps; its log
# is printed when both are done. Every test has a time limit (pyproject's pytest timeout; a test
# that needs more says so with @pytest.mark.timeout) and the slowest of each phase are listed at
# its end. Tests marked `full` (long end-to-end runs whose checks another test also makes) run
# only when asked: `./scripts/test.sh -m full`. With arguments, runs exactly those in one pass.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
py=.venv/bin/python
if [ $# -gt 0 ]; then
  exec $py -m pytest -q --durations=30 "$@"
fi
workers=$(( $(nproc) < 2 ? 1 : 2 ))
log=$(mktemp "${TMPDIR:-/tmp}/k3ft-tests-serverless.XXXXXX")
start=$(date +%s)
( nice -n 19 $py -m pytest -q -p no:cacheprovider -n "$workers" -m "not slow and not full and not timing" \
    --durations=20 >"$log" 2>&1; echo $? >"$log.rc"
  echo "tests: the suite without vLLM servers took $(( $(date +%s) - start )) s" >>"$log" ) &
bg=$!
# Ctrl-C stops both phases (the whole process group).
trap 'trap - INT TERM; kill 0' INT TERM
slow_rc=0
$py -m pytest -q -m "(slow or timing) and not full" --durations=20 || slow_rc=$?
echo "tests: the slow suite (real vLLM servers) took $(( $(date +%s) - start )) s" >&2
echo "tests: waiting for the suite without vLLM servers" >&2
wait $bg || true
echo "---- the suite without vLLM servers (ran beside the slow suite) ----"
cat "$log"
fast_rc=$(cat "$log.rc" 2>/dev/null || echo 1)
rm -f "$log" "$log.rc"
echo "tests: both phases done in $(( $(date +%s) - start )) s (slow exit $slow_rc, server-free exit $fast_rc)" >&2
[ "$slow_rc" -eq 0 ] && [ "$fast_rc" -eq 0 ]
