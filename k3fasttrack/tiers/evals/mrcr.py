"""MRCR (multi-round co-reference): seeded data in the official format, and its grading rule.

Official rows (``openai/mrcr`` parquet) carry ``prompt`` (a JSON list of chat messages),
``answer``, ``random_string_to_prepend``, ``n_needles``, ``desired_msg_index``,
``total_messages`` and ``n_chars``. The generator writes rows of the same shape: a long chat in
which the user asks for many short pieces of writing (``a riddle about lighthouses``), one ask
repeated ``n_needles`` times with different replies, and a final request to reproduce the k-th
of those replies prefixed by a random string. Grading follows MRCR's rule: the response must
start with that string; the score is the ``difflib.SequenceMatcher`` ratio of the remainder
against the target reply.
"""

from __future__ import annotations

import difflib
import json
import random
import string
from pathlib import Path
from typing import Any

from k3fasttrack.errors import UsageError

CHARS_PER_TOKEN = 4.0
"""Rough characters per token of the word salad (the truncation guard counts exactly)."""

FORMATS = ("poem", "riddle", "short story", "haiku", "limerick", "recipe", "letter", "song")
TOPICS = (
    "lighthouses",
    "tapirs",
    "copper mines",
    "glaciers",
    "paper kites",
    "subway maps",
    "owls",
    "tide pools",
    "sourdough",
    "comets",
    "abacuses",
    "moss",
    "old bridges",
    "typewriters",
    "desert rain",
    "chess clocks",
    "lanterns",
    "beekeeping",
    "river ferries",
    "snow tires",
)
WORDS = (
    "amber",
    "quiet",
    "river",
    "stone",
    "window",
    "morning",
    "silver",
    "harbor",
    "lantern",
    "velvet",
    "orchard",
    "meadow",
    "hollow",
    "thunder",
    "bright",
    "gentle",
    "distant",
    "winter",
    "garden",
    "shadow",
    "candle",
    "mirror",
    "journey",
    "whisper",
    "copper",
    "feather",
    "ember",
    "marble",
    "willow",
    "canyon",
    "signal",
    "ribbon",
    "compass",
    "harvest",
    "drift",
    "echo",
    "glass",
    "north",
    "salt",
    "thread",
    "clock",
    "bridge",
    "cloud",
    "valley",
    "field",
    "paper",
    "light",
    "small",
    "old",
    "slow",
    "green",
    "blue",
    "red",
    "open",
    "hidden",
    "round",
    "tall",
    "narrow",
    "warm",
    "cold",
    "late",
    "early",
    "soft",
    "loud",
    "far",
    "near",
    "under",
    "over",
    "across",
)


def ordinal(k: int) -> str:
    """1 -> ``1st``, 2 -> ``2nd``, 11 -> ``11th``."""
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def grade(response: str, answer: str, random_string_to_prepend: str) -> float:
    """MRCR's rule: 0 unless ``response`` starts with the string; else the SequenceMatcher ratio
    of the rest of the response against the rest of the answer."""
    if not response.startswith(random_string_to_prepend):
        return 0.0
    rest = response.removeprefix(random_string_to_prepend)
    target = answer.removeprefix(random_string_to_prepend)
    return float(difflib.SequenceMatcher(None, rest, target).ratio())


def _reply(rng: random.Random, fmt: str, topic: str) -> str:
    """A deterministic pseudo-text reply of a few short lines."""
    lines = []
    for _ in range(rng.randint(3, 5)):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 8))]
        lines.append(" ".join(words).capitalize())
    return f"A {fmt} about {topic}:\n" + "\n".join(lines)


def _ask(fmt: str, topic: str) -> str:
    return f"Write a {fmt} about {topic}."


def generate_row(seed: int, context_tokens: int, n_needles: int = 2) -> dict[str, Any]:
    """One MRCR-format row whose prompt is about ``context_tokens`` tokens long."""
    rng = random.Random(seed)
    needle = (rng.choice(FORMATS), rng.choice(TOPICS))
    others = [(f, t) for f in FORMATS for t in TOPICS if (f, t) != needle]
    target_chars = int(context_tokens * CHARS_PER_TOKEN)
    turns: list[tuple[str, str]] = []
    size = 0
    while size < target_chars or len(turns) < n_needles + 1:
        pair = rng.choice(others)
        turns.append(pair)
        size += len(_ask(*pair)) + 180
    slots = sorted(rng.sample(range(len(turns)), n_needles))
    for s in slots:
        turns[s] = needle
    messages: list[dict[str, str]] = []
    needle_msg_idx: list[int] = []
    for i, (fmt, topic) in enumerate(turns):
        messages.append({"role": "user", "content": _ask(fmt, topic)})
        if i in slots:
            needle_msg_idx.append(len(messages))
        messages.append({"role": "assistant", "content": _reply(rng, fmt, topic)})
    k = rng.randint(1, n_needles)
    prefix = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(10))
    fmt, topic = needle
    messages.append(
        {
            "role": "user",
            "content": f"Prepend {prefix} to the {ordinal(k)} (1 indexed) {fmt} about {topic}. "
            "Do not include any other text in your response.",
        }
    )
    desired = needle_msg_idx[k - 1]
    return {
        "prompt": json.dumps(messages, ensure_ascii=False),
        "answer": prefix + messages[desired]["content"],
        "random_string_to_prepend": prefix,
        "n_needles": n_needles,
        "desired_msg_index": desired,
        "total_messages": len(messages),
        "n_chars": sum(len(m["content"]) for m in messages),
    }


def generate(
    n: int, *, seed: int, context_tokens: tuple[int, ...], n_needles: int = 2
) -> list[dict[str, Any]]:
    """``n`` rows; row i targets ``context_tokens[i % len]`` tokens, seed ``seed*100003+i``."""
    if not context_tokens:
        raise UsageError("MRCR: context_tokens must name at least one size")
    return [
        generate_row(seed * 100_003 + i, context_tokens[i % len(context_tokens)], n_needles)
        for i in range(n)
    ]


def parquet_files(folder: Path, n_needles: int) -> list[Path]:
    """The official ``{n}needle*.parquet`` files under ``folder``, sorted (the files
    ``read_parquet`` reads, and whose digests the report records)."""
    return sorted(folder.rglob(f"{n_needles}needle*.parquet"))


def read_parquet(folder: Path, *, n_needles: int, max_chars: int | None) -> list[dict[str, Any]]:
    """Rows of the official ``{n}needle/*.parquet`` files under ``folder`` (sorted by file name)."""
    import pyarrow.parquet as pq

    if not folder.is_dir():
        raise UsageError(f"MRCR folder not found: {folder} (give --mrcr-dir or K3FT_MRCR_DIR)")
    files = parquet_files(folder, n_needles)
    if not files:
        raise UsageError(f"MRCR folder {folder}: no {n_needles}needle*.parquet files")
    rows: list[dict[str, Any]] = []
    for f in files:
        rows.extend(pq.read_table(f).to_pylist())
    if max_chars is not None:
        rows = [r for r in rows if int(r["n_chars"]) <= max_chars]
    return rows


def messages_of(doc: dict[str, Any]) -> list[dict[str, str]]:
    """The chat messages of one row."""
    prompt = doc["prompt"]
    return json.loads(prompt) if isinstance(prompt, str) else list(prompt)


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` hook: the MRCR grade of the first response."""
    return {"score": grade(results[0], doc["answer"], doc["random_string_to_prepend"])}
