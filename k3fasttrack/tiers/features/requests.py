"""The requests of the features tier: each feature sends its requests and returns raw rows."""

from __future__ import annotations

from typing import Any

from k3fasttrack.errors import InfrastructureError
from k3fasttrack.models.features import FeaturesConfig
from k3fasttrack.serving.runner import ServerPair
from k3fasttrack.serving.server import Server, Side
from k3fasttrack.serving.sides import on_both_sides

Row = dict[str, Any]

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
"""The schema of the structured-output check (bounded strings so a small model cannot ramble)."""

FILLER = ("The archive kept every letter the lighthouse keeper wrote, one page for each storm, "
          "numbered and bound in blue thread. ")


def _chat(server: Server, content: str, **extra: Any) -> dict[str, Any]:
    payload = {"model": server.model_name, "messages": [{"role": "user", "content": content}]}
    return server.post_json("/v1/chat/completions", payload | extra)


def sampling_rows(pair: ServerPair, cfg: FeaturesConfig) -> list[Row]:
    """Seeded samples on both sides (same seeds), plus one repeated seed on the candidate; the
    baseline's rows first. The two sides send their requests at once when the pair's servers
    run on disjoint cores (``ServerPair.sides_isolated``), one after the other otherwise."""
    seeds = [cfg.sampling_seed + i for i in range(cfg.sampling_samples)]

    def side_rows(side: Side) -> list[Row]:
        srv = pair.baseline if side == "baseline" else pair.candidate
        plan = [(seed, 0) for seed in seeds] + ([(seeds[0], 1)] if side == "candidate" else [])
        rows: list[Row] = []
        for seed, repeat in plan:
            out = _chat(srv, cfg.sampling_prompt, temperature=cfg.sampling_temperature,
                        seed=seed, max_tokens=cfg.sampling_max_tokens, return_token_ids=True)
            choice = out["choices"][0]
            rows.append({"side": side, "seed": seed, "repeat": repeat,
                         "text": choice["message"]["content"] or "",
                         "token_ids": list(choice.get("token_ids") or []),
                         "finish_reason": choice.get("finish_reason")})
        return rows

    by_side = on_both_sides(side_rows, together=pair.sides_isolated)
    return by_side["baseline"] + by_side["candidate"]


def structured_rows(pair: ServerPair, cfg: FeaturesConfig) -> list[Row]:
    """JSON-schema constrained outputs on the candidate, through both vLLM request forms."""
    srv, rows = pair.candidate, []
    prompt = "Describe a fictional person as JSON with the fields name, age and tags."
    for i in range(cfg.structured_requests):
        temperature = 0.0 if i % 4 < 2 else 0.8
        common = {"temperature": temperature, "seed": 7 + i, "max_tokens": cfg.structured_max_tokens}
        if i % 2 == 0:
            fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
            out = _chat(srv, prompt, response_format=fmt, **common)
            text, api = out["choices"][0]["message"]["content"] or "", "response_format"
        else:
            payload = {"model": srv.model_name, "prompt": prompt + "\n",
                       "structured_outputs": {"json": PERSON_SCHEMA}, **common}
            out = srv.post_json("/v1/completions", payload)
            text, api = out["choices"][0]["text"], "structured_outputs"
        rows.append({"side": "candidate", "i": i, "api": api, "temperature": temperature,
                     "text": text, "finish_reason": out["choices"][0].get("finish_reason")})
    return rows


def server_max_model_len(srv: Server) -> int:
    """The max model length the server reports on ``/v1/models``."""
    data = srv.get_json("/v1/models")["data"][0]
    return int(data["max_model_len"])


def near_max_rows(pair: ServerPair, cfg: FeaturesConfig) -> list[Row]:
    """One completion whose prompt (counted with the server's /tokenize) fills the context."""
    srv = pair.candidate
    limit = server_max_model_len(srv)
    target = limit - cfg.near_max_gen_tokens
    text = FILLER * (limit // 8 + 1)  # far more tokens than needed, cut below
    ids = srv.post_json("/tokenize", {"model": srv.model_name, "prompt": text})["tokens"]
    if len(ids) < target:
        raise InfrastructureError(f"filler text gave only {len(ids)} tokens, need {target}")
    prompt_ids = ids[:target]
    counted = srv.post_json("/tokenize", {"model": srv.model_name,
                                          "prompt": prompt_ids_text(srv, prompt_ids)})["count"]
    out = srv.post_json("/v1/completions", {"model": srv.model_name, "prompt": prompt_ids,
                                            "max_tokens": cfg.near_max_gen_tokens, "temperature": 0})
    choice, usage = out["choices"][0], out["usage"]
    return [{"side": "candidate", "max_model_len": limit, "max_tokens": cfg.near_max_gen_tokens,
             "prompt_tokens_counted": len(prompt_ids), "retokenized_count": counted,
             "usage_prompt_tokens": usage["prompt_tokens"],
             "completion_tokens": usage["completion_tokens"],
             "finish_reason": choice.get("finish_reason"), "text": choice["text"]}]


def prompt_ids_text(srv: Server, ids: list[int]) -> str:
    """The text of ``ids`` through the server's ``/detokenize`` (recorded for the bundle)."""
    return str(srv.post_json("/detokenize", {"model": srv.model_name, "tokens": ids})["prompt"])


COLLECTORS = {
    "temperature_sampling": sampling_rows,
    "structured_output": structured_rows,
    "near_max_context": near_max_rows,
}
