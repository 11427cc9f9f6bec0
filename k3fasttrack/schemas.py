"""JSON Schemas of the artefacts, generated into ``schemas/`` (a test fails when they drift).

Regenerate with ``python -m k3fasttrack.schemas``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter

from k3fasttrack.models import Environment, Manifest, Plan, Profile, RunRecord, Verdict
from k3fasttrack.models.reports import TierReport
from k3fasttrack.models.samples import EvalSample, PerfSample
from k3fasttrack.models.trace import TraceRecord

ARTEFACTS: dict[str, Any] = {
    "profile": Profile, "plan": Plan, "environment": Environment, "verdict": Verdict,
    "manifest": Manifest, "run": RunRecord, "tier_report": TierReport,
    "eval_sample": EvalSample, "perf_sample": PerfSample, "selection_trace_record": TraceRecord,
}
SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"


def schema_of(obj: Any) -> dict[str, Any]:
    """The serialization-mode JSON Schema of a model or annotated type."""
    if isinstance(obj, type) and issubclass(obj, BaseModel):
        return obj.model_json_schema(mode="serialization")
    return TypeAdapter(obj).json_schema(mode="serialization")


def render_all() -> dict[str, str]:
    """File name -> schema text for every artefact."""
    return {f"{name}.schema.json": json.dumps(schema_of(obj), indent=1, sort_keys=True) + "\n"
            for name, obj in ARTEFACTS.items()}


def main() -> None:
    """Write every schema into ``schemas/``."""
    SCHEMA_DIR.mkdir(exist_ok=True)
    for name, text in render_all().items():
        (SCHEMA_DIR / name).write_text(text)
    print(f"wrote {len(ARTEFACTS)} schemas to {SCHEMA_DIR}", file=sys.stderr)


if __name__ == "__main__":
    main()
