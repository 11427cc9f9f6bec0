#!/usr/bin/env bash
# Device side, one call: are the opt-in kernel variants right, and do they pay in the executor?
#   bash backend/device/candidates.sh [KNOB=VALUE ...]   (default: every entry of CANDIDATES)
#   CANDIDATE_TESTS_K: a pytest -k expression for step 1 (default: every variant test);
#   CANDIDATE_BATCHES: step 2's batches (default 1,2);
#   CANDIDATE_SIDES: step 2 compares these sides instead (bench_ab_env.py --sides, space-separated
#   LABEL:NAME=V,... entries, the first the reference); KNOB=VALUE arguments are then not used.
# 1. the GPU tests of the variants (pytest marker `variant`: float64 references; bitwise against
#    the defaults, or the whole step bit-equal with the knob on, where the variant keeps the
#    arithmetic; the f16x2 w13 is compared by its error against float64 instead);
# 2. benchmarks/bench_ab_env.py --each: a reference with every knob off, each knob alone at VALUE,
#    all of them together, in one process at CANDIDATE_BATCHES tokens (KDA + MoE and MLA + MoE
#    layers, whole step); the table last, JSON and logs under $OUT.
# Carry .gpu-kit and .gpu-wheels (backend/device/prepare.sh). Its two steps are cut at 260 s
# and 300 s so that the call ends inside the 600 s limit (first H200 run: 284 s, session 11).
set -uo pipefail
source backend/device/env.sh || exit 1
out=${OUT:-/tmp/k3ft-candidates}
mkdir -p "$out"
CANDIDATES=(K3_DECODE_GEMV_PREFETCH=1
            K3_DECODE_ATTNRES_PREFETCH=1 K3_DECODE_NEXT_PREFETCH_MB=12
            K3_DECODE_TAIL_PREFETCH_MB=16 K3_DECODE_OPROJ_PREFETCH_MB=16 K3_DECODE_MOE_H2=1)
pairs=("$@")
[ ${#pairs[@]} -eq 0 ] && pairs=("${CANDIDATES[@]}")
export K3FT_KERNEL_CASES=$out/candidate_cases.jsonl
# op-level tests first, the executor's (heavier: whole models, every kernel compiled) last
timeout 260 python3 -m pytest -q -p no:cacheprovider -m "gpu and variant" \
  ${CANDIDATE_TESTS_K:+-k "$CANDIDATE_TESTS_K"} \
  tests/backend/test_{router,gemv,attn_res,moe,mla,prep,executor}_gpu.py \
  > "$out/candidate_tests.txt" 2>&1
echo "tests: $(tail -1 "$out/candidate_tests.txt")"
if [ -n "${CANDIDATE_SIDES:-}" ]; then
  read -r -a sides <<< "$CANDIDATE_SIDES"
  ab=(--sides "${sides[@]}")
else
  ab=(--each "${pairs[@]}" --all)
fi
timeout 300 python3 benchmarks/bench_ab_env.py "${ab[@]}" --batches "${CANDIDATE_BATCHES:-1,2}" --rounds 6 \
  --json "$out/ab_candidates.json" > "$out/ab_candidates.md" 2> "$out/ab_candidates.log" \
  || echo "ab_env failed: $(tail -5 "$out/ab_candidates.log")"
cat "$out/ab_candidates.md"
