"""Agentic multi-turn workload: seeded coding-agent-like sessions, replayed with streaming.

A session is a growing conversation: a long system prompt (shared prefix, so KV-cache reuse
matters), then turns of user/tool text, each answered by the model, with a tool pause between
turns. Sub-sessions fork from a parent's conversation after a turn and run in parallel with it.
A trace file in the same schema (JSONL, one ``AgentSession`` per line) replays real traffic.
Our own small async client streams ``/v1/chat/completions`` to see TTFT and every token gap.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import httpx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from k3fasttrack.errors import InfrastructureError, UsageError
from k3fasttrack.tiers.perf import workloads
from k3fasttrack.tiers.perf.grid import AgenticSpec

AGENTIC_METRICS: dict[str, tuple[str, bool]] = {
    "agentic_interactivity_p90_tok_s_user": ("tokens/s/user", True),
    "agentic_interactivity_median_tok_s_user": ("tokens/s/user", True),
    "agentic_ttft_ms_median": ("ms", False),
    "agentic_ttft_ms_p90": ("ms", False),
    "agentic_output_tok_s": ("tokens/s", True),
    "agentic_session_s_median": ("s", False),
}


class Turn(BaseModel):
    """One user/tool message and the answer budget."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    content: str
    max_tokens: int = Field(ge=1)
    pause_s: Annotated[float, Field(ge=0)] = 0.0
    """Tool pause before this turn is sent (simulated tool execution)."""


class AgentSession(BaseModel):
    """One session of the trace schema."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    session_id: str
    system: str
    turns: tuple[Turn, ...] = Field(min_length=1)
    parent: str | None = None
    fork_after: int = 0
    """A sub-session starts from its parent's conversation after this many turns."""


def _chunk(docs: list[str], rng: random.Random, words: int) -> str:
    out: list[str] = []
    while len(out) < words:
        out += docs[rng.randrange(len(docs))].split()
    return " ".join(out[:words])


def generate_sessions(spec: AgenticSpec, root: Path | None = None) -> list[AgentSession]:
    """Seeded sessions from real text (GSM8k worked problems as files/tool output)."""
    _, docs, _ = workloads.real_text_sources(root)
    rng = random.Random(spec.seed)
    words = lambda tokens: max(1, int(tokens * 0.75))
    sessions: list[AgentSession] = []
    for s in range(spec.sessions):
        system = "You are a coding agent. Repository notes:\n" + _chunk(
            docs, rng, words(spec.system_tokens)
        )
        turns = tuple(
            Turn(
                content=("Tool output:\n" if t else "Task:\n")
                + _chunk(docs, rng, words(spec.turn_tokens)),
                max_tokens=spec.output_tokens,
                pause_s=spec.tool_pause_s if t else 0.0,
            )
            for t in range(spec.turns)
        )
        sessions.append(AgentSession(session_id=f"s{s}", system=system, turns=turns))
        for k in range(spec.subagents):
            sub = tuple(
                Turn(
                    content="Sub-task:\n" + _chunk(docs, rng, words(spec.turn_tokens)),
                    max_tokens=spec.output_tokens,
                )
                for _ in range(max(1, spec.turns - 1))
            )
            sessions.append(
                AgentSession(
                    session_id=f"s{s}.{k}", system=system, turns=sub, parent=f"s{s}", fork_after=1
                )
            )
    return sessions


def load_trace(path: Path) -> list[AgentSession]:
    """A trace file: JSONL of ``AgentSession``; errors name the line."""
    out: list[AgentSession] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(AgentSession.model_validate_json(line))
        except ValueError as exc:
            raise UsageError(
                f"{path}:{n}: not an AgentSession ({str(exc).splitlines()[0]})"
            ) from None
    if not out:
        raise UsageError(f"{path}: trace has no sessions")
    return out


def sessions_sha256(sessions: Sequence[AgentSession]) -> str:
    """Digest of the workload (canonical JSON of every session)."""
    blob = json.dumps([s.model_dump(mode="json") for s in sessions], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


async def _stream(
    client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]], max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    stamps: list[float] = []
    text, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise InfrastructureError(f"{url}: chat request failed with {resp.status_code}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"].get("completion_tokens", 0))
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    stamps.append(time.perf_counter())
                    text.append(delta)
    end = time.perf_counter()
    ttft = (stamps[0] - start) if stamps else end - start
    return {"ttft": ttft, "e2e": end - start, "tokens": tokens, "text": "".join(text)}


