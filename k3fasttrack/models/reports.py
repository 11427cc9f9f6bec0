"""The tagged union of tier reports and the run record that ties a bundle together."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, TypeAdapter

from k3fasttrack.models.base import Artefact
from k3fasttrack.models.evals import EvalsReport
from k3fasttrack.models.features import FeaturesReport
from k3fasttrack.models.isolation import IsolationReport
from k3fasttrack.models.kernels import KernelsReport
from k3fasttrack.models.perf import PerfReport
from k3fasttrack.models.proof import ProofReport
from k3fasttrack.models.tokens import TokensReport

TierReport = Annotated[
    Union[IsolationReport, ProofReport, KernelsReport, TokensReport, EvalsReport, FeaturesReport,
          PerfReport],
    Field(discriminator="tier"),
]
TIER_REPORT_ADAPTER: TypeAdapter[TierReport] = TypeAdapter(TierReport)


class RunRecord(Artefact):
    """Top-level ``run.json`` of a bundle: what ran, in which profile, with which key id."""

    kind: Literal["k3ft-run"] = "k3ft-run"
    profile: str
    tp: int
    command: tuple[str, ...]
    reports: tuple[str, ...]
    """Bundle-relative paths of the tier reports."""
