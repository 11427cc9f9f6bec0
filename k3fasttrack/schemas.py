"""JSON Schemas of the artefacts and of every command's ``--json`` output, generated into
``schemas/`` (a test fails when they drift).

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


def _text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=1, sort_keys=True) + "\n"


def cli_schemas() -> dict[str, dict[str, Any]]:
    """File name -> schema of each command's ``--json`` output (envelope and result)."""
    from k3fasttrack.cli.envelope import RESULTS, envelope_model

    return {f"cli-{command}.schema.json": schema_of(envelope_model(command))
            for command in RESULTS}


def render_all() -> dict[str, str]:
    """File name -> schema text for every artefact and every command's ``--json`` output."""
    out = {f"{name}.schema.json": _text(schema_of(obj)) for name, obj in ARTEFACTS.items()}
    out.update({name: _text(schema) for name, schema in cli_schemas().items()})
    return out


def main() -> None:
    """Write every schema into ``schemas/``."""
    SCHEMA_DIR.mkdir(exist_ok=True)
    rendered = render_all()
    for name, text in rendered.items():
        (SCHEMA_DIR / name).write_text(text)
    print(f"wrote {len(rendered)} schemas to {SCHEMA_DIR}", file=sys.stderr)


if __name__ == "__main__":
    main()
