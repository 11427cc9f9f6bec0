"""Every bundle committed under bundles/ verifies against bundles/allowed_signers, and its
summary figures agree with its raw samples (k3ft verify recomputes them)."""

import contextlib
import dataclasses
import hashlib
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from k3fasttrack.bundle import verify_bundle
from k3fasttrack.envinfo import tree_digest

BUNDLES = Path(__file__).resolve().parent.parent / "bundles"
ARCHIVES = sorted(BUNDLES.glob("*/bundle.tar.gz"))


def test_there_are_committed_bundles() -> None:
    assert ARCHIVES, "no committed bundles under bundles/"


@pytest.mark.parametrize("archive", ARCHIVES, ids=lambda p: p.parent.name)
def test_committed_bundle_verifies(archive: Path) -> None:
    verified = verify_bundle(archive, BUNDLES / "allowed_signers")
    assert verified.root_digest
    if (archive.parent / "bundle").is_dir():
        folder = verify_bundle(archive.parent / "bundle", BUNDLES / "allowed_signers")
        assert folder.root_digest == verified.root_digest


def test_h200_kernel_bundle_ran_on_an_h200() -> None:

    root = BUNDLES / "h200-kernels-2026-11-29/bundle"
    env = json.loads((root / "environment.json").read_text())
    assert env["gpus"][0]["name"] == "NVIDIA H200"
    kernels = json.loads((root / "reports/kernels.json").read_text())
    assert kernels["status"] == "PASS" and kernels["passed"] == 267 and kernels["failed"] == 0


def test_h200_backend2_bundle_covers_every_op() -> None:

    root = BUNDLES / "h200-kernels-backend2-2026-11-29/bundle"
    kernels = json.loads((root / "reports/kernels.json").read_text())
    ops = {c["op"] for c in kernels["cases"]}
    assert {"kda_decode", "mla_decode", "router", "moe_mxfp4", "gemv", "attn_res_norm"} <= ops
    assert kernels["status"] == "PASS" and kernels["failed"] == 0


def _archive_json(archive: Path, name: str) -> dict:
    import tarfile

    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(name))
        return json.load(tar.extractfile(member))


def test_h200_executor_bundle_proves_the_specialized_path_served_every_step() -> None:
    """Issue 9: the perf tier compared our executor with the stock-equivalent one on an H200 and
    the proof tier found specialized steps (selection trace) and our kernels (profiler) on the
    candidate only."""
    archive = BUNDLES / "h200-executor-perf-2026-11-29/bundle.tar.gz"
    env = _archive_json(archive, "environment.json")
    assert env["gpus"][0]["name"] == "NVIDIA H200"
    perf = _archive_json(archive, "reports/perf.json")
    assert perf["status"] == "PASS" and perf["runner"] == "harness" and len(perf["points"]) == 12
    proof = _archive_json(archive, "reports/proof.json")
    assert proof["status"] == "PASS"
    (tier,) = proof["tiers"]
    assert tier["candidate"]["specialized_steps"] > 0 and tier["baseline"]["specialized_steps"] == 0
    assert tier["candidate"]["stock_decode_steps"] == 0


def test_h200_executor_kernel_bundle_keeps_its_failure() -> None:
    """Run 3: the kernel tier ran with the torch prep fallback; its one failing case stays."""
    kernels = _archive_json(BUNDLES / "h200-executor-kernels-2026-11-29/bundle.tar.gz",
                            "reports/kernels.json")
    assert kernels["status"] == "FAIL" and kernels["failed"] == 1
    (bad,) = [c for c in kernels["cases"] if not c["passed"]]
    assert bad["op"] == "executor_kernels"


def test_h200_session3_bundle_keeps_its_crash_and_shows_ten_kernel_layers() -> None:
    """Session 3 (fused MoE tail): perf and proof PASS with 10 kernels per KDA + MoE layer
    (58 per step); the kernel tier FAILED: the KDA cluster kernel hit an illegal memory access
    after the executor tests and every later GPU test failed (kept as evidence, NOTES.md)."""
    import importlib.util
    import re

    archive = BUNDLES / "h200-executor-s3-2026-11-29/bundle.tar.gz"
    kernels = _archive_json(archive, "reports/kernels.json")
    assert kernels["status"] == "FAIL" and kernels["failed"] == 0
    assert any(c["name"] == "pytest exit status" and c["outcome"] == "fail"
               for c in kernels["checks"])
    assert {"executor_agreement", "executor_kernels", "kda_decode"} <= {
        c["op"] for c in kernels["cases"]}
    assert _archive_json(archive, "reports/perf.json")["status"] == "PASS"
    assert _archive_json(archive, "reports/proof.json")["status"] == "PASS"
    spec = importlib.util.spec_from_file_location(
        "profile_layers", BUNDLES.parent / "benchmarks/profile_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cand = [r for r in mod.rows(archive) if r["side"] == "candidate"]
    assert len(cand) == 12 and all(r["kernels"] == 58 for r in cand)
    assert all(r[f"layer{i} KDA + MoE"]["kernels"] == 10 for r in cand for i in (1, 2, 4))
    b1 = next(r for r in cand if r["point"] == "decode-rand-tp1-d0-acc1-b1-in1024-out16")
    assert 0.55 < b1["layer1 KDA + MoE"]["of_roofline"] < 0.70  # 113.3 us of 71.3 (63%)
    import tarfile

    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers()
                      if m.name.endswith("decode-rand-tp1-d0-acc1-b1-in1024-out16/"
                                         "profile-candidate.json"))
        ks = mod._kernels(json.load(tar.extractfile(member)))
    (layer1,) = [seg for name, _, seg in mod.segments(ks) if name == "layer1 KDA + MoE"]
    assert [re.sub(r"^kernel_cutlass_|_kernel_ptr.*$", "", n) for n, _ in layer1] == [
        "attn_res", "gemv", "kda_decode_cluster", "gemv", "attn_res", "router", "gemv",
        "moe_w13", "moe_w2", "gemv"]


