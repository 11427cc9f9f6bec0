"""Static classification on real git repositories: every kind of change, its class and reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_isolation_support import K3_SCOPE, GitRepo, make_k3_repo

from k3fasttrack.models.isolation import IsolationConfig, IsolationReport, PathChange
from k3fasttrack.tiers.isolation import classify


@pytest.fixture
def k3_repo(tmp_path: Path) -> GitRepo:
    """A real repository holding the vLLM-like base tree, tagged ``base``."""
    return make_k3_repo(tmp_path)


M = "vllm/models/kimi_k3"
REGISTRY = "vllm/model_executor/models/registry.py"


def run(repo: GitRepo, config: IsolationConfig = K3_SCOPE) -> IsolationReport:
    """Classify base..HEAD."""
    return classify(repo.root, "base", "HEAD", config)


def only(report: IsolationReport, path: str) -> PathChange:
    """The single change at ``path``."""
    found = [c for c in report.changes if c.path == path]
    assert len(found) == 1, [c.path for c in report.changes]
    return found[0]


def test_add_modify_delete_in_scope(k3_repo: GitRepo) -> None:
    """Plain edits inside the model folder are in scope, each with its kind and line counts."""
    k3_repo.write(f"{M}/nvidia/model.py", "class Model:\n    x = 1\n")
    k3_repo.write(f"{M}/amd/model.py", "A = 1\nB = 2\n")
    (k3_repo.root / M / "common/util.py").unlink()
    k3_repo.commit("head")
    report = run(k3_repo)
    mod, add, gone = (
        only(report, f"{M}/nvidia/model.py"),
        only(report, f"{M}/amd/model.py"),
        only(report, f"{M}/common/util.py"),
    )
    assert (mod.kind, mod.cls, mod.added, mod.deleted) == ("modified", "in_scope", 1, 1)
    assert (add.kind, add.cls, add.added) == ("added", "in_scope", 2)
    assert (gone.kind, gone.cls, gone.deleted) == ("deleted", "in_scope", 1)
    assert "vllm/models/kimi_k3/**" in mod.reason
    assert (
        report.status == "PASS" and report.counts.in_scope == 3 and report.counts.out_of_scope == 0
    )


def test_change_outside_scope_fails(k3_repo: GitRepo) -> None:
    """A stock file edited by the model change is out of scope and fails the tier."""
    k3_repo.write("vllm/config/model.py", "A = 1\nB = 3\nC = 3\n")
    k3_repo.commit("head")
    report = run(k3_repo)
    change = only(report, "vllm/config/model.py")
    assert change.cls == "out_of_scope" and "outside the model's folders" in change.reason
    assert report.status == "FAIL"
    assert next(c for c in report.checks if c.name == "out_of_scope").outcome == "fail"


def test_renames(k3_repo: GitRepo) -> None:
    """in->in stays in scope; in->out and out->in are out of scope (both paths must be in scope)."""
    k3_repo.write("vllm/config/big.py", "".join(f"line {i}\n" for i in range(40)))
    k3_repo.write(f"{M}/common/big2.py", "".join(f"other {i}\n" for i in range(40)))
    k3_repo.commit("more base")
    k3_repo.git("tag", "-f", "base")
    k3_repo.git("mv", f"{M}/nvidia/model.py", f"{M}/common/model.py")
    k3_repo.git("mv", f"{M}/common/big2.py", "vllm/big2.py")
    k3_repo.git("mv", "vllm/config/big.py", f"{M}/nvidia/big.py")
    k3_repo.commit("head")
    report = run(k3_repo)
    inside = only(report, f"{M}/common/model.py")
    leaves = only(report, "vllm/big2.py")
    enters = only(report, f"{M}/nvidia/big.py")
    assert (inside.kind, inside.cls, inside.old_path) == (
        "renamed",
        "in_scope",
        f"{M}/nvidia/model.py",
    )
    assert (leaves.kind, leaves.cls) == ("renamed", "out_of_scope")
    assert (enters.kind, enters.cls, enters.old_path) == (
        "renamed",
        "out_of_scope",
        "vllm/config/big.py",
    )
    assert "both paths" in enters.reason and "old path: outside" in enters.reason
    assert report.status == "FAIL" and report.counts.out_of_scope == 2


def test_copy_is_judged_by_its_new_path(k3_repo: GitRepo) -> None:
    """Copying stock code into the model folder is in scope; the copy records its source."""
    body = "".join(f"def f{i}():\n    return {i}\n" for i in range(30))
    k3_repo.write("vllm/v1/sample/ops.py", body)
    k3_repo.commit("more base")
    k3_repo.git("tag", "-f", "base")
    k3_repo.write("vllm/v1/sample/ops.py", body + "# touched\n")
    k3_repo.write(f"{M}/nvidia/ops.py", body)
    k3_repo.commit("head")
    report = run(k3_repo)
    copy = only(report, f"{M}/nvidia/ops.py")
    assert (copy.kind, copy.cls, copy.old_path) == ("copied", "in_scope", "vllm/v1/sample/ops.py")
    assert copy.similarity == 100


def test_mode_change(k3_repo: GitRepo) -> None:
    """An executable bit flipped in scope is in scope and names the mode change."""
    (k3_repo.root / M / "nvidia/model.py").chmod(0o755)
    k3_repo.commit("head")
    change = only(run(k3_repo), f"{M}/nvidia/model.py")
    assert change.cls == "in_scope" and change.mode_change == "100644->100755"
    assert "mode 100644->100755" in change.reason and change.new_type == "executable"


def test_symlinks(k3_repo: GitRepo) -> None:
    """A link inside scope to scope is fine; one pointing outside scope or the repo is flagged."""
    k3_repo.symlink(f"{M}/amd/shared.py", "../common/util.py")
    k3_repo.symlink(f"{M}/amd/cfg.py", "../../../config/model.py")
    k3_repo.symlink(f"{M}/amd/etc", "/etc/passwd")
    k3_repo.commit("head")
    report = run(k3_repo)
    inside, outside, absolute = (
        only(report, f"{M}/amd/{n}") for n in ("shared.py", "cfg.py", "etc")
    )
    assert inside.cls == "in_scope" and inside.symlink_target == "../common/util.py"
    assert f"{M}/common/util.py is in scope" in inside.reason
    assert outside.cls == "out_of_scope" and "resolves to vllm/config/model.py" in outside.reason
    assert absolute.cls == "out_of_scope" and "outside the repository" in absolute.reason
    assert {c.new_type for c in (inside, outside, absolute)} == {"symlink"}


def test_submodule_pointer_change(k3_repo: GitRepo) -> None:
    """A gitlink bump inside scope is in scope but needs review; outside scope it fails."""
    first = k3_repo.git("rev-parse", "HEAD")
    k3_repo.gitlink(f"{M}/third_party/lib", first)
    k3_repo.gitlink("third_party/lib", first)
    k3_repo.commit("add submodules", stage_all=False)
    k3_repo.git("tag", "-f", "base")
    second = k3_repo.commit("empty", stage_all=False)
    k3_repo.gitlink(f"{M}/third_party/lib", second)
    k3_repo.gitlink("third_party/lib", second)
    k3_repo.commit("bump", stage_all=False)
    report = run(k3_repo)
    inner, outer = only(report, f"{M}/third_party/lib"), only(report, "third_party/lib")
    assert inner.cls == "in_scope" and inner.submodule == f"{first[:12]}..{second[:12]}"
    assert inner.new_type == "submodule" and not inner.binary and inner.added is None
    assert outer.cls == "out_of_scope"
    assert next(c for c in report.checks if c.name == "submodules").outcome == "needs_review"


def test_binary_file(k3_repo: GitRepo) -> None:
    """A binary file in scope is in scope and marked binary, with no line counts."""
    k3_repo.write(f"{M}/nvidia/table.bin", bytes(range(256)) * 4)
    k3_repo.commit("head")
    change = only(run(k3_repo), f"{M}/nvidia/table.bin")
    assert change.cls == "in_scope" and change.binary and change.added is None
    assert "binary" in change.reason


def test_touch_point_within_limits(k3_repo: GitRepo) -> None:
    """A registry entry naming the model's module is an allowed touch point."""
    k3_repo.write(REGISTRY, '_MODELS = {\n    "Llama": "llama",\n    "KimiK3": "kimi_k3",\n}\n')
    k3_repo.commit("head")
    report = run(k3_repo)
    change = only(report, REGISTRY)
    assert change.cls == "allowed_touch_point" and change.component == REGISTRY
    assert "1 changed line(s) within the limit of 3" in change.reason
    assert report.status == "PASS" and report.counts.allowed_touch_point == 1


