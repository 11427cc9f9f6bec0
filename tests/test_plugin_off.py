"""With the switch off, installing our vLLM plugin changes nothing (real vLLM, real model, CPU).

Two subprocesses serve the SmolLM2 demo model in-process with ``vllm.LLM`` (enforce_eager) and
decode greedily: one with every plugin disabled (``VLLM_PLUGINS=""``: vLLM 0.32.0 loads only the
``vllm.general_plugins`` entry points named in that comma-separated list), one with plugins
enabled (``VLLM_PLUGINS`` unset: all installed plugins load, ours included) and no
``k3ft_decode`` key (our switch). Token ids must be identical, and the marker file that
``register()`` writes proves our plugin loaded in the second run and not in the first.
Run by hand under ``flock /tmp/k3ft-vllm.lock``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MODEL = Path(os.environ.get("K3FT_DEMO_MODEL", "/root/.cache/k3ft/models/smollm2-135m-instruct"))
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]


def child(out: str) -> None:
    """Generate greedily and write the token ids (and whether our plugin loaded) to ``out``."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(MODEL),
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        max_model_len=256,
        seed=0,
        max_num_seqs=4,
    )
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    loaded = "backend.plugin" in sys.modules
    Path(out).write_text(json.dumps({"tokens": tokens, "plugin_module_loaded": loaded}))


def run_side(tmp: Path, name: str, plugins: str | None) -> tuple[dict[str, object], list[str]]:
    """Run one side in a fresh process; return its result and the marker lines."""
    marker = tmp / f"{name}.marker"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "K3_DECODE_PLUGIN_MARKER": str(marker),
    }
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    out = tmp / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = marker.read_text().splitlines() if marker.exists() else []
    return json.loads(out.read_text()), lines


@pytest.mark.slow
@pytest.mark.skipif(not MODEL.is_dir(), reason=f"demo model folder {MODEL} is missing")
def test_plugin_installed_and_off_changes_no_token(tmp_path: Path) -> None:
    """Greedy tokens with our plugin loaded (switch off) equal those with plugins disabled."""
    disabled, disabled_marks = run_side(tmp_path, "disabled", "")
    installed, installed_marks = run_side(tmp_path, "installed", None)
    assert disabled_marks == [] and disabled["plugin_module_loaded"] is False
    assert installed_marks and all(m.startswith("register pid=") for m in installed_marks)
    assert installed["plugin_module_loaded"] is True
    assert all(len(t) == 24 for t in disabled["tokens"])  # type: ignore[union-attr]
    assert installed["tokens"] == disabled["tokens"]


if __name__ == "__main__":
    child(sys.argv[1])