def test_h200_session4_bundle_passes_every_tier_that_ran() -> None:
    """Session 4, run 13: the first kernel tier on the H200 with the fused MoE tail and the KDA
    cluster fix that passed whole (402 cases, incl. the executor's agreement and kernel-count
    tests, MoE at 896 and 224 experts, the prep kernels); perf and proof PASS; isolation NOT_RUN
    (no base revision), hence INCOMPLETE. Its tree digest covers the tree that ran: the commit
    minus three older bundle archives moved out to fit the 64 MiB device carry."""
    archive = BUNDLES / "h200-executor-s4-2026-11-29/bundle.tar.gz"
    env = _archive_json(archive, "environment.json")
    assert env["gpus"][0]["name"] == "NVIDIA H200"
    assert env["git"]["commit"].startswith("529635f") and len(env["git"]["tree_digest"]) == 64
    assert all(p.startswith("bundles/") and p.endswith("bundle.tar.gz")
               for p in env["git"]["changed"])
    kernels = _archive_json(archive, "reports/kernels.json")
    assert kernels["status"] == "PASS" and kernels["failed"] == 0 and kernels["passed"] >= 400
    ops = {c["op"] for c in kernels["cases"]}
    assert {"kda_decode", "mla_decode", "router", "moe_mxfp4", "gemv", "attn_res_norm",
            "rms_glu_prep", "executor_agreement", "executor_kernels", "executor_layer",
            "executor_side_stream"} <= ops
    assert _archive_json(archive, "reports/perf.json")["status"] == "PASS"
    assert _archive_json(archive, "reports/proof.json")["status"] == "PASS"
    assert _archive_json(archive, "verdict.json")["outcome"] == "INCOMPLETE"


def _perf_proof_pass_b1_kernels(archive: Path) -> list[str]:
    """Perf and proof PASS, verdict INCOMPLETE (isolation NOT_RUN); the kernels of the b1 1k
    candidate step in the profiler trace."""
    for tier in ("perf", "proof"):
        assert _archive_json(archive, f"reports/{tier}.json")["status"] == "PASS"
    assert _archive_json(archive, "verdict.json")["outcome"] == "INCOMPLETE"
    b1 = _archive_json(archive, "decode-rand-tp1-d0-acc1-b1-in1024-out16/profile-candidate.json")
    return [e["name"] for e in b1["traceEvents"] if str(e.get("cat", "")).lower() == "kernel"]


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(BUNDLES.parent), *args], capture_output=True,
                          text=True, check=False)


def _has_commits(*commits: str) -> bool:
    return all(_git("cat-file", "-e", f"{c}^{{commit}}").returncode == 0 for c in commits)


def _tracked(commit: str) -> list[str]:
    """The paths tracked at ``commit`` (what a device index of that commit lists)."""
    return [p for p in _git("ls-tree", "-r", "--name-only", "-z", commit).stdout.split("\0")
            if p]


def _moved(*names: str, day: str = "2026-11-29") -> tuple[str, ...]:
    """Bundle folders `h200-executor-<name>-<day>` (the archives a device run moved out)."""
    return tuple(f"h200-executor-{n}-{day}" for n in names)


@contextlib.contextmanager
def _worktree(commit: str, moved_archives: tuple[str, ...],
              moved_files: tuple[str, ...] = ()) -> Iterator[Path]:
    """A detached worktree of ``commit`` with the named bundle folders' archives (and any
    ``moved_files``) removed, as they were moved out of the tree to fit the device carry."""
    work = Path(tempfile.mkdtemp(prefix=f"k3ft-{commit}-"))
    t = work / "t"
    try:
        assert _git("worktree", "add", "--detach", "-f", str(t), commit).returncode == 0
        for name in moved_archives:
            (t / f"bundles/{name}/bundle.tar.gz").unlink()
        for rel in moved_files:
            (t / rel).unlink()
        yield t
    finally:
        _git("worktree", "remove", "--force", str(t))
        shutil.rmtree(work, ignore_errors=True)


KIT_DIRS = (".devrun", ".gpu-wheels", ".whl-f1")  # carried to the device, ignored here


@dataclasses.dataclass(frozen=True)
class DeviceRun:
    """A validate run whose device .git was the session-start commit (so the bundle names that
    commit, dirty) while the tree held a later commit; older archives moved out for the carry."""

    name: str
    commit: str  # the code that ran
    device_commit: str  # what the bundle names
    moved: tuple[str, ...]  # bundle folders whose archives were moved out for the 64 MiB carry

    @property
    def dir(self) -> Path:
        return BUNDLES / self.name

    def env(self) -> dict:
        return _archive_json(self.dir / "bundle.tar.gz", "environment.json")


