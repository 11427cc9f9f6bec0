#!/usr/bin/env bash
# Device side, one call: `k3ft validate` with the backend's profile on the lent H200, unsigned
# (the signing key never leaves the CPU machine), the run folder packed under $OUT.
#   bash backend/device/validate.sh [PROFILE]   (default: k3-hopper: 546 s in one call with
#   K3FT_VALIDATE_TIMEOUT=560: the kernel tier 295 s in 4 pytest-xdist workers, the perf tier
#   233 s; a run cut short continues with the resume call below)
#   K3FT_VALIDATE_TIMEOUT (s, default 525): where the validate is cut (the call's 600 s hold the
#   kit's setup, ~15 s, and the packing too).
#   K3FT_RESUME=run.tar.gz bash backend/device/validate.sh: unpack a carried run.tar.gz from an
#   earlier call and continue it (`k3ft validate --resume`: finished cells are kept).
# Back on the CPU machine: `k3ft sign <run folder>`, then commit the bundle under bundles/
# (bundles/README.md says what each committed bundle pins).
set -uo pipefail
source backend/device/env.sh || exit 1
out=${OUT:-/tmp/k3ft-validate}
mkdir -p "$out"
rm -rf /tmp/k3run
resume=()
if [ -n "${K3FT_RESUME:-}" ]; then
  mkdir -p /tmp/k3run && tar xf "$K3FT_RESUME" -C /tmp/k3run || exit 1
  resume=(--resume)
fi
timeout "${K3FT_VALIDATE_TIMEOUT:-525}" python3 -m k3fasttrack validate --profile "${1:-k3-hopper}" --tp 1 --no-sign \
  ${resume[@]+"${resume[@]}"} --out /tmp/k3run/run --json > "$out/validate.json" 2> "$out/validate.log"
echo "validate rc=$?"
tar czf "$out/run.tar.gz" -C /tmp/k3run run
tail -5 "$out/validate.log"
