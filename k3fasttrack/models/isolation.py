"""Isolation tier: profile section and report. (Owner: isolation tier.)

Glob semantics (``in_scope``, touch-point ``path`` and shared-component ``globs``): patterns are
POSIX paths relative to the repository root and match the whole path. ``*`` matches any run of
characters inside one folder name, ``?`` one such character, ``[abc]`` one of a set, and ``**`` as
a whole path segment matches zero or more folders (``a/**`` matches everything under ``a``,
``**/x.py`` matches ``x.py`` in any folder, ``a/**/b`` matches ``a/b`` and ``a/p/q/b``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from k3fasttrack.models.base import Record
from k3fasttrack.models.tier import TierReportBase

ChangeKind = Literal["added", "deleted", "modified", "renamed", "copied", "type_changed"]
ChangeClass = Literal["in_scope", "allowed_touch_point", "shared_component", "out_of_scope"]
CHANGE_CLASSES: tuple[ChangeClass, ...] = (
    "in_scope",
    "allowed_touch_point",
    "shared_component",
    "out_of_scope",
)
FileType = Literal["file", "executable", "symlink", "submodule"]


class TouchPoint(Record):
    """A file outside the model folder that a model change may touch, within limits."""

    path: str
    """Glob of the file(s), e.g. ``vllm/model_executor/models/registry.py``."""
    max_changed_lines: int = 10
    """Added plus deleted lines allowed in this file."""
    allowed_line_regex: str | None = None
    """When set, every added line (stripped of its newline) must match it (``re.search``)."""
    allow_deletions: bool = False
    """When False and ``allowed_line_regex`` is set, any deleted line breaks the rule."""
    entry_key_regex: str | None = None
    """When set, the file is a Python module compared by its entries: every module-level
    assignment of a dict, list, tuple or set literal is a collection of entries (a dict entry is
    named by its key, any other element by itself). Each entry added, changed or removed must
    have a name matching this regex (``re.search``), and nothing else in the module may change
    (comments and layout aside)."""
    description: str = ""


class SharedComponent(Record):
    """Code shared by every model: a change here needs a core maintainer's review."""

    name: str
    """e.g. sampling, kv_cache_manager, input_preparation, scheduler, platform_defaults."""
    globs: tuple[str, ...]


class IsolationConfig(Record):
    """Where the change may live; the tier runs when ``repo`` and ``base`` are known."""

    repo: str | None = None
    base: str | None = None
    head: str = "HEAD"
    in_scope: tuple[str, ...] = ()
    """Globs of the model's own folders, e.g. ``vllm/models/kimi_k3/**``."""
    touch_points: tuple[TouchPoint, ...] = ()
    shared_components: tuple[SharedComponent, ...] = ()
    selection_trace: str | None = None
    """Path of a selection trace (JSONL) to aggregate; ``--selection-trace`` overrides it."""
    find_copies_harder: bool = False
    """Also look for copy sources among unmodified files (slower on large diffs)."""


EntryChangeKind = Literal["added", "changed", "removed"]


class EntryChange(Record):
    """One entry of a touch point's collection literals that differs between the two sides."""

    collection: str
    """The module-level name the literal is assigned to, e.g. ``_TEXT_GENERATION_MODELS``."""
    key: str
    """The entry's name: a dict key (``"KimiK3MTPModel"``), ``**name`` for an unpacking, or the
    element itself in a list, tuple or set."""
    change: EntryChangeKind
    own: bool
    """True when the name matches the touch point's ``entry_key_regex``."""


class PathChange(Record):
    """One changed path between the merge base and head, with its class and why."""

    path: str
    old_path: str | None = None
    """Source path of a rename or copy."""
    kind: ChangeKind
    cls: ChangeClass
    reason: str
    added: int | None = None
    """Added lines; None for binary files and submodules."""
    deleted: int | None = None
    binary: bool = False
    old_type: FileType | None = None
    new_type: FileType | None = None
    mode_change: str | None = None
    """``"100644->100755"`` when the mode changed, else None."""
    symlink_target: str | None = None
    """Target of a symlink as stored in git (resolved relative to the link's folder)."""
    submodule: str | None = None
    """``"<old sha>..<new sha>"`` for a submodule pointer change."""
    component: str | None = None
    """Shared component name, or the touch-point glob, that this path matched."""
    similarity: int | None = None
    """Rename/copy similarity in percent."""
    entries: tuple[EntryChange, ...] = ()
    """For a touch point compared by entries: every entry added, changed or removed."""


class ClassCounts(Record):
    """How many changed paths fell into each class."""

    in_scope: int = 0
    allowed_touch_point: int = 0
    shared_component: int = 0
    out_of_scope: int = 0


class RuntimeSummary(Record):
    """What the selection trace says about when the specialized path ran."""

    records: int
    startup_enabled: tuple[bool, ...] = ()
    """One entry per start-up decision (one per process that wrote the trace)."""
    startup_reasons: dict[str, int] = Field(default_factory=dict)
    """Every start-up refusal reason, counted."""
    steps: int = 0
    specialized_by_phase: dict[str, int] = Field(default_factory=dict)
    stock_by_phase: dict[str, int] = Field(default_factory=dict)
    specialized_by_capture_size: dict[str, int] = Field(default_factory=dict)
    refusal_reasons: dict[str, int] = Field(default_factory=dict)
    """Every per-step refusal reason, counted (a step may give several)."""
    prefill_mixed_specialized: int = 0
    """Prefill or mixed steps that ran the specialized path (must be 0)."""
    counters_specialized: int | None = None
    """Specialized steps in the last counter snapshot(s), summed over writers."""
    counters_stock: int | None = None


class IsolationReport(TierReportBase):
    """Classification of every changed path, plus the runtime selection summary."""

    tier: Literal["isolation"] = "isolation"
    repo: str | None = None
    base: str | None = None
    head: str | None = None
    base_commit: str | None = None
    head_commit: str | None = None
    merge_base: str | None = None
    """The diff runs from here (merge base of base and head) to head."""
    changes: tuple[PathChange, ...] = ()
    counts: ClassCounts = Field(default_factory=ClassCounts)
    runtime: RuntimeSummary | None = None