async def _run_session(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    session: AgentSession,
    history: list[dict[str, str]],
    children: dict[str, list[AgentSession]],
    records: list[dict[str, Any]],
) -> None:
    messages = history or [{"role": "system", "content": session.system}]
    subtasks: list[asyncio.Task[None]] = []
    start = time.perf_counter()
    for t, turn in enumerate(session.turns):
        if t and turn.pause_s:
            await asyncio.sleep(turn.pause_s)
        messages = [*messages, {"role": "user", "content": turn.content}]
        rec = await _stream(client, url, model, messages, turn.max_tokens)
        rec.update(session=session.session_id, turn=t)
        records.append(rec)
        messages = [*messages, {"role": "assistant", "content": rec["text"]}]
        for child in children.get(session.session_id, []):
            if child.fork_after == t + 1:
                subtasks.append(
                    asyncio.create_task(
                        _run_session(client, url, model, child, list(messages), children, records)
                    )
                )
    await asyncio.gather(*subtasks)
    records.append({"session": session.session_id, "session_s": time.perf_counter() - start})


async def replay(
    url: str,
    model: str,
    sessions: Sequence[AgentSession],
    concurrency: int,
    timeout_s: float = 600.0,
) -> tuple[list[dict[str, Any]], float]:
    """Run every top-level session (at most ``concurrency`` at once); (records, wall seconds)."""
    children: dict[str, list[AgentSession]] = {}
    for s in sessions:
        if s.parent is not None:
            children.setdefault(s.parent, []).append(s)
    sem = asyncio.Semaphore(concurrency)
    records: list[dict[str, Any]] = []

    async def one(client: httpx.AsyncClient, s: AgentSession) -> None:
        async with sem:
            await _run_session(client, url, model, s, [], children, records)

    start = time.perf_counter()
    limits = httpx.Limits(max_connections=max(8, 4 * concurrency))
    try:
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            await asyncio.gather(*(one(client, s) for s in sessions if s.parent is None))
    except httpx.HTTPError as exc:
        raise InfrastructureError(f"agentic replay against {url} failed: {exc!r}") from exc
    return records, time.perf_counter() - start


def agentic_metrics(records: Sequence[dict[str, Any]], wall_s: float) -> dict[str, float]:
    """Per repeat: P90 and median interactivity ((tokens - 1) / (e2e - ttft) per request), TTFT, throughput."""
    reqs = [r for r in records if "ttft" in r]
    rates = [
        (r["tokens"] - 1) / (r["e2e"] - r["ttft"])
        for r in reqs
        if r["tokens"] > 1 and r["e2e"] > r["ttft"]
    ]
    sess = [r["session_s"] for r in records if "session_s" in r]
    out: dict[str, float] = {}
    if rates:
        out["agentic_interactivity_p90_tok_s_user"] = float(np.percentile(rates, 10))
        out["agentic_interactivity_median_tok_s_user"] = float(np.median(rates))
    if reqs:
        ttfts = [r["ttft"] * 1000 for r in reqs]
        out["agentic_ttft_ms_median"] = float(np.median(ttfts))
        out["agentic_ttft_ms_p90"] = float(np.percentile(ttfts, 90))
        out["agentic_output_tok_s"] = sum(r["tokens"] for r in reqs) / wall_s
    if sess:
        out["agentic_session_s_median"] = float(np.median(sess))
    return out


def measure_agentic(
    name: str,
    spec: AgenticSpec,
    concurrency: int,
    sessions: Sequence[AgentSession],
    urls: dict[str, str],
    model: str,
    bundle_dir: Path,
    source: str,
) -> dict[str, Any]:
    """Warm-up (one session per side), then ``spec.repeats`` rounds A B A B; the cell result."""
    for side in ("baseline", "candidate"):
        asyncio.run(replay(urls[side], model, sessions[:1], 1))
    sides: dict[str, dict[str, Any]] = {"baseline": {"repeats": []}, "candidate": {"repeats": []}}
    for r in range(spec.repeats):
        for side in ("baseline", "candidate"):
            records, wall = asyncio.run(replay(urls[side], model, sessions, concurrency))
            rel = f"perf/raw/{name}/{side}-r{r}.json"
            (bundle_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (bundle_dir / rel).write_text(
                json.dumps({"wall_s": wall, "records": records}, sort_keys=True)
            )
            sides[side]["repeats"].append(
                {"repeat": r, "raw": rel, "metrics": agentic_metrics(records, wall)}
            )
    return {
        "point": name,
        "concurrency": concurrency,
        "sessions": len(sessions),
        "trace_sha256": sessions_sha256(sessions),
        "source": source,
        "sides": sides,
    }
