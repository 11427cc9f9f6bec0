"""When the K3 decode backend may run: at start-up (every unmet requirement) and per step.

Pure Python (no torch). Start-up: ``startup_reasons(facts)`` lists EVERY unmet requirement, never
just the first. Per step: ``step_decision(...)`` picks the specialized path only for pure decode or
uniform verify steps of at most 64 tokens that fit a captured graph; prefill, mixed batches,
partial drafts and bigger steps run stock, with every reason. ``StepDecision.as_record()`` is a
``k3fasttrack.models.trace.StepDecision`` JSON object.

Test mode (tiny configurations in CI only): ``K3_DECODE_TEST_MODE=tiny-cpu`` waives exactly three
kinds of start-up refusal, each still computed by the production rules: running on the CPU
(``GPU family cpu``), shapes that are not K3's (hidden size, expert count, top-k) and the lack of
FULL CUDA graphs (``enforce_eager``, graph mode); per step, eager steps may then be specialized.
Every other requirement (architecture, activation, routing, TP, caches, speculation) is enforced.
The waived reasons stay visible in the start-up record's ``config["test_mode_waived"]``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

BACKEND_NAME = "k3ft_hopper"
GPU_FAMILIES = ("sm_90a", "sm_100a")
TP_SIZES = (1, 8, 16)
"""TP8 and TP16 are the shard shapes the kernels target; TP1 runs the tests."""
ARCHITECTURES = ("KimiK3ForConditionalGeneration", "KimiLinearForCausalLM")
HIDDEN_SIZE = 7168
EXPERT_COUNTS = (896, 224)
"""The full checkpoint and the 224-expert pruned one (vLLM's CI checkpoint)."""
TOP_K = 16
HIDDEN_ACT = "situ"
SCORING_FUNC = "sigmoid"
MLA_CACHE_DTYPES = ("fp8_e4m3", "bf16")
KDA_STATE_DTYPE = "fp32"
KDA_CONV_DTYPE = "bf16"
FULL_GRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
MAX_QUERY_LEN = 8
"""Verify steps of q = 1 + drafts <= 8 tokens per request."""
MAX_TOKENS = 64
CAPTURE_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)
TEST_MODE_ENV = "K3_DECODE_TEST_MODE"
TEST_MODE = "tiny-cpu"
"""The only test mode: a tiny K3 on the CPU, eager (see the module docstring)."""


class UnknownTestMode(ValueError):
    """``K3_DECODE_TEST_MODE`` holds a value other than ``tiny-cpu``."""


def is_test_mode(environ: dict[str, str] | None = None) -> bool:
    """True when ``K3_DECODE_TEST_MODE=tiny-cpu``; False when unset or empty.

    Raises ``UnknownTestMode`` (one line) for any other value."""
    value = (os.environ if environ is None else environ).get(TEST_MODE_ENV, "").strip()
    if value and value != TEST_MODE:
        raise UnknownTestMode(
            f"k3ft: {TEST_MODE_ENV}={value!r}: give {TEST_MODE!r} or leave it unset")
    return value == TEST_MODE

_DTYPE_ALIASES = {
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "auto": "bf16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
}


def dtype_name(name: str) -> str:
    """Canonical dtype name: ``fp8`` -> ``fp8_e4m3``, ``bfloat16`` -> ``bf16``.

    ``auto`` (the model dtype) is K3's bf16.
    """
    key = name.lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(key, key)


@dataclass(frozen=True)
class StartupFacts:
    """What start-up selection looks at; the plugin fills it from vLLM's engine config."""

    gpu_family: str
    tp_size: int
    architecture: str
    hidden_size: int
    num_experts: int
    top_k: int
    hidden_act: str = HIDDEN_ACT
    scoring_func: str = SCORING_FUNC
    mla_cache_dtype: str = "fp8_e4m3"
    kda_state_dtype: str = "fp32"
    kda_conv_dtype: str = "bf16"
    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    enforce_eager: bool = False
    pp_size: int = 1
    expert_parallel: bool = False
    num_speculative_tokens: int = 0

    def as_config(self) -> dict[str, str]:
        """The facts as strings (the trace's ``config`` field)."""
        return {k: str(v) for k, v in asdict(self).items()}


