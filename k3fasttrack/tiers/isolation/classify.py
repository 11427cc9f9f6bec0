"""Static classification: every path changed between the merge base and head gets a class.

Classes, checked in this order for each path: ``in_scope`` (the profile's model-folder globs),
touch point (``allowed_touch_point`` when the change keeps the touch point's line limit, line rule
and entry rule (``entries.py``), else ``out_of_scope``), ``shared_component`` (needs a core
maintainer's review), ``out_of_scope``.
A rename is in scope only when both its old and new path are; a copy is judged by its new path.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from k3fasttrack.errors import UsageError
from k3fasttrack.models.isolation import (
    ChangeClass,
    ChangeKind,
    EntryChange,
    FileType,
    IsolationConfig,
    IsolationReport,
    PathChange,
    TouchPoint,
)
from k3fasttrack.tiers.isolation import entries, gitdiff
from k3fasttrack.tiers.isolation.checks import (
    count_classes,
    isolation_status,
    static_checks,
    summary_line,
)
from k3fasttrack.tiers.isolation.globs import GlobSet

MODE_TYPES: dict[str, FileType] = {
    "100644": "file",
    "100755": "executable",
    "120000": "symlink",
    "160000": "submodule",
    "100664": "file",
}
KINDS: dict[str, ChangeKind] = {
    "A": "added",
    "D": "deleted",
    "M": "modified",
    "T": "type_changed",
    "R": "renamed",
    "C": "copied",
}
EMPTY_MODE = "000000"


@dataclass(frozen=True)
class PathClass:
    """The class one path alone falls into, with the glob or component that decided it."""

    cls: ChangeClass | None
    """None for a touch point (its class depends on the change)."""
    why: str
    component: str | None = None
    touch_point: TouchPoint | None = None


@dataclass(frozen=True)
class Decision:
    """The class a change gets, why, and what it matched."""

    cls: ChangeClass
    why: str
    component: str | None = None
    entries: tuple[EntryChange, ...] = ()


def _compile(pattern: str, field: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise UsageError(f"isolation: a touch point's {field} does not compile: {exc}") from exc


class Scope:
    """The profile's scope, compiled once."""

    def __init__(self, config: IsolationConfig) -> None:
        self.in_scope = GlobSet(config.in_scope)
        self.touch_points = [(GlobSet([tp.path]), tp) for tp in config.touch_points]
        self.shared = [(GlobSet(sc.globs), sc.name) for sc in config.shared_components]
        self.line_rules = {
            tp.path: _compile(tp.allowed_line_regex, "allowed_line_regex")
            for tp in config.touch_points
            if tp.allowed_line_regex
        }
        self.entry_rules = {
            tp.path: _compile(tp.entry_key_regex, "entry_key_regex")
            for tp in config.touch_points
            if tp.entry_key_regex
        }

    def of(self, path: str) -> PathClass:
        """Class of a single path."""
        glob = self.in_scope.first(path)
        if glob is not None:
            return PathClass("in_scope", f"inside the model's folders ({glob})")
        for globs, tp in self.touch_points:
            if globs.match(path):
                return PathClass(None, f"touch point {tp.path}", tp.path, tp)
        for globs, name in self.shared:
            glob = globs.first(path)
            if glob is not None:
                return PathClass("shared_component", f"shared component {name} ({glob})", name)
        return PathClass(
            "out_of_scope", "outside the model's folders, touch points and shared components"
        )


def _file_type(mode: str) -> FileType | None:
    return None if mode == EMPTY_MODE else MODE_TYPES.get(mode, "file")


def _symlink_target(
    raw: gitdiff.RawChange, blobs: dict[str, bytes]
) -> tuple[str | None, str | None]:
    """(stored target, resolved repository path or None when it leaves the repository)."""
    if raw.new_mode != "120000" or raw.new_sha not in blobs:
        return None, None
    target = blobs[raw.new_sha].decode("utf-8", errors="replace")
    if target.startswith("/"):
        return target, None
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(raw.path), target))
    return target, None if resolved == ".." or resolved.startswith("../") else resolved


