"""Raw sample records (JSONL, one per line) that bundles carry and ``verify``/``diff`` recompute from.

- Eval per-sample logs: ``evals/<suite>/<side>.jsonl``, one ``EvalSample`` per line.
- Perf repeats: ``perf/samples.jsonl``, one ``PerfSample`` per line (one per metric per repeat).
"""

from __future__ import annotations

from typing import Literal

from k3fasttrack.models.base import Record

Side = Literal["baseline", "candidate"]


class EvalSample(Record):
    """One scored eval item on one side."""

    suite: str
    side: Side
    doc_id: str
    score: float
    """1.0/0.0 for exact-match suites; a ratio in [0, 1] for MRCR."""
    prompt_sha256: str
    output: str
    prompt: str | None = None
    """The exact prompt sent (text, or chat messages as JSON); None where the dataset's authors
    ask that its questions not be published (GPQA). The perf tier resends these."""
    output_token_ids: tuple[int, ...] | None = None


class PerfSample(Record):
    """One measured value of one repeat of one sweep point on one side."""

    point: str
    """Stable id of the sweep point (e.g. ``decode-b8-in1024-out128``)."""
    side: Side
    repeat: int
    metric: str
    """e.g. ``tpot_ms_median``, ``ttft_ms_median``, ``output_tok_s``, ``interactivity_tok_s_user``."""
    value: float
    unit: str
    higher_is_better: bool
