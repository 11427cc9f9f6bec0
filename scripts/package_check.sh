#!/usr/bin/env bash
# Builds the wheel, installs it with no extras into a fresh virtualenv (its declared
# dependencies from the registry), and drives it from an empty directory as a maintainer would:
# --version, --help, verify of the committed bundle; then validate --dry-run from the serving
# install (.venv, which has the serve extra), also from an empty directory.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
.venv/bin/python -m pip wheel -q --no-deps -w "$work/dist" .
"$PY" -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$work"/dist/k3fasttrack-*.whl
mkdir "$work/empty"
cd "$work/empty"
k3ft="$work/venv/bin/k3ft"
"$k3ft" --version
"$k3ft" --help >/dev/null
"$k3ft" verify "$root/bundles/cpu-demo-2026-12-03/bundle.tar.gz" \
  --allowed-signers "$root/bundles/allowed_signers"
# The shipped sweep grid resolves from the wheel (the perf cells are planned).
"$k3ft" validate --dry-run --json >"$work/plan.json" || true
grep -q '"perf-decode-' "$work/plan.json" \
  || { echo "package check: the wheel's dry run planned no perf cell" >&2; exit 1; }
"$root/.venv/bin/k3ft" validate --dry-run
echo "package check: wheel built, installed and driven in $(( $(date +%s) - start )) s" >&2