def test_touch_point_over_limit(k3_repo: GitRepo) -> None:
    """More changed lines than the touch point allows: out of scope, with the count."""
    extra = "".join(f'    "KimiK3v{i}": "kimi_k3",\n' for i in range(5))
    k3_repo.write(REGISTRY, '_MODELS = {\n    "Llama": "llama",\n' + extra + "}\n")
    k3_repo.commit("head")
    change = only(run(k3_repo), REGISTRY)
    assert change.cls == "out_of_scope" and "5 changed lines, limit 3" in change.reason


def test_touch_point_breaking_its_rule(k3_repo: GitRepo) -> None:
    """An added line not naming the model, and a deleted line, both break the rule."""
    k3_repo.write(REGISTRY, '_MODELS = {\n    "Other": "other",\n}\n')
    k3_repo.commit("head")
    change = only(run(k3_repo), REGISTRY)
    assert change.cls == "out_of_scope"
    assert "do not match /kimi_k3/" in change.reason and '\'"Other": "other",\'' in change.reason
    assert "1 line(s) deleted" in change.reason


def test_touch_point_may_not_be_deleted(k3_repo: GitRepo) -> None:
    """Deleting a touch point is out of scope whatever its rule."""
    (k3_repo.root / REGISTRY).unlink()
    k3_repo.commit("head")
    change = only(run(k3_repo), REGISTRY)
    assert change.cls == "out_of_scope" and "may not be deleted" in change.reason


