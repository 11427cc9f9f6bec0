"""Backend selection: start-up refusal lists every reason; per-step fallback lands in the trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from backend.k3_decode.selection import StartupFacts, startup_reasons, startup_record, step_decision
from backend.k3_decode.trace import TraceWriter, get_writer
from k3fasttrack.models.trace import StartupDecision, StepDecision, TraceRecord

GOOD = StartupFacts(
    gpu_family="sm_90a",
    tp_size=8,
    architecture="KimiK3ForConditionalGeneration",
    hidden_size=7168,
    num_experts=896,
    top_k=16,
)
RECORDS: TypeAdapter[TraceRecord] = TypeAdapter(TraceRecord)


def test_supported_deployments_have_no_reason() -> None:
    """TP1/8/16 on sm_90a or sm_100a, 896 or 224 experts, fp8 or bf16 MLA cache: enabled."""
    for facts in (
        GOOD,
        replace(GOOD, gpu_family="sm_100a", tp_size=16),
        replace(GOOD, tp_size=1, num_experts=224, mla_cache_dtype="bfloat16"),
        replace(
            GOOD, mla_cache_dtype="fp8", num_speculative_tokens=7, cudagraph_mode="FULL_DECODE_ONLY"
        ),
    ):
        assert startup_reasons(facts) == []
    assert startup_record(GOOD)["enabled"] is True


def test_startup_refusal_lists_every_reason() -> None:
    """A deployment wrong in every way gets one reason per unmet requirement, not just the first."""
    bad = StartupFacts(
        gpu_family="sm_80",
        tp_size=4,
        architecture="DeepseekV3ForCausalLM",
        hidden_size=4096,
        num_experts=256,
        top_k=8,
        hidden_act="silu",
        scoring_func="softmax",
        mla_cache_dtype="fp8_ds_mla",
        kda_state_dtype="bf16",
        kda_conv_dtype="fp32",
        cudagraph_mode="PIECEWISE",
        enforce_eager=True,
        pp_size=2,
        expert_parallel=True,
        num_speculative_tokens=8,
    )
    reasons = startup_reasons(bad)
    expected = [
        "GPU family sm_80",
        "tensor parallel size 4",
        "pipeline parallel size 2",
        "expert parallelism",
        "8 speculative tokens",
        "architecture DeepseekV3ForCausalLM",
        "hidden size 4096",
        "256 routed experts",
        "top-8 routing",
        "activation silu",
        "router scoring softmax",
        "MLA latent cache dtype fp8_ds_mla",
        "KDA recurrent state dtype bf16",
        "KDA conv state dtype fp32",
        "enforce_eager",
        "CUDA graph mode PIECEWISE",
    ]
    assert len(reasons) == len(expected)
    for fragment, reason in zip(expected, reasons, strict=True):
        assert fragment in reason
    record = StartupDecision.model_validate(startup_record(bad))
    assert not record.enabled and list(record.reasons) == reasons
    assert record.config["tp_size"] == "4" and record.backend == "k3ft_hopper"


@pytest.mark.parametrize(
    ("lens", "tokens", "prefills", "phase", "path", "size"),
    [
        ([1], 1, 0, "decode", "specialized", 1),
        ([1] * 5, 5, 0, "decode", "specialized", 5),
        ([1] * 12, 12, 0, "decode", "specialized", 16),
        ([4] * 4, 16, 0, "verify", "specialized", 16),
        ([3] * 3, 9, 0, "verify", "stock", None),  # 16, 32, 64: none divisible by q=3
        ([8] * 8, 64, 0, "verify", "specialized", 64),
        ([1] * 65, 65, 0, "decode", "stock", None),
        ([100], 100, 1, "prefill", "stock", None),
        ([1, 1, 30], 32, 1, "mixed", "stock", None),
        ([4, 2], 6, 0, "mixed", "stock", None),
        ([9, 9], 18, 0, "verify", "stock", None),
    ],
)
def test_step_decision(
    lens: list[int], tokens: int, prefills: int, phase: str, path: str, size: int | None
) -> None:
    """Decode and uniform verify within the captured sizes run specialized; the rest stock."""
    d = step_decision(7, len(lens), lens, tokens, num_prefills=prefills)
    assert (d.phase, d.path, d.capture_size) == (phase, path, size)
    assert bool(d.reasons) == (path == "stock")
    StepDecision.model_validate(d.as_record())


def test_step_fallback_gives_every_reason() -> None:
    """A big mixed eager step lists prefill, mixing, size and eagerness together."""
    d = step_decision(3, 3, [60, 1, 9], 70, num_prefills=1, in_graph=False)
    assert d.path == "stock" and d.phase == "mixed"
    assert d.reasons == (
        "1 of 3 request(s) are prefills",
        "mixed batch: 1 prefill and 2 decode request(s)",
        "70 tokens > 64",
        "eager step (not inside a captured CUDA graph)",
    )
    inconsistent = step_decision(4, 2, [1], 2)
    assert any("summing to 1 for 2 request(s) and 2 token(s)" in r for r in inconsistent.reasons)


def test_trace_records_fallback_for_prefill_and_mixed(tmp_path: Path) -> None:
    """The writer puts every decision (with reasons) and counters in the JSONL trace."""
    path = tmp_path / "t-{pid}.jsonl"
    writer = TraceWriter(path, flush_every=2, counters_every=2)
    writer.startup(startup_record(GOOD))
    steps = [
        step_decision(0, 1, [50], 50, num_prefills=1),
        step_decision(1, 2, [1, 1], 2),
        step_decision(2, 2, [1, 7], 8, num_prefills=1),
        step_decision(3, 2, [2, 2], 4),
    ]
    for d in steps:
        writer.step(d)
    writer.close()
    writer.close()  # idempotent
    files = list(tmp_path.glob("t-*.jsonl"))
    assert [f.name for f in files] == [f"t-{os.getpid()}.jsonl"]
    records = [RECORDS.validate_json(line) for line in files[0].read_text().splitlines()]
    kinds = [r.kind for r in records]
    assert kinds == ["startup", "step", "step", "counters", "step", "step", "counters", "counters"]
    step_recs = [r for r in records if r.kind == "step"]
    assert [(r.phase, r.path) for r in step_recs] == [
        ("prefill", "stock"),
        ("decode", "specialized"),
        ("mixed", "stock"),
        ("verify", "specialized"),
    ]
    assert "1 of 1 request(s) are prefills" in step_recs[0].reasons
    assert "mixed batch: 1 prefill and 1 decode request(s)" in step_recs[2].reasons
    final = records[-1]
    assert (final.specialized_steps, final.stock_steps, final.by_capture_size) == (
        2,
        2,
        {"2": 1, "4": 1},
    )


def test_writer_flushes_off_the_hot_path(tmp_path: Path) -> None:
    """step() never writes; the background thread writes once the buffer fills."""
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path, flush_every=1000, counters_every=10**9)
    for i in range(999):
        writer.step(step_decision(i, 1, [1], 1))
    assert not path.exists()
    writer.step(step_decision(999, 1, [1], 1))
    for _ in range(200):
        if path.exists() and len(path.read_text().splitlines()) == 1000:
            break
        time.sleep(0.01)
    assert len(path.read_text().splitlines()) == 1000
    writer.close()


def test_get_writer_follows_the_env_knob(tmp_path: Path) -> None:
    """K3_DECODE_TRACE unset: no writer; set: one writer per process, flushed at exit."""
    assert get_writer() is None or "K3_DECODE_TRACE" in os.environ
    code = (
        "from backend.k3_decode.trace import get_writer; "
        "from backend.k3_decode.selection import step_decision; "
        "w = get_writer(); assert w is get_writer(); w.step(step_decision(0, 1, [1], 1))"
    )
    env = {**os.environ, "K3_DECODE_TRACE": str(tmp_path / "p{pid}.jsonl")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    (out,) = tmp_path.glob("p*.jsonl")
    kinds = [json.loads(x)["kind"] for x in out.read_text().splitlines()]
    assert kinds == ["step", "counters"]


def test_selection_imports_no_torch() -> None:
    """Selection, trace and plugin stay pure Python (no torch, no vLLM) at import."""
    code = (
        "import sys, backend.plugin, backend.k3_decode.selection, backend.k3_decode.trace; "
        "backend.plugin.register(); "
        "print(sorted(m for m in ('torch', 'vllm', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
