"""Suite files (``eval_suites/*.yaml``): a frozen, closed model and its loader.

A suite names the lm-eval task it reuses, where its data comes from, the slice and generation
budget, the per-sample metric, and the pass rule, all declared before anything runs. An unknown
or malformed field is refused with one line naming the file and the field.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from k3fasttrack.data import DATA_DIR, data_candidates, resolve_data_file
from k3fasttrack.errors import UsageError
from k3fasttrack.models.base import Record
from k3fasttrack.models.sizing import SizingPlan
from k3fasttrack.stats.models import NoninferiorityDesign

REPO_ROOT = Path(__file__).resolve().parents[3]
SUITES_DIR = DATA_DIR / "eval_suites"


class SuiteError(UsageError):
    """A suite file that cannot be read or does not validate."""


class JsonlData(Record):
    """Local JSON-lines files, one per split, relative to the datasets folder."""

    kind: Literal["jsonl"]
    files: dict[str, str]
    """Split name (as the lm-eval task calls it: ``test``, ``train``) -> file."""
    official: bool = False
    """The suite claims the public release: every file's sha256 must be a pinned official
    digest (``tiers/evals/provenance.py``), else the run stops with one line before any request."""


class GpqaZipData(Record):
    """The official password-protected GPQA ``dataset.zip`` (or a synthetic one in its layout)."""

    kind: Literal["gpqa_zip"]
    member: str = "gpqa_diamond.csv"
    """Base name of the CSV inside the zip."""
    shuffle_seed: int = 0
    """Seed of the fixed answer order written into each document (same on both sides)."""
    default_zip: str | None = None
    """Zip (relative to the package data folder) used without ``--gpqa-zip`` /
    ``K3FT_GPQA_ZIP`` (demo only)."""
    default_password: str | None = None
    """Password of ``default_zip`` (a synthetic fixture's, never the official one)."""


class MrcrData(Record):
    """MRCR: the official parquet files from ``--mrcr-dir``, or data generated from a seed."""

    kind: Literal["mrcr"]
    source: Literal["generated", "parquet"] = "generated"
    """``parquet`` needs ``--mrcr-dir``/``K3FT_MRCR_DIR``; ``generated`` uses mrcr.py."""
    n_needles: int = Field(2, ge=1)
    seed: int = 0
    context_tokens: tuple[int, ...] = (1024,)
    """Generated data: target prompt sizes, cycled over the documents."""
    max_chars: int | None = None
    """Parquet data: keep only rows whose prompt is at most this many characters."""


DataSpec = Annotated[JsonlData | GpqaZipData | MrcrData, Field(discriminator="kind")]


class TaskSpec(Record):
    """The lm-eval task a suite reuses: a YAML under lm-eval's ``tasks/`` folder, or ours."""

    lm_eval: str | None = None
    """Path under ``lm_eval/tasks/``, e.g. ``gsm8k/gsm8k.yaml`` (scoring reused as is)."""
    builtin: Literal["mrcr"] | None = None
    """A task this package defines (MRCR is not in lm-eval 0.4.13)."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Task config keys replaced after loading (never the dataset keys: ``data`` sets those)."""

    @model_validator(mode="after")
    def _exactly_one(self) -> TaskSpec:
        if (self.lm_eval is None) == (self.builtin is None):
            raise ValueError("give exactly one of task.lm_eval and task.builtin")
        return self


class Generation(Record):
    """Generation settings, identical on both sides."""

    max_gen_toks: int = Field(gt=0)
    temperature: float = Field(0.0, ge=0.0)
    seed: int = 1234
    """Sent with every request and used for lm-eval's python/numpy/fewshot seeds."""


class Score(Record):
    """Which per-sample value is compared: the metric under one of the task's filters."""

    metric: str = "exact_match"
    filter: str = "none"


class PassRule(Record):
    """Declared up front: the one-sided non-inferiority design of the suite (see
    ``k3fasttrack.stats.noninferiority`` for the rule it drives)."""

    margin: float = Field(gt=0.0, le=1.0)
    """Largest drop of candidate - baseline accepted: the one-sided bound must lie above it."""
    alpha: float = Field(0.025, gt=0.0, lt=0.5)
    """One-sided level: regression test (Holm across suites), bound (1 - 2 alpha interval)."""
    power: float = Field(0.8, gt=0.5, lt=1.0)
    """Power at which the minimal detectable drop is stated."""
    aa_flip_rate: float = Field(ge=0.0, lt=1.0)
    """Share of documents whose score differs between two baseline runs (numerical noise)."""
    chance: float = Field(0.0, ge=0.0, lt=1.0)
    """Accuracy by guessing: 0.25 for 4-choice questions, 0 for free-form answers."""


class Suite(Record):
    """One eval suite file."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_\-]*$")
    description: str = ""
    task: TaskSpec
    api: Literal["completions", "chat"]
    """``completions``: /v1/completions with tokenized prompts; ``chat``: /v1/chat/completions."""
    data: DataSpec
    limit: int | None = Field(None, gt=0)
    """Documents taken from the start of the test split; None = all."""
    full_size: int = Field(gt=0)
    """Documents in the full suite (a smaller ``limit`` is recorded as a deviation)."""
    full_max_gen_toks: int | None = None
    """Generation budget of the full suite (a smaller ``max_gen_toks`` is a deviation)."""
    num_fewshot: int = Field(0, ge=0)
    plan_prompt_tokens: int = Field(512, ge=1)
    """Mean prompt length in tokens (few-shot examples included), for the time estimate of a
    budgeted run; a budget that shrinks the run lowers ``limit``."""
    system_instruction: str | None = None
    generation: Generation
    score: Score = Field(default_factory=Score)
    pass_rule: PassRule
    num_concurrent: int = Field(4, ge=1)
    """Requests in flight per server (same on both sides)."""
    request_timeout_s: int = Field(600, gt=0)


_DATA_KINDS = ("jsonl", "gpqa_zip", "mrcr")


def _field_path(loc: tuple[int | str, ...]) -> str:
    parts = [
        str(p) for i, p in enumerate(loc) if not (i == 1 and loc[0] == "data" and p in _DATA_KINDS)
    ]
    return ".".join(parts) or "(top)"


def _one_line(path: Path, exc: ValidationError) -> str:
    err = exc.errors()[0]
    field = _field_path(tuple(err["loc"]))
    if err["type"] == "extra_forbidden":
        return f"suite file {path}: unknown field '{field}'"
    if err["type"] == "missing":
        return f"suite file {path}: missing field '{field}'"
    return f"suite file {path}: field '{field}': {err['msg']}"


def resolve_suite_path(ref: str | Path) -> Path:
    """A suite reference from a profile: a path as given, a path under the shipped suites
    written with their folder name (``eval_suites/demo/gsm8k.yaml``), or a bare suite name."""
    return (resolve_data_file(ref, "eval_suites")
            or data_candidates(ref, "eval_suites")[-1])


def load_suite(ref: str | Path) -> Suite:
    """Read and validate one suite file; raise ``SuiteError`` (one line) when it is not valid."""
    path = resolve_suite_path(ref)
    if not path.is_file():
        raise SuiteError(f"suite file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SuiteError(f"suite file {path}: not valid YAML{where}") from None
    if not isinstance(raw, dict):
        raise SuiteError(f"suite file {path}: expected a mapping at the top level")
    try:
        return Suite.model_validate(raw)
    except ValidationError as exc:
        raise SuiteError(_one_line(path, exc)) from None


def suite_digest(ref: str | Path) -> str:
    """sha256 of the suite file's bytes (recorded in the report)."""
    return hashlib.sha256(resolve_suite_path(ref).read_bytes()).hexdigest()


def suite_copy_path(name: str) -> str:
    """Where the bundle keeps the bytes of the suite file that ran."""
    return f"evals/{name}/suite.yaml"


def suite_relpath(ref: str | Path) -> str:
    """A shipped suite as ``eval_suites/...`` (POSIX), any other file by its absolute path."""
    path = resolve_suite_path(ref).resolve()
    try:
        return path.relative_to(DATA_DIR).as_posix()
    except ValueError:
        return path.as_posix()


def design(suite: Suite) -> NoninferiorityDesign:
    """The suite's declared non-inferiority design, with its planned number of documents."""
    rule = suite.pass_rule
    return NoninferiorityDesign(
        margin=rule.margin, alpha=rule.alpha, power=rule.power, aa_flip_rate=rule.aa_flip_rate,
        chance=rule.chance, planned_n=min(suite.limit or suite.full_size, suite.full_size),
    )


def sized(suite: Suite, plan: SizingPlan | None) -> Suite:
    """The suite as a budgeted run sends it: ``limit`` lowered to the documents its sizing plan
    keeps (unchanged without a plan, or when the plan keeps every declared document)."""
    n = plan.planned(f"evals:{suite.name}") if plan is not None else None
    if n is None or n >= min(suite.limit or suite.full_size, suite.full_size):
        return suite
    return suite.model_copy(update={"limit": n})


def budget_deviations(suite: Suite, n_used: int) -> list[str]:
    """How the run departs from the full suite in size and generation budget."""
    out: list[str] = []
    if n_used < suite.full_size:
        out.append(f"slice: {n_used} of {suite.full_size} documents")
    full_budget = suite.full_max_gen_toks
    if full_budget is not None and suite.generation.max_gen_toks < full_budget:
        out.append(
            f"generation budget: {suite.generation.max_gen_toks} tokens instead of {full_budget}"
        )
    return out
