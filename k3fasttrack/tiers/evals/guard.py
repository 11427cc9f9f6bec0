"""lm-eval API clients that refuse to truncate.

lm-eval's completions client cuts every prompt to ``max_length - max_gen_toks`` tokens and only
logs a warning; when the budget exceeds ``max_length`` the prompt becomes empty and the score
silently drops. These clients take ``max_length`` from the server and check every request before
the first one is sent: a prompt that would not fit with its generation budget raises
``PromptTooLong`` and nothing runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class PromptTooLong(Exception):
    """Some prompts plus their generation budget exceed the server's max model length."""

    def __init__(self, over: list[tuple[int, int]], max_gen_toks: int, max_length: int) -> None:
        self.over = over
        worst = max(t for _, t in over)
        super().__init__(
            f"{len(over)} prompt(s) would be truncated: the longest has {worst} tokens, plus "
            f"{max_gen_toks} generated > max model length {max_length}"
        )


@dataclass(frozen=True)
class Endpoint:
    """One server as lm-eval sees it."""

    base: str
    """``http://127.0.0.1:PORT`` (no ``/v1``)."""
    model_name: str
    max_model_len: int


def count_chat_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    """Prompt tokens of ``messages`` after the model's chat template (generation prompt added)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return len(out)


def find_overflows(lengths: list[int], budgets: list[int], limit: int) -> list[tuple[int, int]]:
    """(index, prompt tokens) of every request with ``tokens + budget > limit``."""
    return [(i, n) for i, (n, b) in enumerate(zip(lengths, budgets, strict=True)) if n + b > limit]


def _check(lm: Any, requests: list[Any], count: Any) -> None:
    contexts = [req.args[0] for req in requests]
    budgets = [int(req.args[1].get("max_gen_toks", lm._max_gen_toks)) for req in requests]
    lengths = [count(c) for c in contexts]
    over = find_overflows(lengths, budgets, lm.max_length)
    if over:
        raise PromptTooLong(over, max(budgets), lm.max_length + 1)


def guarded_client(api: str, endpoint: Endpoint, tokenizer_dir: Path, **kwargs: Any) -> Any:
    """An lm-eval client for ``api`` (``completions``/``chat``) with the truncation guard.

    ``max_length`` is always the server's max model length; the tokenizer is the served model's
    Hugging Face folder (works offline). Extra ``kwargs`` go to the lm-eval client.
    """
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    common = dict(model=endpoint.model_name, max_length=endpoint.max_model_len, **kwargs)
    if api == "completions":

        class GuardedCompletions(LocalCompletionsAPI):  # type: ignore[misc]
            def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
                _check(
                    self,
                    requests,
                    lambda c: len(self.tok_encode(c, add_special_tokens=self.add_bos_token)),
                )
                return super().generate_until(requests, disable_tqdm)

        return GuardedCompletions(
            base_url=f"{endpoint.base}/v1/completions",
            tokenizer=str(tokenizer_dir),
            tokenizer_backend="huggingface",
            **common,
        )

    import transformers

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))

    class GuardedChat(LocalChatCompletion):  # type: ignore[misc]
        def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
            _check(self, requests, lambda c: count_chat_tokens(hf_tok, json.loads(c.prompt)))
            return super().generate_until(requests, disable_tqdm)

    return GuardedChat(base_url=f"{endpoint.base}/v1/chat/completions", **common)
