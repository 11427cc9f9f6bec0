"""The isolation tier inside validate: planning, NOT RUN, raw files, resume and recompute."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_isolation_support import K3_SCOPE, GitRepo, make_k3_repo

from backend.k3_decode.selection import step_decision
from backend.k3_decode.trace import TraceWriter
from k3fasttrack.models.isolation import IsolationReport
from k3fasttrack.models.plan import Plan
from k3fasttrack.models.profile import Bounds, Profile
from k3fasttrack.runtime.cells import CellStore
from k3fasttrack.runtime.context import NotRunnable, TierContext
from k3fasttrack.tiers.isolation import SPEC
from k3fasttrack.tiers.registry import load_spec


@pytest.fixture
def k3_repo(tmp_path: Path) -> GitRepo:
    """A real repository holding the vLLM-like base tree, tagged ``base``."""
    return make_k3_repo(tmp_path)


class Quiet:
    """Progress sink that records notes (the resume test reads them)."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def advance(self, description: str) -> None:
        self.notes.append(f"done {description}")

    def note(self, message: str) -> None:
        self.notes.append(message)


def profile(**isolation: Any) -> Profile:
    """A minimal profile whose isolation section is K3_SCOPE updated with ``isolation``."""
    return Profile(
        name="t",
        description="t",
        switch="none",
        tiers=("isolation",),
        bounds=Bounds(gpu_families=("cpu",)),
        isolation=K3_SCOPE.model_copy(update=isolation),
    )


def context(
    prof: Profile, tmp: Path, options: dict[str, Any], progress: Quiet | None = None
) -> TierContext:
    """A TierContext as validate builds it, with the tier's planned cells."""
    cells = tuple(SPEC.plan_cells(prof, 1, options))
    plan = Plan(profile=prof.name, tp=1, tiers=("isolation",), cells=cells, command=("k3ft",))
    return TierContext(
        profile=prof,
        plan=plan,
        cells=cells,
        store=CellStore(tmp / "bundle/cells"),
        bundle_dir=tmp / "bundle",
        work_dir=tmp / "work",
        tp=1,
        resume=True,
        progress=progress or Quiet(),
        options=options,
    )


def test_registry_finds_the_tier() -> None:
    """validate discovers the tier through the registry."""
    assert load_spec("isolation") is SPEC and SPEC.name == "isolation"


def test_plan_cells_from_options_and_profile(tmp_path: Path) -> None:
    """No repo/base: no static cell; options or profile give one; a trace adds the runtime cell."""
    assert SPEC.plan_cells(profile(), 1, {}) == []
    from_opts = SPEC.plan_cells(profile(), 1, {"repo": "/r", "base": "main", "head": "h"})
    assert [c.id for c in from_opts] == ["isolation-static"]
    assert from_opts[0].params == {"repo": "/r", "base": "main", "head": "h"}
    both = SPEC.plan_cells(profile(repo="/p", base="b", selection_trace="/t.jsonl"), 1, {})
    assert [c.id for c in both] == ["isolation-static", "isolation-runtime"]
    assert both[0].params["repo"] == "/p" and both[0].params["head"] == "HEAD"


def test_not_runnable_without_repo_and_base(tmp_path: Path) -> None:
    """The tier says NOT RUN with the reason naming the options and profile keys."""
    with pytest.raises(NotRunnable, match=r"--repo/--base or the profile's isolation.repo/base"):
        SPEC.run(context(profile(), tmp_path, {}))
    with pytest.raises(NotRunnable):
        SPEC.run(context(profile(repo="/x"), tmp_path, {}))


def _make_trace(path: Path, *, leak: bool = False) -> None:
    """A trace written by the real backend writer: decode, verify, prefill and mixed steps."""
    writer = TraceWriter(path, flush_every=4, counters_every=3)
    writer.startup(
        {"kind": "startup", "backend": "k3ft_hopper", "enabled": True, "reasons": [], "config": {}}
    )
    shapes = [
        (0, 4, [1] * 4, 4, 0),
        (1, 2, [4, 4], 8, 0),
        (2, 2, [30, 10], 40, 2),
        (3, 3, [1, 1, 20], 22, 1),
        (4, 1, [1], 1, 0),
    ]
    for step, reqs, lens, tokens, prefills in shapes:
        writer.step(step_decision(step, reqs, lens, tokens, num_prefills=prefills))
    if leak:  # a (buggy) backend that ran a prefill step specialized
        bad = step_decision(9, 1, [1], 1)
        writer.step(
            type(bad)(**{**{f: getattr(bad, f) for f in bad.__slots__}, "phase": "prefill"})
        )
    writer.close()


