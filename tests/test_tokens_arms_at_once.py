"""On a pair whose servers have disjoint cores the tokens tier sends B1 and C at the same time,
then B2; otherwise the arms run one after another. Stub HTTP servers stand in for vLLM (greedy
tokens derived from the prompt, Prometheus counters per server), so these tests run in seconds.
"""

from __future__ import annotations

import _thread
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from serving_support import demo_profile, make_ctx

from k3fasttrack.errors import InfrastructureError
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.tokens import TokensReport
from k3fasttrack.runtime.context import TierContext
from k3fasttrack.serving import Server, ServerPair
from k3fasttrack.tiers.proof.signals import judge_counters, parse_evidence
from k3fasttrack.tiers.tokens import SPEC
from k3fasttrack.tiers.tokens import tier as tokens_tier

PROMPTS = 8
MAX_TOKENS = 4
ISOLATED = {"baseline": (0,), "candidate": (1,)}


class Stub:
    """A fake vLLM server: ``/health``, ``/v1/models``, ``/version``, ``/metrics``,
    ``/tokenize`` and greedy ``/v1/completions``; it counts generated tokens and requests (and,
    as a speculating candidate, drafts)."""

    def __init__(self, *, speculates: bool) -> None:
        self.speculates = speculates
        self.lock = threading.Lock()
        self.generated = self.requests = 0
        self.delay_s = 0.05
        self.fail = False
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: str, kind: str = "application/json") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                if self.path == "/health":
                    self._send(200, "{}")
                elif self.path == "/v1/models":
                    self._send(200, json.dumps({"data": [{"id": "stub", "max_model_len": 2048}]}))
                elif self.path == "/version":
                    self._send(200, json.dumps({"version": "stub"}))
                elif self.path == "/metrics":
                    self._send(200, stub.metrics_text(), "text/plain")
                else:
                    self._send(404, "{}")

            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    text = body["messages"][0]["content"]
                    self._send(200, json.dumps({"tokens": [ord(ch) for ch in text[:12]]}))
                elif self.path == "/v1/completions":
                    time.sleep(stub.delay_s)
                    if stub.fail:
                        self._send(500, json.dumps({"error": "stub failure"}))
                    else:
                        self._send(200, json.dumps(stub.complete(body)))
                else:
                    self._send(404, "{}")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt, n, k = body["prompt"], body["max_tokens"], body["logprobs"]
        tokens = [(sum(prompt) + 7 * j) % 5000 for j in range(n)]
        tops = [{f"token_id:{t + i}": -0.01 - 2.0 * i for i in range(k)} for t in tokens]
        with self.lock:
            self.generated += n
            self.requests += 1
        return {"choices": [{"token_ids": tokens, "prompt_token_ids": prompt,
                             "logprobs": {"top_logprobs": tops}, "finish_reason": "length"}]}

    def metrics_text(self) -> str:
        with self.lock:
            lines = [f'vllm:generation_tokens_total{{model_name="stub"}} {self.generated}',
                     f'vllm:request_success_total{{model_name="stub"}} {self.requests}']
            if self.speculates:
                lines += [f"vllm:spec_decode_num_drafts_total {self.generated}",
                          f"vllm:spec_decode_num_draft_tokens_total {2 * self.generated}",
                          f"vllm:spec_decode_num_accepted_tokens_total {self.generated}"]
        return "\n".join(lines) + "\n"

    def server(self, side: str) -> Server:
        return Server(side=side, url=self.url, model_name="stub",  # type: ignore[arg-type]
                      request_timeout_s=30.0)


@pytest.fixture
def stubs() -> Iterator[dict[str, Stub]]:
    made = {"baseline": Stub(speculates=False), "candidate": Stub(speculates=True),
            "restarted": Stub(speculates=False)}
    yield made
    for stub in made.values():
        stub.httpd.shutdown()
        stub.httpd.server_close()


@pytest.fixture
def datasets(tmp_path: Path) -> Path:
    folder = tmp_path / "datasets"
    (folder / "gsm8k").mkdir(parents=True)
    rows = [json.dumps({"question": f"question number {i}: how many?"}) for i in range(20)]
    (folder / "gsm8k" / "test.jsonl").write_text("\n".join(rows) + "\n")
    return folder