def _shape_reasons(f: StartupFacts) -> list[str]:
    """K3's shapes (waived by the test mode)."""
    reasons: list[str] = []
    if f.hidden_size != HIDDEN_SIZE:
        reasons.append(f"hidden size {f.hidden_size}, needs {HIDDEN_SIZE}")
    if f.num_experts not in EXPERT_COUNTS:
        reasons.append(f"{f.num_experts} routed experts, needs one of {EXPERT_COUNTS}")
    if f.top_k != TOP_K:
        reasons.append(f"top-{f.top_k} routing, needs top-{TOP_K}")
    return reasons


def _graph_reasons(f: StartupFacts) -> list[str]:
    """FULL CUDA graphs (waived by the test mode)."""
    reasons: list[str] = []
    if f.enforce_eager:
        reasons.append("enforce_eager is set: decode needs FULL CUDA graphs")
    if f.cudagraph_mode.upper() not in FULL_GRAPH_MODES:
        reasons.append(
            f"CUDA graph mode {f.cudagraph_mode}, needs FULL decode graphs "
            f"({', '.join(FULL_GRAPH_MODES)})"
        )
    return reasons


def _gpu_reasons(f: StartupFacts) -> list[str]:
    """A supported GPU (the test mode waives ``cpu`` only)."""
    if f.gpu_family not in GPU_FAMILIES:
        return [f"GPU family {f.gpu_family}, needs {' or '.join(GPU_FAMILIES)}"]
    return []


def _waivable_reasons(f: StartupFacts) -> list[str]:
    """What the test mode waives: the CPU, tiny shapes, no FULL graphs."""
    cpu = _gpu_reasons(f) if f.gpu_family == "cpu" else []
    return cpu + _shape_reasons(f) + _graph_reasons(f)


def _model_reasons(f: StartupFacts) -> list[str]:
    reasons: list[str] = []
    if f.architecture not in ARCHITECTURES:
        reasons.append(
            f"model architecture {f.architecture} is not Kimi K3 ({', '.join(ARCHITECTURES)})"
        )
    reasons += _shape_reasons(f)
    if f.hidden_act != HIDDEN_ACT:
        reasons.append(f"expert activation {f.hidden_act}, needs {HIDDEN_ACT}")
    if f.scoring_func != SCORING_FUNC:
        reasons.append(f"router scoring {f.scoring_func}, needs {SCORING_FUNC}")
    return reasons


def _deployment_reasons(f: StartupFacts) -> list[str]:
    reasons = _gpu_reasons(f)
    if f.tp_size not in TP_SIZES:
        reasons.append(f"tensor parallel size {f.tp_size}, needs one of {TP_SIZES}")
    if f.pp_size != 1:
        reasons.append(f"pipeline parallel size {f.pp_size}, needs 1")
    if f.expert_parallel:
        reasons.append("expert parallelism is on, needs off")
    if f.num_speculative_tokens > MAX_QUERY_LEN - 1:
        reasons.append(
            f"{f.num_speculative_tokens} speculative tokens, at most {MAX_QUERY_LEN - 1}"
        )
    return reasons


def _cache_and_graph_reasons(f: StartupFacts) -> list[str]:
    reasons: list[str] = []
    if dtype_name(f.mla_cache_dtype) not in MLA_CACHE_DTYPES:
        reasons.append(
            f"MLA latent cache dtype {f.mla_cache_dtype}, needs one of {MLA_CACHE_DTYPES}"
        )
    if dtype_name(f.kda_state_dtype) != KDA_STATE_DTYPE:
        reasons.append(f"KDA recurrent state dtype {f.kda_state_dtype}, needs {KDA_STATE_DTYPE}")
    if dtype_name(f.kda_conv_dtype) != KDA_CONV_DTYPE:
        reasons.append(f"KDA conv state dtype {f.kda_conv_dtype}, needs {KDA_CONV_DTYPE}")
    return reasons + _graph_reasons(f)


def startup_reasons(facts: StartupFacts) -> list[str]:
    """Every unmet start-up requirement (empty: the backend may be enabled)."""
    return _deployment_reasons(facts) + _model_reasons(facts) + _cache_and_graph_reasons(facts)