S5 = DeviceRun("h200-executor-s5-2026-11-29", "cd6d66e", "7a43e97",
               _moved("perf", "kernels", "s3", "s4", "s4b"))
S6 = DeviceRun("h200-executor-s6-2026-11-30", "9914706", "4dd13a5",
               _moved("perf", "kernels", "s3", "s4", "s4b", "s5"))
S7 = DeviceRun("h200-executor-s7-2026-11-30", "3ecaf0a", "9922658",
               _moved("perf", "kernels", "s3", "s4", "s4b", "s5")
               + _moved("s6", day="2026-11-30") + ("cpu-demo-2026-11-29",))
S8 = DeviceRun("h200-executor-s8-2026-11-30", "f7e3f53", "9f3502b",
               _moved("perf", "kernels", "s3", "s4", "s4b", "s5")
               + _moved("s6", "s7", day="2026-11-30") + ("cpu-demo-2026-11-29",))
S9 = DeviceRun("h200-executor-s9-2026-11-30", "28504c2", "fce7498",
               _moved("perf", "kernels", "s3", "s4", "s4b", "s5")
               + _moved("s6", "s7", "s8", day="2026-11-30") + ("cpu-demo-2026-11-29",))


def test_h200_session4b_bundle_ran_commit_a88ab5f() -> None:
    """Session 4, run 16 (router + front in one launch, split-K GEMV): kernels PASS (433 cases,
    incl. every GEMV split, the router-front and side-stream bit-equality tests, the kernel
    count 9 at batch 1 / 10 at batch 4), perf and proof PASS, isolation NOT_RUN. The device's
    copy of .git was the session-start commit 529635f, so the bundle names it (dirty) and its
    tree digest covers the paths tracked at 529635f. Recomputed here from a worktree of commit
    a88ab5f with the four older bundle archives removed (moved out to fit the device carry):
    the same digest, so those bytes are what ran. (New files since 529635f, e.g.
    backend/k3_decode/ops/gemv/tiling.py, are outside that digest.)"""
    archive = BUNDLES / "h200-executor-s4b-2026-11-29/bundle.tar.gz"
    env = _archive_json(archive, "environment.json")
    assert env["gpus"][0]["name"] == "NVIDIA H200"
    kernels = _archive_json(archive, "reports/kernels.json")
    assert kernels["status"] == "PASS" and kernels["failed"] == 0 and kernels["passed"] >= 433
    assert {"executor_router_front", "executor_side_stream", "gemv"} <= {
        c["op"] for c in kernels["cases"]}
    assert any("split8" in c["case"] for c in kernels["cases"] if c["op"] == "gemv")
    assert _archive_json(archive, "reports/perf.json")["status"] == "PASS"
    assert _archive_json(archive, "reports/proof.json")["status"] == "PASS"
    if not _has_commits("a88ab5f", "529635f"):
        pytest.skip("this clone lacks commits 529635f / a88ab5f (shallow history)")
    with _worktree("a88ab5f", _moved("perf", "kernels", "s3", "s4")) as t:
        assert tree_digest(t, _tracked("529635f")) == env["git"]["tree_digest"]

def test_h200_session5_bundle_ran_commit_cd6d66e() -> None:
    """Session 5, run 21 (MLA absorb / combine rewrite, strided MLA inputs and fused MLA GEMVs,
    short-context split plan, L2 prefetch removed): kernels PASS (451 cases, incl. the strided
    MLA views and the kernel count 9 / 10), perf and proof PASS, isolation NOT_RUN."""
    archive = S5.dir / "bundle.tar.gz"
    kernels = _archive_json(archive, "reports/kernels.json")
    assert kernels["status"] == "PASS" and kernels["failed"] == 0 and kernels["passed"] == 451
    cases = kernels["cases"]
    assert sum(c["op"] == "mla_decode" and c["case"].endswith("/strided") for c in cases) == 12
    assert any(c["op"] == "executor_kernels" and "spec=9 spec_b4=10" in c["case"] and c["passed"]
               for c in cases)
    for tier in ("perf", "proof"):
        assert _archive_json(archive, f"reports/{tier}.json")["status"] == "PASS"
    assert _archive_json(archive, "verdict.json")["outcome"] == "INCOMPLETE"


def test_h200_session6_bundle_ran_commit_9914706() -> None:
    """Session 6, run 30 (MLA absorb / attend / combine latency work, fused q-norm + cache
    insert, AttnRes weight loads first, the proof pattern for the fused kernel): kernels PASS
    (477 cases: the PDL MLA graph test, the fused prep against the two ops, the MLA + MoE layer
    at 13 / 14 kernels, every proof pattern matched by a real step), perf and proof PASS,
    isolation NOT_RUN. (Run 29, the same code before the profile fix, failed its proof tier:
    the profile still looked for the replaced cache-insert kernel; not kept.)"""
    archive = S6.dir / "bundle.tar.gz"
    kernels = _archive_json(archive, "reports/kernels.json")
    assert kernels["status"] == "PASS" and kernels["failed"] == 0 and kernels["passed"] == 477
    cases = kernels["cases"]
    assert any(c["op"] == "executor_kernels" and "mla_moe_layer spec=13 spec_b4=14" in c["case"]
               and c["passed"] for c in cases)
    assert sum(c["op"] == "executor_kernels" and "missing=[]" in c["case"] and c["passed"]
               for c in cases) == 2
    assert sum(c["op"] == "mla_decode" and "/pdl_graph/" in c["case"] for c in cases) == 12
    for tier in ("perf", "proof"):
        assert _archive_json(archive, f"reports/{tier}.json")["status"] == "PASS"
    assert _archive_json(archive, "verdict.json")["outcome"] == "INCOMPLETE"