def test_shared_component_needs_review(k3_repo: GitRepo) -> None:
    """A sampler edit is a shared-component touch: visible, needs review, not a failure, and
    not a pass either: the tier is INCOMPLETE so a gate on the verdict stops."""
    k3_repo.write("vllm/v1/sample/sampler.py", "def sample():\n    return 1\n")
    k3_repo.commit("head")
    report = run(k3_repo)
    change = only(report, "vllm/v1/sample/sampler.py")
    assert change.cls == "shared_component" and change.component == "sampling"
    check = next(c for c in report.checks if c.name == "shared_components")
    assert check.outcome == "needs_review" and "sampling (1 path(s))" in check.reason
    assert report.status == "INCOMPLETE" and "needs core review" in report.reason


def test_merge_base_excludes_upstream_work(k3_repo: GitRepo) -> None:
    """Upstream commits on the base branch after the fork point are not the change's."""
    k3_repo.git("checkout", "-q", "-b", "feature")
    k3_repo.write(f"{M}/nvidia/model.py", "class Model:\n    y = 2\n")
    k3_repo.commit("feature work")
    k3_repo.git("checkout", "-q", "main")
    k3_repo.write("vllm/config/model.py", "A = 9\n")
    k3_repo.commit("upstream work")
    report = classify(k3_repo.root, "main", "feature", K3_SCOPE)
    assert [c.path for c in report.changes] == [f"{M}/nvidia/model.py"]
    assert report.merge_base == k3_repo.git("rev-parse", "base")


def test_every_path_has_a_reason(k3_repo: GitRepo, tmp_path: Path) -> None:
    """Mixed change set: each record has a non-empty reason starting with its kind."""
    k3_repo.write(f"{M}/a.py", "a\n")
    k3_repo.write("vllm/v1/core/sched/scheduler.py", "class Scheduler:\n    x = 1\n")
    k3_repo.write("README.md", "hi\n")
    k3_repo.commit("head")
    report = run(k3_repo)
    assert len(report.changes) == 3
    assert all(c.reason.startswith(c.kind) for c in report.changes)
    assert report.counts.model_dump() == {
        "in_scope": 1,
        "allowed_touch_point": 0,
        "shared_component": 1,
        "out_of_scope": 1,
    }


def test_odd_names_and_user_config(k3_repo: GitRepo) -> None:
    """Spaces, non-ASCII and tabs in names survive; diff.relative in the repo config is ignored."""
    k3_repo.git("config", "diff.relative", "true")
    names = [f"{M}/docs/read me ü.md", f"{M}/docs/tab\there.txt", "vllm/odd name.py"]
    for name in names:
        k3_repo.write(name, "x\n")
    k3_repo.commit("head")
    sub = classify(k3_repo.root / "vllm", "base", "HEAD", K3_SCOPE)
    assert sorted(c.path for c in sub.changes) == sorted(names)
    assert [only(sub, n).cls for n in names] == ["in_scope", "in_scope", "out_of_scope"]


def test_touch_point_at_its_limit(k3_repo: GitRepo) -> None:
    """Exactly ``max_changed_lines`` changed lines is within the limit; one more is not."""
    limit = next(tp.max_changed_lines for tp in K3_SCOPE.touch_points if tp.path == REGISTRY)
    lines = [f'    "KimiK3v{i}": "kimi_k3",\n' for i in range(limit + 1)]
    k3_repo.write(REGISTRY, '_MODELS = {\n    "Llama": "llama",\n' + "".join(lines[:limit]) + "}\n")
    k3_repo.commit("at the limit")
    at = only(run(k3_repo), REGISTRY)
    assert at.cls == "allowed_touch_point", at.reason
    assert f"{limit} changed line(s) within the limit of {limit}" in at.reason
    k3_repo.write(REGISTRY, '_MODELS = {\n    "Llama": "llama",\n' + "".join(lines) + "}\n")
    k3_repo.commit("one over")
    over = only(run(k3_repo), REGISTRY)
    assert over.cls == "out_of_scope"
    assert f"{limit + 1} changed lines, limit {limit}" in over.reason


@pytest.mark.parametrize("folder", ["vllm", "vllm/model_executor", ".git"])
def test_repo_given_as_a_subfolder_keeps_the_line_rule(k3_repo: GitRepo, folder: str) -> None:
    """--repo inside the work tree (or its git directory) classifies the whole repository and
    still reads the touch point's patch: another model's registry line is out of scope."""
    k3_repo.write(REGISTRY, '_MODELS = {\n    "Llama": "llama",\n    "Other": "other",\n}\n')
    k3_repo.commit("head")
    report = classify(k3_repo.root / folder, "base", "HEAD", K3_SCOPE)
    change = only(report, REGISTRY)
    assert change.cls == "out_of_scope", change.reason
    assert "1 added line(s) do not match /kimi_k3/" in change.reason
    expected = k3_repo.root / ".git" if folder == ".git" else k3_repo.root
    assert report.status == "FAIL" and Path(report.repo or "") == expected.resolve()
