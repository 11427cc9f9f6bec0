"""The isolation section of the PR comment (``k3ft summary``), from a report built here.

The report has the shape of the vLLM 0.32.0 -> 0.33.0 release diff: many in-scope paths listed
before an out-of-scope registry, and more review paths than one table shows.
"""

from __future__ import annotations

import re

from k3fasttrack.models.base import Check
from k3fasttrack.models.isolation import ChangeClass, IsolationReport, PathChange
from k3fasttrack.summary import tier_detail
from k3fasttrack.summary.tables import ISOLATION_ROWS
from k3fasttrack.tiers.isolation.checks import count_classes

REGISTRY = "vllm/model_executor/models/registry.py"


def change(path: str, cls: ChangeClass, component: str | None = None) -> PathChange:
    return PathChange(
        path=path, kind="modified", cls=cls, reason=f"modified; {cls} reason", component=component
    )


def release_like_report(n_in: int, n_out: int, n_review: int) -> IsolationReport:
    """In-scope paths sort first (``a/``), the broken registry touch point among the others."""
    changes = [
        *(change(f"a/kimi_k3/f{i:04}.py", "in_scope") for i in range(n_in)),
        *(change(f"vllm/out/f{i:04}.py", "out_of_scope") for i in range(n_out)),
        change(REGISTRY, "out_of_scope", component=REGISTRY),
        *(change(f"vllm/v1/sample/f{i:04}.py", "shared_component", "sampling")
          for i in range(n_review)),
        change("vllm/transformers_utils/configs/__init__.py", "allowed_touch_point", "cfg"),
    ]
    counts = count_classes(changes)
    return IsolationReport(
        status="FAIL",
        reason="release diff",
        checks=(Check(name="out_of_scope", outcome="fail", reason="x"),),
        changes=tuple(changes),
        counts=counts,
    )


def table_rows(body: str) -> list[list[str]]:
    """The cells of the path/class/reason table."""
    lines = body.splitlines()
    start = lines.index("| path | class | reason |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        # cells are inert markdown: a backslash escapes the character after it
        rows.append([re.sub(r"\\(.)", r"\1", cell.strip()) for cell in line.strip("|").split(" | ")])
    return rows


def test_out_of_scope_and_review_paths_lead_the_isolation_section() -> None:
    """Classes read from ``cls``; in-scope rows left out; out of scope (touch points first),
    then review, then touch points; each class capped on its own, the rest counted above."""
    n_out, n_review = ISOLATION_ROWS["out_of_scope"] + 20, 158
    body = tier_detail(release_like_report(300, n_out, n_review)).body
    rows = table_rows(body)
    classes = [r[1] for r in rows]
    assert "a/kimi_k3/" not in body and "None" not in classes
    assert rows[0][:2] == [REGISTRY, "out_of_scope"]
    shown_out = ISOLATION_ROWS["out_of_scope"]
    shown_review = ISOLATION_ROWS["shared_component"]
    assert classes == (
        ["out_of_scope"] * shown_out + ["shared_component"] * shown_review
        + ["allowed_touch_point"]
    )
    left_out = (
        f"Left out of the table below: {n_out + 1 - shown_out} out_of_scope, "
        f"{n_review - shown_review} shared_component row(s)"
    )
    assert left_out in body
    assert body.index(left_out) < body.index("| path | class | reason |")


def test_small_report_lists_every_path_that_is_not_in_scope() -> None:
    """Under the caps nothing is left out and no note says otherwise."""
    body = tier_detail(release_like_report(3, 2, 2)).body
    rows = table_rows(body)
    assert [r[0] for r in rows] == [
        REGISTRY, "vllm/out/f0000.py", "vllm/out/f0001.py",
        "vllm/v1/sample/f0000.py", "vllm/v1/sample/f0001.py",
        "vllm/transformers_utils/configs/__init__.py",
    ]
    assert "Left out" not in body