def test_h200_session7_bundle_ran_commit_3ecaf0a() -> None:
    """Session 7, run 38 (the latent MoE norm inside the tail GEMV at 1-2 tokens by default, the
    E2M1 decode with one shift fewer, the opt-in tensor-core w13): kernels PASS (496 cases: the
    tensor-core w13 against float64 incl. z at 2^+-60 and a zero slice, gemv_normed against
    float64, the deferred-norm rows and partials, the executor's MoE block with the norm in the
    GEMV vs in the w2 epilogue), perf and proof PASS (gemv_normed in the candidate traces),
    isolation NOT_RUN."""
    archive = S7.dir / "bundle.tar.gz"
    kernels = _archive_json(archive, "reports/kernels.json")
    assert kernels["status"] == "PASS" and kernels["failed"] == 0 and kernels["passed"] == 496
    cases = kernels["cases"]
    assert sum(c["op"] == "moe_mxfp4" and "/w13tc" in c["case"] for c in cases) == 7
    assert sum(c["op"] == "gemv" and c["case"].startswith("normed/") for c in cases) == 4
    assert sum(c["op"] == "executor_moe_norm" and c["passed"] for c in cases) == 2
    names = _perf_proof_pass_b1_kernels(archive)
    assert sum("gemv_normed" in n for n in names) == 4  # the 4 MoE layers' tail projections


def test_h200_session8_bundle_ran_commit_f7e3f53_and_says_why_it_failed() -> None:
    """Session 8, run 44 (the q_a norm + cache insert inside the q_b projection's launch, 256-token
    MLA split chunks, the opt-in one-launch MLA decode): verdict FAIL, kept as the perf evidence
    it holds and for what failed. Perf PASS (12 points, the candidate's b1 step with `mla_qb` in
    every MLA layer); kernels: 574 of 576 recorded cases pass, the two failures and the third
    pytest failure are the test / profile mistakes fixed in 8995442 (the profiles named the
    opt-in `mla_core_kernel`, which the default path never launches; the gemv_normed N = 7164
    case asked for 14328-byte output rows), all other recorded cases incl. `mla_qb` against
    float64 pass; proof FAIL on that same pattern while the selection trace shows the
    specialized steps."""
    archive = S8.dir / "bundle.tar.gz"
    kernels = _archive_json(archive, "reports/kernels.json")
    assert kernels["status"] == "FAIL" and kernels["passed"] == 574 and kernels["failed"] == 2
    bad = [c["case"] for c in kernels["cases"] if not c["passed"]]
    assert bad == [f"{p} proof patterns, missing=['kernel_cutlass_mla_core_kernel_']"
                   for p in ("k3-hopper", "k3-hopper-perf")]
    exit_check = next(c for c in kernels["checks"] if c["name"] == "pytest exit status")
    assert exit_check["reason"].endswith(
        "test_gemv_normed_matches_reference[7164-3584-768-2-False]")
    assert exit_check["reason"].count("tests/backend/") == 3
    assert sum(c["op"] == "mla_qb" and c["passed"] for c in kernels["cases"]) == 10
    assert _archive_json(archive, "reports/perf.json")["status"] == "PASS"
    proof = _archive_json(archive, "reports/proof.json")
    assert proof["status"] == "FAIL" and "mla_core_kernel" in proof["reason"]
    assert "specialized steps on the candidate" in proof["reason"]
    assert _archive_json(archive, "verdict.json")["outcome"] == "FAIL"
    b1 = _archive_json(archive, "decode-rand-tp1-d0-acc1-b1-in1024-out16/profile-candidate.json")
    names = [e["name"] for e in b1["traceEvents"] if str(e.get("cat", "")).lower() == "kernel"]
    assert sum("mla_qb" in n for n in names) == 1 and not any("mla_prep" in n for n in names)


def test_h200_session9_bundle_ran_commit_28504c2() -> None:
    """Session 9, run 49 (the MLA decode's absorb inside the q_b projection's launch,
    `mla_qb_absorb`; w13's chunk dot as two FMA chains; gemv_normed's one-token launch bound):
    kernels PASS (588 cases: `mla_qb_absorb` bit-equal to `mla_qb` + absorb in 5 cases, the
    executor's MLA block and whole-step replay bit-equal either way, the MLA + MoE layer at 11
    kernels by default and at 10 / 12 / 13 with the switches, every proof pattern matched),
    perf and proof PASS (`mla_qba` in the b1 step, no absorb launch, the 4 MoE tails as
    gemv_normed), isolation NOT_RUN."""
    archive = S9.dir / "bundle.tar.gz"
    kernels = _archive_json(archive, "reports/kernels.json")
    assert kernels["status"] == "PASS" and kernels["failed"] == 0 and kernels["passed"] == 588
    cases = kernels["cases"]
    assert sum(c["op"] == "mla_qb_absorb" and c["passed"] for c in cases) == 5
    assert sum(c["op"] == "executor_mla_qba" and c["passed"] for c in cases) == 4
    assert any(c["op"] == "executor_kernels" and c["passed"] and
               c["case"].startswith("mla_moe_layer qb=1 qba=1 fused=0 spec=11 ") for c in cases)
    assert sum(c["op"] == "executor_kernels" and "missing=[]" in c["case"] and c["passed"]
               for c in cases) == 2
    names = _perf_proof_pass_b1_kernels(archive)
    assert len(names) == 49 and sum("mla_qba" in n for n in names) == 1
    assert not any("absorb" in n for n in names)
    assert sum("gemv_normed" in n for n in names) == 4