def test_run_static_and_runtime(k3_repo: GitRepo, tmp_path: Path) -> None:
    """Raw files land in the bundle; the runtime summary counts phases, sizes and reasons."""
    k3_repo.write("vllm/models/kimi_k3/nvidia/model.py", "changed\n")
    k3_repo.write("vllm/v1/sample/sampler.py", "changed\n")
    k3_repo.commit("head")
    trace = tmp_path / "trace.jsonl"
    _make_trace(trace)
    ctx = context(
        profile(),
        tmp_path,
        {"repo": str(k3_repo.root), "base": "base", "selection_trace": str(trace)},
    )
    report = SPEC.run(ctx)
    assert isinstance(report, IsolationReport)
    assert (
        report.status == "INCOMPLETE"  # the shared sampler needs core review
        and "needs core review" in report.reason
        and report.counts.in_scope == 1
        and report.counts.shared_component == 1
    )
    assert report.raw_files == ("isolation/changes.jsonl", "isolation/selection_trace.jsonl")
    lines = (ctx.bundle_dir / "isolation/changes.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["cls"] for x in lines) == ["in_scope", "shared_component"]
    rt = report.runtime
    assert rt is not None and rt.steps == 5 and rt.startup_enabled == (True,)
    assert rt.specialized_by_phase == {"decode": 2, "verify": 1}
    assert rt.stock_by_phase == {"prefill": 1, "mixed": 1}
    assert rt.specialized_by_capture_size == {"4": 1, "8": 1, "1": 1}
    assert rt.refusal_reasons["2 of 2 request(s) are prefills"] == 1
    assert rt.refusal_reasons["mixed batch: 1 prefill and 2 decode request(s)"] == 1
    assert (rt.counters_specialized, rt.counters_stock) == (3, 2)
    assert SPEC.recompute(report, ctx.bundle_dir) == []


def test_runtime_fails_on_specialized_prefill(k3_repo: GitRepo, tmp_path: Path) -> None:
    """A prefill step on the specialized path fails the tier even when the diff is clean."""
    k3_repo.write("vllm/models/kimi_k3/nvidia/model.py", "changed\n")
    k3_repo.commit("head")
    trace = tmp_path / "trace.jsonl"
    _make_trace(trace, leak=True)
    ctx = context(
        profile(repo=str(k3_repo.root), base="base", selection_trace=str(trace)), tmp_path, {}
    )
    report = SPEC.run(ctx)
    check = next(c for c in report.checks if c.name == "runtime_prefill_mixed_stock")
    assert report.status == "FAIL" and check.outcome == "fail"
    assert report.runtime is not None and report.runtime.prefill_mixed_specialized == 1


def test_resume_skips_the_finished_cell(k3_repo: GitRepo, tmp_path: Path) -> None:
    """A second run reuses the stored cell and rewrites a lost raw file from it."""
    k3_repo.write("vllm/models/kimi_k3/a.py", "a\n")
    k3_repo.commit("head")
    opts = {"repo": str(k3_repo.root), "base": "base"}
    first = SPEC.run(context(profile(), tmp_path, opts))
    (tmp_path / "bundle/isolation/changes.jsonl").unlink()
    progress = Quiet()
    second = SPEC.run(context(profile(), tmp_path, opts, progress))
    assert "isolation-static: done earlier, skipped" in progress.notes
    assert second == first and (tmp_path / "bundle/isolation/changes.jsonl").is_file()


def test_recompute_catches_tampering(k3_repo: GitRepo, tmp_path: Path) -> None:
    """Edited raw files or an edited summary are reported, one message each."""
    k3_repo.write("vllm/models/kimi_k3/a.py", "a\n")
    k3_repo.write("setup.py", "x\n")
    k3_repo.commit("head")
    trace = tmp_path / "trace.jsonl"
    _make_trace(trace)
    ctx = context(
        profile(),
        tmp_path,
        {"repo": str(k3_repo.root), "base": "base", "selection_trace": str(trace)},
    )
    report = SPEC.run(ctx)
    assert report.status == "FAIL" and SPEC.recompute(report, ctx.bundle_dir) == []
    lied = report.model_copy(
        update={"counts": report.counts.model_copy(update={"out_of_scope": 0})}
    )
    assert any("class counts" in m for m in SPEC.recompute(lied, ctx.bundle_dir))
    changes = ctx.bundle_dir / "isolation/changes.jsonl"
    changes.write_text(changes.read_text().replace('"out_of_scope"', '"in_scope"'))
    assert any("recounted" in m for m in SPEC.recompute(report, ctx.bundle_dir))
    with (ctx.bundle_dir / "isolation/selection_trace.jsonl").open("a") as fh:
        fh.write(
            json.dumps(
                {
                    "kind": "step",
                    "step": 99,
                    "num_tokens": 1,
                    "num_reqs": 1,
                    "query_len": 1,
                    "phase": "decode",
                    "path": "specialized",
                }
            )
            + "\n"
        )
    assert any("runtime summary differs" in m for m in SPEC.recompute(report, ctx.bundle_dir))
    changes.unlink()
    assert SPEC.recompute(report, ctx.bundle_dir) == ["raw file isolation/changes.jsonl is missing"]