class Classifier:
    """Classifies the raw changes of one diff."""

    def __init__(self, repo: Path, old: str, new: str, scope: Scope) -> None:
        self.repo, self.old, self.new, self.scope = repo, old, new, scope

    def change(self, raw: gitdiff.RawChange, blobs: dict[str, bytes]) -> PathChange:
        """Build the classified record of one raw change."""
        kind = KINDS.get(raw.status, "modified")
        old_type, new_type = _file_type(raw.old_mode), _file_type(raw.new_mode)
        target, resolved = _symlink_target(raw, blobs)
        gitlink = "submodule" in (old_type, new_type)
        draft = PathChange(
            path=raw.path,
            old_path=raw.old_path,
            kind=kind,
            cls="out_of_scope",
            reason="",
            added=None if gitlink else raw.added,
            deleted=None if gitlink else raw.deleted,
            binary=raw.added is None and not gitlink,
            old_type=old_type,
            new_type=new_type,
            similarity=raw.similarity,
            mode_change=(
                f"{raw.old_mode}->{raw.new_mode}"
                if EMPTY_MODE not in (raw.old_mode, raw.new_mode) and raw.old_mode != raw.new_mode
                else None
            ),
            symlink_target=target,
            submodule=f"{raw.old_sha[:12]}..{raw.new_sha[:12]}" if gitlink else None,
        )
        decision = self._decide(raw, draft, resolved)
        return draft.model_copy(
            update={
                "cls": decision.cls,
                "reason": f"{self._what(draft)}; {decision.why}",
                "component": decision.component,
                "entries": decision.entries,
            }
        )

    @staticmethod
    def _what(draft: PathChange) -> str:
        """What happened to the path, in words (the first half of its reason)."""
        words = [draft.kind if not draft.old_path else f"{draft.kind} from {draft.old_path}"]
        if draft.mode_change:
            words.append(f"mode {draft.mode_change}")
        if draft.binary:
            words.append("binary")
        if draft.submodule:
            words.append(f"submodule pointer {draft.submodule} (contents not classified)")
        if draft.symlink_target is not None:
            words.append(f"symlink to {draft.symlink_target}")
        return ", ".join(words)

    def _decide(
        self,
        raw: gitdiff.RawChange,
        draft: PathChange,
        resolved: str | None,
    ) -> Decision:
        kind = draft.kind
        new = self.scope.of(raw.path)
        if kind == "renamed" and raw.old_path is not None:
            return self._rename(self.scope.of(raw.old_path), new)
        if new.touch_point is not None:
            return self._touch(raw, draft, new)
        assert new.cls is not None
        if draft.symlink_target is not None and new.cls == "in_scope":
            if resolved is None:
                return Decision(
                    "out_of_scope", "symlink inside the scope points outside the repository"
                )
            if not self.scope.in_scope.covers_dir(resolved):
                return Decision(
                    "out_of_scope",
                    f"symlink inside the scope points outside it (resolves to {resolved})",
                )
            return Decision("in_scope", f"{new.why}; its target {resolved} is in scope too")
        return Decision(new.cls, new.why, new.component)

    @staticmethod
    def _rename(old: PathClass, new: PathClass) -> Decision:
        """Both sides must be in scope; a touch point may be edited, never moved."""
        pair = f"old path: {old.why}; new path: {new.why}"
        if old.cls == "in_scope" and new.cls == "in_scope":
            return Decision("in_scope", f"both paths in scope ({pair})")
        if "out_of_scope" in (old.cls, new.cls):
            why = f"a rename is in scope only when both paths are ({pair})"
            return Decision("out_of_scope", why)
        if old.touch_point is not None or new.touch_point is not None:
            return Decision("out_of_scope", f"a touch point may be edited but not renamed ({pair})")
        component = new.component or old.component
        why = f"rename touches a shared component ({pair})"
        return Decision("shared_component", why, component)

    def _touch(self, raw: gitdiff.RawChange, draft: PathChange, pc: PathClass) -> Decision:
        """A touch point keeps its class only within its line limit and content rules."""
        tp = pc.touch_point
        assert tp is not None
        broken = _touch_shape(draft)
        found: tuple[EntryChange, ...] = ()
        if not broken:
            found, by_entry = self._entry_rule(raw, draft, tp)
            broken = [*_touch_limit(raw, tp), *self._line_rule(raw, tp), *by_entry]
        if broken:
            why = f"{pc.why} breaks its rule: {'; '.join(broken)}"
            return Decision("out_of_scope", why, tp.path, found)
        changed = (raw.added or 0) + (raw.deleted or 0)
        rules = f"{changed} changed line(s) within the limit of {tp.max_changed_lines}"
        if tp.allowed_line_regex:
            rules += f", every added line matches /{tp.allowed_line_regex}/"
        if tp.entry_key_regex:
            rules += f", the model's entries {entries.describe(found)}" if found else (
                ", no entry changed"
            )
        return Decision("allowed_touch_point", f"{pc.why}: {rules}", tp.path, found)

    def _line_rule(self, raw: gitdiff.RawChange, tp: TouchPoint) -> list[str]:
        """Every added line matches ``allowed_line_regex``; deletions only where allowed."""
        rule = self.scope.line_rules.get(tp.path)
        if rule is None:
            return []
        added, deleted = gitdiff.changed_lines(
            self.repo, self.old, self.new, raw.path, raw.old_path
        )
        broken: list[str] = []
        bad = [line for line in added if not rule.search(line)]
        if bad:
            broken.append(
                f"{len(bad)} added line(s) do not match /{rule.pattern}/, first: {bad[0].strip()!r}"
            )
        if deleted and not tp.allow_deletions:
            broken.append(f"{len(deleted)} line(s) deleted, the rule allows only additions")
        return broken

    def _entry_rule(
        self, raw: gitdiff.RawChange, draft: PathChange, tp: TouchPoint
    ) -> tuple[tuple[EntryChange, ...], list[str]]:
        """Only entries named by ``entry_key_regex`` may differ (``entries.compare``)."""
        own = self.scope.entry_rules.get(tp.path)
        if own is None:
            return (), []
        new_file = draft.kind in ("added", "copied")
        shas = [raw.new_sha] if new_file else [raw.old_sha, raw.new_sha]
        blobs = gitdiff.read_blobs(self.repo, shas)
        old = None if new_file else blobs[raw.old_sha]
        return entries.compare(old, blobs[raw.new_sha], own)