class Spans:
    """The tier's ``run_arm`` wrapped: when each arm started and ended (monotonic seconds)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.spans: dict[str, tuple[float, float]] = {}
        self.calls: list[str] = []
        self.before: dict[str, Any] = {}
        real = tokens_tier.run_arm

        def wrapped(server: Server, arm: str, *args: Any, **kw: Any) -> Any:
            self.calls.append(arm)
            start = time.monotonic()
            hook = self.before.get(arm)
            if hook is not None:
                hook()
            try:
                return real(server, arm, *args, **kw)  # type: ignore[arg-type]
            finally:
                self.spans[arm] = (start, time.monotonic())

        monkeypatch.setattr(tokens_tier, "run_arm", wrapped)

    def overlap(self, a: str, b: str) -> bool:
        (s1, e1), (s2, e2) = self.spans[a], self.spans[b]
        return s1 < e2 and s2 < e1

    def after(self, later: str, *earlier: str) -> bool:
        return all(self.spans[later][0] >= self.spans[e][1] for e in earlier)


def profile(**tokens: Any) -> Profile:
    prof = demo_profile()
    cfg = prof.tokens.model_copy(update={"prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                                         "top_logprobs": 3, "b1_concurrency": 4,
                                         "b2_concurrency": 2, "c_concurrency": 4, **tokens})
    return prof.model_copy(update={"tokens": cfg, "tiers": ("tokens",)})


def pair_of(stubs: dict[str, Stub], *, mode: str = "started",
            placement: dict[str, tuple[int, ...]] | None = None) -> ServerPair:
    return ServerPair(baseline=stubs["baseline"].server("baseline"),
                      candidate=stubs["candidate"].server("candidate"), switch_args=(),
                      mode=mode, placement=ISOLATED if placement is None else placement)


def context(bundle: Path, pair: ServerPair, datasets: Path, prof: Profile | None = None,
            resume: bool = False) -> TierContext:
    prof = prof or profile()
    options = {"datasets": str(datasets)}
    ctx = make_ctx(bundle, profile=prof, cells=tuple(SPEC.plan_cells(prof, 1, options)),
                   services={"servers": pair}, resume=resume)
    ctx.options = options
    return ctx


@pytest.fixture
def run_tier(stubs: dict[str, Stub], datasets: Path, monkeypatch: pytest.MonkeyPatch,
             tmp_path: Path) -> Any:
    """``run_tier(bundle name, pair, ...) -> (report, ctx)``; B2's restarted baseline is the
    third stub."""
    monkeypatch.setattr(tokens_tier, "start_restarted_baseline",
                        lambda *a, **kw: stubs["restarted"].server("baseline"))

    def go(name: str, pair: ServerPair, *, prof: Profile | None = None,
           resume: bool = False) -> tuple[TokensReport, TierContext]:
        ctx = context(tmp_path / name / "bundle", pair, datasets, prof, resume)
        report = SPEC.run(ctx)
        assert isinstance(report, TokensReport)
        return report, ctx
    return go


def _tier_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t.name.startswith("k3ft-tokens-") and t.is_alive()]


def test_isolated_sides_run_b1_and_c_at_once_then_b2(stubs, run_tier, monkeypatch) -> None:
    spans = Spans(monkeypatch)
    report, ctx = run_tier("iso", pair_of(stubs))
    assert [a.arm for a in report.arms] == ["b1", "b2", "c"] and not report.failure
    assert spans.overlap("b1", "c"), spans.spans
    assert spans.after("b2", "b1", "c"), spans.spans
    assert report.b2_method.endswith(
        "B1 and C ran at the same time, each on its own server pinned to its own cores "
        "(baseline 0; candidate 1), so their wall times overlap; B2 ran after both")
    notes = ctx.progress.notes  # type: ignore[attr-defined]
    assert any(n.startswith("tokens: arm c on the candidate server, alongside arm b1 on the "
                            "baseline server") for n in notes), notes
    assert not _tier_threads()


@pytest.mark.parametrize("mode, placement", [
    ("started", {}),  # one core, or VLLM_CPU_OMP_THREADS_BIND set by the user
    ("attached", ISOLATED),
    ("started", {"baseline": (0, 1), "candidate": (1,)}),
], ids=["unpinned", "attached", "shared-core"])
def test_sides_that_are_not_isolated_run_the_arms_in_order(stubs, run_tier, monkeypatch, mode,
                                                           placement) -> None:
    spans = Spans(monkeypatch)
    report, _ = run_tier("seq", pair_of(stubs, mode=mode, placement=placement))
    assert [a.arm for a in report.arms] == ["b1", "b2", "c"] and not report.failure
    assert spans.after("b2", "b1") and spans.after("c", "b2"), spans.spans
    assert "at the same time" not in report.b2_method


def test_the_report_at_once_holds_what_the_arms_in_order_give(stubs, run_tier, tmp_path) -> None:
    at_once, _ = run_tier("iso", pair_of(stubs))
    in_order, _ = run_tier("seq", pair_of(stubs, placement={}))
    for rel in ("tokens/prompts.jsonl", "tokens/b1.jsonl", "tokens/b2.jsonl", "tokens/c.jsonl"):
        assert (tmp_path / "iso/bundle" / rel).read_bytes() == \
            (tmp_path / "seq/bundle" / rel).read_bytes(), rel

    def content(r: TokensReport) -> dict[str, Any]:
        out = r.model_dump(mode="json", exclude={"b2_method", "path_evidence"})
        for arm in out["arms"]:  # times: each arm's own, measured
            assert arm.pop("wall_s") > 0
            assert (arm.pop("server_start_s") is None) == (arm["arm"] != "b2")
        return out
    assert content(at_once) == content(in_order)
    assert at_once.b2_method.startswith(in_order.b2_method + ". B1 and C ran at the same time")

    # Each window at once reads only its arm's server; in order the idle server grew by zero.
    assert [e["cell"] for e in at_once.path_evidence] == ["tokens-b1", "tokens-c"]
    for seq, iso in zip(in_order.path_evidence, at_once.path_evidence, strict=True):
        own, idle = ("baseline", "candidate") if seq["side"] == "baseline" else \
            ("candidate", "baseline")
        assert set(iso["deltas"]) == {own} and set(iso["missing"]) == {own}
        assert not any(seq["deltas"][idle].values())
        assert iso["deltas"][own] == seq["deltas"][own]
        assert iso["missing"][own] == seq["missing"][own]
    c_window = at_once.path_evidence[1]["deltas"]["candidate"]
    assert c_window["vllm:request_success_total"] == PROMPTS
    assert c_window["vllm:generation_tokens_total"] == PROMPTS * MAX_TOKENS
    # the proof tier sums the same growth on each side from either set of windows
    verdicts = [judge_counters(parse_evidence(r.path_evidence)) for r in (at_once, in_order)]
    assert verdicts[0] == verdicts[1] and verdicts[0][0], verdicts


def test_a_failed_arm_at_once_surfaces_and_resume_reruns_only_it(stubs, run_tier,
                                                                 monkeypatch) -> None:
    stubs["baseline"].fail = True
    first = Spans(monkeypatch)
    report, ctx = run_tier("fail", pair_of(stubs))
    assert sorted(first.calls) == ["b1", "c"]  # each once; B2 never starts
    assert report.status == "INCOMPLETE"
    assert "baseline server answered POST /v1/completions with 500" in report.failure
    assert report.reason.startswith("1 of 3 arm(s) done")
    assert [a.arm for a in report.arms] == ["c"]  # C finished on its own server: kept
    assert ctx.store.is_done("tokens-c") and not ctx.store.is_done("tokens-b1")
    assert ctx.store.interrupted() == ["tokens-b1"] and not ctx.store.is_done("tokens-b2")
    assert not _tier_threads()

    stubs["baseline"].fail = False
    spans = Spans(monkeypatch)
    again, ctx = run_tier("fail", pair_of(stubs), resume=True)
    assert [a.arm for a in again.arms] == ["b1", "b2", "c"] and not again.failure
    assert spans.calls == ["b1", "b2"] and spans.after("b2", "b1")
    assert "tokens-c: done earlier, skipped" in ctx.progress.notes  # type: ignore[attr-defined]
    assert "at the same time" not in again.b2_method  # C's rows come from an earlier attempt


def test_when_both_arms_at_once_fail_b1s_error_is_the_one_reported(stubs, run_tier) -> None:
    stubs["baseline"].fail = stubs["candidate"].fail = True
    report, ctx = run_tier("both", pair_of(stubs))
    assert report.failure.startswith("baseline server answered"), report.failure
    assert not report.arms and ctx.store.interrupted() == ["tokens-b1", "tokens-c"]
    assert not _tier_threads()


def test_an_internal_error_in_an_arm_at_once_propagates(stubs, run_tier, monkeypatch) -> None:
    spans = Spans(monkeypatch)

    def broken() -> None:
        raise RuntimeError("a bug in arm c")
    spans.before["c"] = broken
    with pytest.raises(RuntimeError, match="a bug in arm c"):
        run_tier("bug", pair_of(stubs))
    assert sorted(spans.calls) == ["b1", "c"]  # raised once, after B1 ended
    assert "b1" in spans.spans and not _tier_threads()


def test_ctrl_c_while_the_arms_run_at_once_stops_the_tier_at_once(stubs, run_tier,
                                                                  monkeypatch) -> None:
    spans = Spans(monkeypatch)
    release = threading.Event()

    def stuck() -> None:  # a long request that ends when the run's servers stop
        release.wait(10)
        raise InfrastructureError("servers stopped")

    def interrupt() -> None:
        _thread.interrupt_main()
        stuck()
    spans.before.update(b1=stuck, c=interrupt)
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_tier("ctrl-c", pair_of(stubs))
        assert time.monotonic() - start < 3.0
        assert {t.name for t in _tier_threads()} == {"k3ft-tokens-b1", "k3ft-tokens-c"}
        assert all(t.daemon for t in _tier_threads())  # they never hold the process at exit
    finally:
        release.set()
    for t in _tier_threads():
        t.join(5)
    assert not _tier_threads()


def test_the_watchdog_stops_both_arms_at_once(stubs, run_tier) -> None:
    for stub in stubs.values():
        stub.delay_s = 10.0
    pair = pair_of(stubs)
    start = time.monotonic()
    report, ctx = run_tier("late", pair, prof=profile(tier_timeout_s=2.0))
    assert time.monotonic() - start < 6.0
    assert report.failure and not report.arms, report.failure
    assert ctx.store.interrupted() == ["tokens-b1", "tokens-c"]
    assert pair.baseline.watchdog is None and pair.candidate.watchdog is None
    assert not _tier_threads()
