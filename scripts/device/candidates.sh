#!/usr/bin/env bash
# Device side, one call: are the opt-in kernel variants right, and do they pay in the executor?
#   bash scripts/device/candidates.sh [KNOB ...]   (default: every knob in CANDIDATES)
# 1. the GPU tests of those variants (bitwise against the defaults, float64 references);
# 2. benchmarks/ab_env.py for each knob alone (0 vs 1), then all of them together, at 1 and 2
#    tokens (KDA + MoE and MLA + MoE layers, whole step); tables last, logs under $OUT.
# Carry .gpu-kit and .gpu-wheels (scripts/device/prepare.sh). About 6-8 minutes for three knobs.
set -uo pipefail
source scripts/device/env.sh || exit 1
out=${OUT:-/tmp/k3ft-candidates}
mkdir -p "$out"
CANDIDATES=(K3_DECODE_ROUTER_ROLLED K3_DECODE_GEMV_PREFETCH K3_DECODE_MLA_SMALL_TPC
            K3_DECODE_ATTNRES_PREFETCH)
knobs=("$@")
[ ${#knobs[@]} -eq 0 ] && knobs=("${CANDIDATES[@]}")
export K3FT_KERNEL_CASES=$out/candidate_cases.jsonl
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/backend/test_router_gpu.py \
  tests/backend/test_gemv_gpu.py tests/backend/test_mla_gpu.py \
  tests/backend/test_attn_res_gpu.py -k "rolled or prefetch or four_tokens" \
  > "$out/candidate_tests.txt" 2>&1
echo "tests: $(tail -1 "$out/candidate_tests.txt")"
ab() {  # name, knobs, A values, B values
  timeout 240 python3 benchmarks/ab_env.py "$2" "$3" "$4" --batches 1,2 --rounds 6 --json "$out/ab_$1.json" \
    > "$out/ab_$1.md" 2> "$out/ab_$1.log" || echo "ab_env $1 failed: $(tail -3 "$out/ab_$1.log")"
}
for k in "${knobs[@]}"; do ab "$k" "$k" 0 1; done
if [ ${#knobs[@]} -gt 1 ]; then
  all=$(IFS=,; echo "${knobs[*]}")
  zeros=$(printf '0,%.0s' "${knobs[@]}"); ones=$(printf '1,%.0s' "${knobs[@]}")
  ab all "$all" "${zeros%,}" "${ones%,}"
fi
for f in "$out"/ab_*.md; do echo "== $(basename "$f" .md)"; cat "$f"; done