def _touch_shape(draft: PathChange) -> list[str]:
    """A touch point stays a text file with its mode, edited in place."""
    broken: list[str] = []
    if draft.kind in ("deleted", "type_changed"):
        broken.append(f"a touch point may not be {draft.kind.replace('_', ' ')}")
    if draft.mode_change:
        broken.append("a touch point's mode may not change")
    if draft.binary or draft.new_type in ("symlink", "submodule"):
        broken.append("a touch point must stay a text file")
    return broken


def _touch_limit(raw: gitdiff.RawChange, tp: TouchPoint) -> list[str]:
    """Added plus deleted lines stay within ``max_changed_lines``."""
    changed = (raw.added or 0) + (raw.deleted or 0)
    if changed > tp.max_changed_lines:
        return [f"{changed} changed lines, limit {tp.max_changed_lines}"]
    return []


def classify(repo: Path, base: str, head: str, config: IsolationConfig) -> IsolationReport:
    """Classify every change between ``merge-base(base, head)`` and ``head`` in ``repo``."""
    repo = gitdiff.check_repository(Path(repo))
    base_commit = gitdiff.resolve_commit(repo, base, role="base")
    head_commit = gitdiff.resolve_commit(repo, head, role="head")
    mb = gitdiff.merge_base(repo, base_commit, head_commit)
    raws = gitdiff.diff_changes(repo, mb, head_commit, copies_harder=config.find_copies_harder)
    links = sorted({r.new_sha for r in raws if r.new_mode == "120000"})
    blobs = gitdiff.read_blobs(repo, links)
    classifier = Classifier(repo, mb, head_commit, Scope(config))
    changes = tuple(classifier.change(raw, blobs) for raw in raws)
    counts = count_classes(changes)
    checks = static_checks(changes)
    status, review = isolation_status(checks)
    return IsolationReport(
        status=status,
        reason="; ".join(filter(None, (review, summary_line(counts)))),
        checks=checks,
        repo=str(repo),
        base=base,
        head=head,
        base_commit=base_commit,
        head_commit=head_commit,
        merge_base=mb,
        changes=changes,
        counts=counts,
    )