@pytest.mark.parametrize("run", [S5, S6, S7, S8, S9], ids=lambda r: r.name)
def test_device_run_changed_paths_are_the_commit_diff(run: DeviceRun) -> None:
    """The bundle names the device's session-start commit (dirty) on an H200: its changed code
    paths are exactly the diff from that commit to the one that ran, plus the older bundle
    archives moved out to fit the carry and the device kit files (untracked there)."""
    env = run.env()
    assert env["gpus"][0]["name"] == "NVIDIA H200"
    assert env["git"]["commit"].startswith(run.device_commit) and env["git"]["dirty"]
    changed = env["git"]["changed"]
    archives = {p for p in changed if p.startswith("bundles/")}
    assert archives == {f"bundles/{n}/bundle.tar.gz" for n in run.moved}
    code = {p for p in changed if p not in archives and not p.startswith(KIT_DIRS)}
    if not _has_commits(run.commit, run.device_commit):
        pytest.skip(f"this clone lacks commits {run.device_commit} / {run.commit} (shallow)")
    diff = _git("diff", "--name-only", run.device_commit, run.commit).stdout.split()
    assert code == set(diff)


@pytest.mark.parametrize("run", [S5, S6, S7, S8, S9], ids=lambda r: r.name)
def test_device_run_tree_digest_is_the_commit_that_ran(run: DeviceRun) -> None:
    """The tree digest recomputed from a worktree of the commit that ran: the paths tracked at
    the device commit (the device's index), the files added since (untracked there) and the
    device kit files, the moved archives removed. The kit files (``.gpu-wheels``, ``.whl-f1``:
    wheels not kept in git; ``.devrun`` scripts) enter by the sha256 recorded next to the bundle
    (`device-kit-sha256.json`); where a workspace still has them, their bytes must hash to those
    records."""
    env = run.env()
    recorded = json.loads((run.dir / "device-kit-sha256.json").read_text())["sha256"]
    kit = [p for p in env["git"]["changed"] if p.startswith(KIT_DIRS)]
    assert sorted(kit) == sorted(recorded)
    root = BUNDLES.parent
    for rel, digest in recorded.items():
        if (root / rel).is_file():  # this workspace (the CI clone has no kit files)
            with open(root / rel, "rb") as fh:
                assert hashlib.file_digest(fh, "sha256").hexdigest() == digest, rel
    if not _has_commits(run.commit, run.device_commit):
        pytest.skip(f"this clone lacks commits {run.device_commit} / {run.commit} (shallow)")
    added = _git("diff", "--name-only", "--diff-filter=A", run.device_commit,
                 run.commit).stdout.split()
    known = {rel: bytes.fromhex(d) for rel, d in recorded.items()}
    with _worktree(run.commit, run.moved) as t:
        digest = tree_digest(t, _tracked(run.device_commit) + added + kit, known)
    assert digest == env["git"]["tree_digest"]


S11 = BUNDLES / "h200-executor-s11-2026-11-30"
S11_RAN, S11_RESUMED, S11_DEVICE = "98a705a", "70cb1fa", "88f9651"
S11_TAR = "k3run-s11-partial.tar.xz"


def test_h200_session11_bundle_passes_with_the_new_defaults() -> None:
    """Session 11 (device calls 5 and 8): the kernel tier ran the two variants made defaults
    (rolled router rounds, 4-token MLA CTAs): 622 cases PASS, incl. the rolled router against
    the unrolled one and float64, 4-token CTAs against 8-token ones and float64, and the
    executor's whole step bit-equal with each turned off ("0"); perf PASS (12 points, 49 kernels
    per step at b1), proof PASS, isolation NOT_RUN; signed with this session's key."""
    archive = S11 / "bundle.tar.gz"
    kernels = _archive_json(archive, "reports/kernels.json")
    assert kernels["status"] == "PASS" and kernels["failed"] == 0 and kernels["passed"] == 622
    cases = kernels["cases"]
    assert sum(c["op"] == "router" and "rolled" in c["case"] and c["passed"] for c in cases) == 20
    off = {c["case"] for c in cases if c["op"] == "executor_variant" and c["passed"]}
    assert off == {f"{k}=0/r{r}-bitwise" for k in ("K3_DECODE_ROUTER_ROLLED",
                                                     "K3_DECODE_MLA_SMALL_TPC") for r in (1, 2)}
    names = _perf_proof_pass_b1_kernels(archive)
    assert len(names) == 49 and sum("mla_qba" in n for n in names) == 1
    signed = verify_bundle(archive, BUNDLES / "allowed_signers")
    assert signed.principals == ("k3ft-session-2026-11-30-s11",)