def startup_record(facts: StartupFacts, *, test_mode: bool = False) -> dict[str, object]:
    """The start-up decision as a ``k3fasttrack.models.trace.StartupDecision`` JSON object.

    ``test_mode`` (``K3_DECODE_TEST_MODE=tiny-cpu``) drops the waivable reasons from ``reasons``
    and lists them, with the mode, in ``config``."""
    reasons = startup_reasons(facts)
    config = facts.as_config()
    if test_mode:
        waived = set(_waivable_reasons(facts))
        config["test_mode"] = TEST_MODE
        config["test_mode_waived"] = "; ".join(r for r in reasons if r in waived)
        reasons = [r for r in reasons if r not in waived]
    return {
        "kind": "startup",
        "backend": BACKEND_NAME,
        "enabled": not reasons,
        "reasons": reasons,
        "config": config,
    }


@dataclass(frozen=True, slots=True)
class StepDecision:
    """One step's choice; mirrors ``k3fasttrack.models.trace.StepDecision`` field for field."""

    step: int
    num_tokens: int
    num_reqs: int
    query_len: int | None
    phase: str
    path: str
    reasons: tuple[str, ...]
    capture_size: int | None

    @property
    def specialized(self) -> bool:
        """True when the specialized path runs this step."""
        return self.path == "specialized"

    def as_record(self) -> dict[str, object]:
        """JSON-ready trace record."""
        rec = asdict(self)
        rec["kind"] = "step"
        rec["reasons"] = list(self.reasons)
        return rec


def _phase(num_reqs: int, num_prefills: int, lens: set[int]) -> str:
    if num_reqs and num_prefills >= num_reqs:
        return "prefill"
    if num_prefills or len(lens) > 1:
        return "mixed"
    return "verify" if lens and max(lens) > 1 else "decode"


def _capture_size(num_tokens: int, q: int, sizes: Sequence[int]) -> int | None:
    fits = [s for s in sizes if s >= num_tokens and s % q == 0 and s <= MAX_TOKENS]
    return min(fits) if fits else None


def step_decision(
    step: int,
    num_reqs: int,
    query_lens: Sequence[int],
    num_tokens: int,
    *,
    num_prefills: int = 0,
    capture_sizes: Sequence[int] = CAPTURE_SIZES,
    in_graph: bool = True,
    test_mode: bool = False,
) -> StepDecision:
    """Specialized only for a pure decode or uniform verify step that fits a captured graph.

    ``test_mode``: an eager step (``in_graph=False``) may be specialized; it has no capture size.
    """
    lens = set(query_lens)
    phase = _phase(num_reqs, num_prefills, lens)
    reasons: list[str] = []
    if num_reqs == 0:
        reasons.append("empty step (no request)")
    if num_prefills:
        reasons.append(f"{num_prefills} of {num_reqs} request(s) are prefills")
        if num_prefills < num_reqs:
            reasons.append(
                f"mixed batch: {num_prefills} prefill and "
                f"{num_reqs - num_prefills} decode request(s)"
            )
    elif len(lens) > 1:
        reasons.append(f"non-uniform query lengths {sorted(lens)}: verify steps must be uniform")
    if len(query_lens) != num_reqs or sum(query_lens) != num_tokens:
        reasons.append(
            f"{len(query_lens)} query length(s) summing to {sum(query_lens)} "
            f"for {num_reqs} request(s) and {num_tokens} token(s)"
        )
    if num_tokens > MAX_TOKENS:
        reasons.append(f"{num_tokens} tokens > {MAX_TOKENS}")
    q = max(lens) if len(lens) == 1 and not num_prefills else None
    if q is not None and q > MAX_QUERY_LEN:
        reasons.append(f"query length {q} > {MAX_QUERY_LEN}")
    size = _capture_size(num_tokens, q, capture_sizes) if q else None
    if q and num_tokens <= MAX_TOKENS and size is None:
        reasons.append(f"no captured graph size >= {num_tokens} tokens divisible by q={q}")
    if not in_graph and not test_mode:
        reasons.append("eager step (not inside a captured CUDA graph)")
    path = "stock" if reasons else "specialized"
    return StepDecision(
        step=step,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        query_len=q,
        phase=phase,
        path=path,
        reasons=tuple(reasons),
        capture_size=size if path == "specialized" and in_graph else None,
    )
