"""Entry-level comparison of a Python touch point such as vLLM's model registry.

vLLM's ``registry.py`` is a module of dict literals (``"Arch": ("module", "Class")``); a model
change may add, edit or remove its own entries and nothing else. Both sides are parsed with
``ast``: every module-level assignment of a dict, list, tuple or set literal is a collection, a
dict entry is named by its key (``**name`` for an unpacking), any other element by itself.
Values are compared as syntax trees, so layout and comments never count as a change, and a
duplicate key (which overrides the earlier entry in a dict literal) changes that key's entry.
Every statement outside the collection literals must stay the same.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass

from k3fasttrack.models.isolation import EntryChange, EntryChangeKind

LITERALS = (ast.Dict, ast.List, ast.Tuple, ast.Set)
SHOWN = 5
"""How many entries a reason names before it says how many more there are."""

Entries = dict[str, list[str]]
"""Entry name -> the dumped values it has, in source order (a duplicate key adds a value)."""


@dataclass(frozen=True)
class Module:
    """A parsed module: its collections (by assigned name) and every other statement."""

    collections: dict[str, Entries]
    rest: tuple[str, ...]
    """Dumped statements in order; a collection's assignment stands as its name and type."""


class EntrySourceError(ValueError):
    """One side of the touch point is not Python that ``ast`` can parse."""


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ast.unparse(node)


def _entries(literal: ast.expr) -> Entries:
    found: Entries = {}
    if isinstance(literal, ast.Dict):
        for key, value in zip(literal.keys, literal.values, strict=True):
            name = f"**{ast.unparse(value)}" if key is None else _name(key)
            found.setdefault(name, []).append(ast.dump(value))
    else:
        assert isinstance(literal, (ast.List, ast.Tuple, ast.Set))
        for elt in literal.elts:
            found.setdefault(_name(elt), []).append(ast.dump(elt))
    return found


def _assigned_literal(stmt: ast.stmt) -> tuple[str, str, ast.expr] | None:
    """(name, annotation dump, literal) for ``NAME = {...}`` / ``NAME: T = [...]``, else None."""
    if (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
        and isinstance(stmt.value, LITERALS)
    ):
        return stmt.targets[0].id, "", stmt.value
    if (
        isinstance(stmt, ast.AnnAssign)
        and isinstance(stmt.target, ast.Name)
        and isinstance(stmt.value, LITERALS)
    ):
        return stmt.target.id, ast.dump(stmt.annotation), stmt.value
    return None


def parse_module(source: bytes, side: str) -> Module:
    """Split a module into its collection literals and the rest; ``side`` names it in errors."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as exc:
        raise EntrySourceError(f"the {side} side does not parse as Python: {exc}") from exc
    collections: dict[str, Entries] = {}
    rest: list[str] = []
    assigned: Counter[str] = Counter()
    for stmt in tree.body:
        found = _assigned_literal(stmt)
        if found is None:
            rest.append(ast.dump(stmt))
            continue
        name, annotation, literal = found
        assigned[name] += 1
        if assigned[name] > 1:
            name = f"{name}#{assigned[name]}"
        collections[name] = _entries(literal)
        rest.append(f"collection {name}: {annotation} {type(literal).__name__}")
    return Module(collections=collections, rest=tuple(rest))


def _kind(old: list[str] | None, new: list[str] | None) -> EntryChangeKind | None:
    if old is None:
        return "added"
    if new is None:
        return "removed"
    return None if old == new else "changed"


def diff_entries(old: Module, new: Module, own: re.Pattern[str]) -> tuple[EntryChange, ...]:
    """Every entry added, changed or removed, in the order the collections and keys appear."""
    changes: list[EntryChange] = []
    for coll in dict.fromkeys([*new.collections, *old.collections]):
        before, after = old.collections.get(coll, {}), new.collections.get(coll, {})
        for key in dict.fromkeys([*after, *before]):
            kind = _kind(before.get(key), after.get(key))
            if kind is not None:
                changes.append(
                    EntryChange(
                        collection=coll, key=key, change=kind, own=own.search(key) is not None
                    )
                )
    return tuple(changes)


def describe(entries: tuple[EntryChange, ...] | list[EntryChange]) -> str:
    """``added: A[k], B[j]; changed: ...`` naming at most ``SHOWN`` entries per kind."""
    parts: list[str] = []
    for kind in ("added", "changed", "removed"):
        names = [f"{e.collection}[{e.key!r}]" for e in entries if e.change == kind]
        if names:
            more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
            parts.append(f"{kind}: {', '.join(names[:SHOWN])}{more}")
    return "; ".join(parts)


def compare(
    old_source: bytes | None, new_source: bytes, own: re.Pattern[str]
) -> tuple[tuple[EntryChange, ...], list[str]]:
    """(entries that differ, broken rules); ``old_source`` None for a file the change adds."""
    try:
        old = parse_module(old_source or b"", "base")
        new = parse_module(new_source, "head")
    except EntrySourceError as exc:
        return (), [str(exc)]
    entries = diff_entries(old, new, own)
    broken: list[str] = []
    if old.rest != new.rest:
        broken.append("code outside the registry's collection literals changed")
    foreign = [e for e in entries if not e.own]
    if foreign:
        broken.append(
            f"{len(foreign)} entry(ies) not matching /{own.pattern}/ "
            f"(another model's) {describe(foreign)}"
        )
    return entries, broken