def test_h200_session11_bundle_tree_digest_is_the_resumed_commit() -> None:
    """The validate run was cut at 525 s (call 5, tree of 98a705a: kernel tier and 11 of 12 perf
    points) and resumed (call 8, tree of 70cb1fa plus the carried call-5 run folder, the
    untracked `k3run-s11-partial.tar.xz`; `backend/device/runs/` and every bundle file moved
    out for the 64 MiB carry). The device's .git was the session-start commit 88f9651, so the
    bundle names it (dirty); its environment was written by the resumed run. Its changed paths
    are the diff 88f9651..70cb1fa less the moved files plus the tarball, and its tree digest
    is recomputed from a worktree of 70cb1fa. 98a705a and 70cb1fa differ only in
    backend/device/validate.sh, so the code of both calls is the same."""
    env = _archive_json(S11 / "bundle.tar.gz", "environment.json")
    assert env["gpus"][0]["name"] == "NVIDIA H200"
    assert env["git"]["commit"].startswith(S11_DEVICE) and env["git"]["dirty"]
    changed = env["git"]["changed"]
    moved = tuple(p for p in changed if p.startswith("bundles/"))
    assert moved and "bundles/README.md" not in moved
    recorded = json.loads((S11 / "device-kit-sha256.json").read_text())["sha256"]
    assert set(recorded) == {S11_TAR} and S11_TAR in changed
    if not _has_commits(S11_DEVICE, S11_RAN, S11_RESUMED):
        pytest.skip(f"this clone lacks commits {S11_DEVICE} / {S11_RAN} / {S11_RESUMED}")
    assert _git("diff", "--name-only", S11_RAN, S11_RESUMED).stdout.split() == [
        "backend/device/validate.sh"]
    diff = _git("diff", "--name-only", S11_DEVICE, S11_RESUMED).stdout.split()
    code = {p for p in changed if p not in moved and p != S11_TAR}
    assert code == {p for p in diff if not p.startswith("backend/device/runs/")}
    added = [p for p in _git("diff", "--name-only", "--diff-filter=A", S11_DEVICE,
                             S11_RESUMED).stdout.split()
             if not p.startswith("backend/device/runs/")]
    with _worktree(S11_RESUMED, (), moved) as t:
        digest = tree_digest(t, _tracked(S11_DEVICE) + added + [S11_TAR],
                             {S11_TAR: bytes.fromhex(recorded[S11_TAR])})
    assert digest == env["git"]["tree_digest"]


S12 = BUNDLES / "h200-executor-s12-2026-11-30"
S12_RAN, S12_DEVICE = "3f1d29a", "403496e"
S12_TAR = ".resume/run.tar.gz"


def _profile_layers():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "profile_layers", Path(__file__).resolve().parents[1] / "benchmarks/profile_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_h200_session12_bundle_passes_with_dependent_launches() -> None:
    """Session 12 (device calls 4 and 5): programmatic dependent launches on by default. The
    kernel tier (630 cases PASS) ran the executor's whole step with and without them, bit-equal
    over four replays with changing inputs (1 and 4 requests, and the router on a side stream),
    the router (+ front) and `gemv_normed` as dependent launches bit-equal to ordinary ones;
    perf PASS (12 points, 49 kernels per step at b1), proof PASS, isolation NOT_RUN; signed.
    The MLA + MoE layer at b1, 1k: 103.7 us by span (62% of its roofline; the issue's goal,
    65%, is not met), while its kernel-time sum grew to ~119.5 us (dependent kernels start
    early and wait: why the span, not the sum, is the layer's time)."""
    archive = S12 / "bundle.tar.gz"
    kernels = _archive_json(archive, "reports/kernels.json")
    assert kernels["status"] == "PASS" and kernels["failed"] == 0 and kernels["passed"] == 630
    cases = {(c["op"], c["case"]) for c in kernels["cases"] if c["passed"]}
    assert {("executor_pdl", f"tp8-r{r}-side{s}-w20-4-replays-bitwise")
            for r, s in ((1, 0), (4, 0), (1, 1))} <= cases
    assert {("router", f"e896/b{b}/front{f}/pdl/bitwise")
            for b, f in ((1, 5120), (2, 3584), (5, 0))} <= cases
    assert {("gemv", f"normed/7168x3584+768/t{t}/pdl") for t in (1, 2)} <= cases
    names = _perf_proof_pass_b1_kernels(archive)
    assert len(names) == 49
    signed = verify_bundle(archive, BUNDLES / "allowed_signers")
    assert signed.principals == ("k3ft-session-2026-11-30-s11",)
    rows = {r["point"]: r for r in _profile_layers().rows(archive) if r["side"] == "candidate"}
    mla = rows["decode-rand-tp1-d0-acc1-b1-in1024-out16"]["layer3 MLA + MoE"]
    assert 103.0 < mla["span_us"] < 104.5 and 0.61 < mla["of_roofline"] < 0.63
    assert mla["us"] > mla["span_us"] + 10


