#!/usr/bin/env bash
# Device side, one call: A/B-time kernel choices (DecodeSettings fields, as K3_DECODE_<FIELD>
# variables) against the default executor.
#   bash backend/device/candidates.sh KNOB=VALUE [KNOB=VALUE ...]
#   CANDIDATE_BATCHES: the batches (default 1,2);
#   CANDIDATE_SIDES: compare these sides instead (bench_ab_env.py --sides, space-separated
#   LABEL:NAME=V,... entries, the first the reference); KNOB=VALUE arguments are then not used.
# benchmarks/bench_ab_env.py --each: a reference with every named knob at 0 (only knobs whose
# 0 is the default), each knob alone at VALUE, all of them together, in one process (KDA + MoE
# and MLA + MoE layers, whole step); the table last, JSON and logs under $OUT. A knob whose
# default is on is compared with --sides (ref: off:KNOB=0). Carry .gpu-kit and .gpu-wheels
# (backend/device/prepare.sh). The A/B is cut at 540 s so that the call ends inside 600 s.
set -uo pipefail
source backend/device/env.sh || exit 1
out=${OUT:-/tmp/k3ft-candidates}
mkdir -p "$out"
if [ -n "${CANDIDATE_SIDES:-}" ]; then
  read -r -a sides <<< "$CANDIDATE_SIDES"
  ab=(--sides "${sides[@]}")
elif [ $# -gt 0 ]; then
  ab=(--each "$@" --all)
else
  echo "usage: bash backend/device/candidates.sh KNOB=VALUE ... (or CANDIDATE_SIDES=...)" >&2
  exit 2
fi
timeout 540 python3 benchmarks/bench_ab_env.py "${ab[@]}" --batches "${CANDIDATE_BATCHES:-1,2}" --rounds 6 \
  --json "$out/ab_candidates.json" > "$out/ab_candidates.md" 2> "$out/ab_candidates.log" \
  || echo "ab_env failed: $(tail -5 "$out/ab_candidates.log")"
cat "$out/ab_candidates.md"
