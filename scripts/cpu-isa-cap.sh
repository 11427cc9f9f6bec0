#!/usr/bin/env bash
# Runs a command as on a CPU without AVX-512 / AMX: scripts/cpu-isa-cap.sh avx2 COMMAND [ARGS]
# (e.g. `scripts/cpu-isa-cap.sh avx2 ./scripts/demo.sh`). torch's kernels, oneDNN and vLLM's CPU
# extension all take their AVX2 paths; the run's environment.json records the cap.
set -euo pipefail
if [[ $# -lt 2 || "$1" != "avx2" ]]; then
  echo "usage: scripts/cpu-isa-cap.sh avx2 COMMAND [ARGS...]" >&2
  exit 2
fi
shift
here="$(cd "$(dirname "$0")/.." && pwd)"
export K3FT_CPU_ISA_CAP=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
export PYTHONPATH="$here/k3fasttrack/data/isa_cap${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