def test_h200_session12_bundle_tree_digest_is_the_run_commit() -> None:
    """Call 4 ran the tree of 3f1d29a (kernel tier, then cut at 525 s); call 5 resumed it with
    the same tree plus the carried call-4 run folder (`.resume/run.tar.gz`, sha256 recorded);
    `backend/device/runs/` and every bundle archive were moved out for the 64 MiB carry. The
    device's .git was the session-start commit 403496e, so the bundle names it (dirty). Its
    changed paths are the diff 403496e..3f1d29a plus the moved files and the archive, and its
    tree digest is recomputed from a worktree of 3f1d29a less the moved files."""
    env = _archive_json(S12 / "bundle.tar.gz", "environment.json")
    assert env["gpus"][0]["name"] == "NVIDIA H200"
    assert env["git"]["commit"].startswith(S12_DEVICE) and env["git"]["dirty"]
    changed = env["git"]["changed"]
    moved = tuple(p for p in changed
                  if p.startswith(("bundles/", "backend/device/runs/")))
    assert moved and "bundles/README.md" not in moved
    recorded = json.loads((S12 / "device-kit-sha256.json").read_text())["sha256"]
    assert set(recorded) == {S12_TAR} and S12_TAR in changed
    if not _has_commits(S12_DEVICE, S12_RAN):
        pytest.skip(f"this clone lacks commits {S12_DEVICE} / {S12_RAN}")
    diff = set(_git("diff", "--name-only", S12_DEVICE, S12_RAN).stdout.split())
    assert {p for p in changed if p not in moved and p != S12_TAR} == diff
    with _worktree(S12_RAN, (), moved) as t:
        digest = tree_digest(t, _tracked(S12_DEVICE) + [S12_TAR],
                             {S12_TAR: bytes.fromhex(recorded[S12_TAR])})
    assert digest == env["git"]["tree_digest"]


S13 = BUNDLES / "h200-executor-s13-2026-11-30"
S13_RAN, S13_DEVICE = "8acea5f", "82f4bf6"


def test_h200_session13_bundle_fails_one_kernel_count_case() -> None:
    """Session 13 (device call 6, one call: kernel tier 394 s, perf 120 s): the MLA decode's
    session-13 defaults at 1-2 tokens (attention and combine as dependent launches, 32-token fp8
    tiles, the q_a|kv_a|gate GEMV over 2 warps per row) and 4-warp SIMT GEMV CTAs. Verdict
    FAIL, kept as evidence: 688 of 689 cases pass; the one failure is the kernel count with the
    opt-in one-launch MLA decode (``K3_DECODE_MLA_FUSED=1`` with the absorb apart: the new
    defaults kept it from fusing, 12 launches instead of 10; fixed after the run, 4be11ec).
    The new defaults' own cases passed (the chain of dependent launches bit-equal to ordinary
    ones, 32-token tiles against float64, 4- / 2-warp CTAs bit-equal to 8-warp ones, the step
    close to the old order's). Perf and proof PASS. MLA + MoE at b1 1k: 99.6 us by span,
    64.6% of its roofline: still short of the 65% goal (s12: 103.7 us, 62%)."""
    archive = S13 / "bundle.tar.gz"
    assert _archive_json(archive, "verdict.json")["outcome"] == "FAIL"
    kernels = _archive_json(archive, "reports/kernels.json")
    assert kernels["status"] == "FAIL" and (kernels["passed"], kernels["failed"]) == (688, 1)
    (bad,) = [c for c in kernels["cases"] if not c["passed"]]
    assert bad["op"] == "executor_kernels" and bad["case"].startswith(
        "mla_moe_layer qb=1 qba=0 fused=1 spec=12")
    cases = {(c["op"], c["case"]) for c in kernels["cases"] if c["passed"]}
    assert {("mla_chain_pdl", f"mla_chain_pdl/{x}/qba0/bitwise")
            for x in ("t1/q1/bs16/float8_e4m3fn", "t2/q1/bs64/bfloat16")} <= cases
    assert {("mla_decode", f"mma/tile32/b1_ctx1000/h12/{c}") for c in ("fp8", "bf16")} <= cases
    assert {("gemv", f"simt/warps{w}/ksplit{k}/pdl1/n3648/k7168/t1")
            for w, k in ((4, 1), (4, 2), (2, 2))} <= cases
    assert {("executor_variant", "K3_DECODE_MLA_TILE32=0/r1-logits-rel"),
            ("executor_variant", "K3_DECODE_QKV_KSPLIT=1/r2-logits-rel"),
            ("executor_variant", "K3_DECODE_GEMV_WARPS=8/r1-bitwise")} <= cases
    for tier in ("perf", "proof"):
        assert _archive_json(archive, f"reports/{tier}.json")["status"] == "PASS"
    b1 = _archive_json(archive, "decode-rand-tp1-d0-acc1-b1-in1024-out16/profile-candidate.json")
    assert len([e for e in b1["traceEvents"] if str(e.get("cat", "")).lower() == "kernel"]) == 49
    signed = verify_bundle(archive, BUNDLES / "allowed_signers")
    assert signed.principals == ("k3ft-session-2026-11-30-s11",)
    rows = {r["point"]: r for r in _profile_layers().rows(archive) if r["side"] == "candidate"}
    mla = rows["decode-rand-tp1-d0-acc1-b1-in1024-out16"]["layer3 MLA + MoE"]
    assert 99.0 < mla["span_us"] < 100.2 and 0.64 < mla["of_roofline"] < 0.65


def test_h200_session13_bundle_tree_digest_is_the_run_commit() -> None:
    """Call 6 ran the tree of 8acea5f (which lacks bundles/ and backend/device/runs/: they were
    moved out for the carry and 762416e committed them as deleted; 0f0c575 restored them). The
    device's .git was the session-start commit 82f4bf6, so the bundle names it (dirty); its
    changed paths are exactly the diff 82f4bf6..8acea5f and its tree digest is recomputed from
    a worktree of 8acea5f (no carried archive this time)."""
    env = _archive_json(S13 / "bundle.tar.gz", "environment.json")
    assert env["gpus"][0]["name"] == "NVIDIA H200"
    assert env["git"]["commit"].startswith(S13_DEVICE) and env["git"]["dirty"]
    changed = set(env["git"]["changed"])
    assert any(p.startswith("bundles/") for p in changed)  # the moved (deleted) archives
    if not _has_commits(S13_DEVICE, S13_RAN):
        pytest.skip(f"this clone lacks commits {S13_DEVICE} / {S13_RAN}")
    assert changed == set(_git("diff", "--name-only", S13_DEVICE, S13_RAN).stdout.split())
    added = _git("diff", "--name-only", "--diff-filter=A", S13_DEVICE, S13_RAN).stdout.split()
    with _worktree(S13_RAN, ()) as t:
        digest = tree_digest(t, _tracked(S13_DEVICE) + added)
    assert digest == env["git"]["tree_digest"]


S14 = BUNDLES / "h200-executor-s14-2026-12-01"
S14_RAN, S14_DEVICE = "d951874", "fc51149"


def test_h200_session14_bundle_meets_the_roofline_goal_by_a_hair() -> None:
    """Session 14 (device call 5, one call: kernel tier 431 s, perf 128 s): the AttnRes with
    every load at once as the default (``K3_DECODE_ATTNRES_EARLY``, same bits), on top of
    session 13's defaults with the fused-opt-in fix and the 2048-token context limit for the
    1-2-token MLA settings. Kernels PASS (699 cases, incl. the early AttnRes bit-equal to the
    plain kernel and the fixed kernel counts), perf and proof PASS, isolation NOT_RUN
    (INCOMPLETE). MLA + MoE at b1 1k: 98.9 us by span = 65.05% of its roofline, just over the
    65% goal (the in-session A/B medians of the same settings: 98.3 us); at 32k back to
    121.0 us (s13: 125.0) under the context limit."""
    archive = S14 / "bundle.tar.gz"
    assert _archive_json(archive, "verdict.json")["outcome"] == "INCOMPLETE"
    kernels = _archive_json(archive, "reports/kernels.json")
    assert kernels["status"] == "PASS" and (kernels["passed"], kernels["failed"]) == (699, 0)
    cases = {(c["op"], c["case"]) for c in kernels["cases"]}
    assert {("attn_res_norm", f"{c}/early") for c in (
        "t1/nb1/d1/w-1/on1/pdl0", "t1/nb1/d1/w-1/on1/pdl1", "t64/nb3/d1/w-1/on1/pdl0")} <= cases
    assert ("executor_variant", "K3_DECODE_ATTNRES_EARLY=0/r1-bitwise") in cases
    assert any(op == "executor_kernels" and c.startswith("mla_moe_layer qb=1 qba=0 fused=1")
               for op, c in cases)
    for tier in ("perf", "proof"):
        assert _archive_json(archive, f"reports/{tier}.json")["status"] == "PASS"
    assert _archive_json(archive, "reports/isolation.json")["status"] == "NOT_RUN"
    signed = verify_bundle(archive, BUNDLES / "allowed_signers")
    assert signed.principals == ("k3ft-session-2026-11-30-s11",)
    rows = {r["point"]: r for r in _profile_layers().rows(archive) if r["side"] == "candidate"}
    b1 = rows["decode-rand-tp1-d0-acc1-b1-in1024-out16"]
    mla = b1["layer3 MLA + MoE"]
    assert 98.8 < mla["span_us"] < 98.99 and 0.650 <= mla["of_roofline"] < 0.651
    assert mla["kernels"] == 11 and b1["layer1 KDA + MoE"]["kernels"] == 9
    assert all(b1[f"layer{i} KDA + MoE"]["of_roofline"] > 0.69 for i in (1, 2, 4))
    assert 120.5 < rows["decode-rand-tp1-d0-acc1-b1-in32768-out16"]["layer3 MLA + MoE"][
        "span_us"] < 121.5


def test_h200_session14_bundle_tree_digest_is_the_run_commit() -> None:
    """Call 5 ran the tree of d951874 with bundles/*/ and backend/device/runs/ moved out for the
    64 MiB carry (nothing committed while they were out); the device's .git was the
    session-start commit fc51149, so the bundle names it (dirty). Its changed paths are the
    diff fc51149..d951874 plus the moved files, and its tree digest is recomputed from a
    worktree of d951874 less those files."""
    env = _archive_json(S14 / "bundle.tar.gz", "environment.json")
    assert env["gpus"][0]["name"] == "NVIDIA H200"
    assert env["git"]["commit"].startswith(S14_DEVICE) and env["git"]["dirty"]
    changed = env["git"]["changed"]
    moved = tuple(p for p in changed if p.startswith(("bundles/", "backend/device/runs/")))
    assert moved and "bundles/README.md" not in moved
    if not _has_commits(S14_DEVICE, S14_RAN):
        pytest.skip(f"this clone lacks commits {S14_DEVICE} / {S14_RAN}")
    diff = set(_git("diff", "--name-only", S14_DEVICE, S14_RAN).stdout.split())
    assert {p for p in changed if p not in moved} == diff
    with _worktree(S14_RAN, (), moved) as t:
        digest = tree_digest(t, _tracked(S14_DEVICE))
    assert digest == env["git"]["tree_digest"]
