"""Run one suite on one server through lm-eval's Python API and normalise its per-sample log."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from k3fasttrack.errors import InfrastructureError
from k3fasttrack.tiers.evals.datasets import SuiteData
from k3fasttrack.tiers.evals.guard import Endpoint, guarded_client
from k3fasttrack.tiers.evals.suite import Suite
from k3fasttrack.tiers.evals.tasks import build_task, task_name
from k3fasttrack.models.samples import EvalSample, Side
from k3fasttrack.runtime import progress


def _prompt_text(sample: dict[str, Any]) -> str:
    """The exact prompt lm-eval built (text, or the chat messages as JSON)."""
    args: Any = sample.get("arguments") or [[""]]
    if isinstance(args, dict):  # the form lm-eval writes to its samples file
        first = next(iter(args.values()))
        ctx = first.get("arg_0", "") if isinstance(first, dict) else first
    else:
        ctx = args[0][0]
    ctx = getattr(ctx, "prompt", ctx)  # JsonChatStr for chat requests
    return ctx if isinstance(ctx, str) else json.dumps(ctx, sort_keys=True, ensure_ascii=False)


def _output_text(sample: dict[str, Any]) -> str:
    resps = sample.get("resps") or [[""]]
    first = resps[0]
    return str(first[0] if isinstance(first, list) else first)


def _redacted_output(sample: dict[str, Any]) -> str:
    """GPQA: the answer lm-eval's filter extracted and the sha256 of the full output, never the
    output text (it may quote the question, which GPQA's authors ask not to publish)."""
    filtered = sample.get("filtered_resps") or [""]
    first = filtered[0]
    answer = str(first[0] if isinstance(first, list) and first else first)
    digest = hashlib.sha256(_output_text(sample).encode()).hexdigest()
    return f"[redacted] extracted={answer[:16]!r} sha256={digest}"


def normalise(suite: Suite, side: Side, raw: list[dict[str, Any]]) -> list[EvalSample]:
    """One ``EvalSample`` per document from lm-eval's sample records (the suite's filter only)."""
    metric, filt = suite.score.metric, suite.score.filter
    out: list[EvalSample] = []
    for s in raw:
        if s.get("filter", "none") != filt:
            continue
        if metric not in s:
            raise InfrastructureError(f"suite {suite.name}: lm-eval sample lacks metric '{metric}'")
        out.append(
            EvalSample(
                suite=suite.name,
                side=side,
                doc_id=str(s["doc_id"]),
                score=float(s[metric]),
                prompt_sha256=hashlib.sha256(_prompt_text(s).encode()).hexdigest(),
                # GPQA's authors ask that questions not be posted in plain text: hash only.
                output=(_redacted_output(s) if suite.data.kind == "gpqa_zip"
                        else _output_text(s)),
                prompt=None if suite.data.kind == "gpqa_zip" else _prompt_text(s),
            )
        )
    if not out:
        raise InfrastructureError(
            f"suite {suite.name}: lm-eval logged no samples for filter '{filt}'"
        )
    return sorted(out, key=lambda e: int(e.doc_id))


def prepare() -> None:
    """Import the lm-eval modules ``evaluate`` uses, so that two threads that then run it at once
    (one per side) find them loaded."""
    import datasets  # noqa: F401
    import lm_eval  # noqa: F401
    import lm_eval.api.task  # noqa: F401
    import lm_eval.models.openai_completions  # noqa: F401
    import lm_eval.tasks  # noqa: F401
    import lm_eval.utils  # noqa: F401
    import transformers  # noqa: F401


def evaluate(
    suite: Suite, data: SuiteData, endpoint: Endpoint, tokenizer_dir: Path, *,
    new_activity: bool = True,
) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` on one server with the suite's settings; returns its output.

    ``new_activity``: the heartbeat's request counts start from zero here (False: the caller
    began the activity, e.g. for both sides at once).

    Safe to run in two threads at once: the Python, numpy and torch seeds it sets are global, but
    nothing on this path draws from those generators (lm-eval's few-shot sampler has a
    ``random.Random`` of its own, GPQA's shuffle is replaced by ours, generation is greedy with
    the seed sent to the server); each call builds its own client, tokenizer, task objects and
    event loop."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    gen = suite.generation
    lm = guarded_client(
        suite.api,
        endpoint,
        tokenizer_dir,
        num_concurrent=suite.num_concurrent,
        max_retries=2,
        timeout=suite.request_timeout_s,
        seed=gen.seed,
        max_gen_toks=gen.max_gen_toks,
    )
    count_requests(lm)
    if new_activity:
        progress.begin_activity()
    chat = suite.api == "chat"
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=[build_task(suite, data)],
        limit=suite.limit,
        log_samples=True,
        bootstrap_iters=0,
        apply_chat_template=chat,
        fewshot_as_multiturn=chat and suite.num_fewshot > 0,
        system_instruction=suite.system_instruction,
        task_manager=TaskManager(include_defaults=False),
        random_seed=gen.seed,
        numpy_random_seed=gen.seed,
        torch_random_seed=gen.seed,
        fewshot_random_seed=gen.seed,
    )
    if out is None:
        raise InfrastructureError(f"suite {suite.name}: lm-eval returned no results")
    return dict(out)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def count_requests(lm: Any) -> None:
    """Report each of the client's requests to the progress heartbeat: a finished one counts,
    a failed one (lm-eval retries it) is said at once with the rate measured so far."""
    sync_call, async_call = lm.model_call, lm.amodel_call

    def model_call(*args: Any, **kwargs: Any) -> Any:
        try:
            out = sync_call(*args, **kwargs)
        except Exception as exc:
            progress.request_retried(_reason(exc))
            raise
        progress.request_done()
        return out

    async def amodel_call(*args: Any, **kwargs: Any) -> Any:
        try:
            out = await async_call(*args, **kwargs)
        except Exception as exc:  # timeouts and transport errors: tenacity sends it again
            progress.request_retried(_reason(exc))
            raise
        progress.request_done()
        return out

    lm.model_call, lm.amodel_call = model_call, amodel_call


def split_output(
    suite: Suite, side: Side, out: dict[str, Any]
) -> tuple[list[EvalSample], dict[str, Any]]:
    """(normalised samples, lm-eval's results JSON without the raw samples)."""
    from lm_eval.utils import handle_non_serializable

    raw = out.get("samples", {}).get(task_name(suite), [])
    samples = normalise(suite, side, raw)
    results = {k: v for k, v in out.items() if k != "samples"}
    results = json.loads(json.dumps(results, default=handle_non_serializable, ensure_ascii=False))
    return samples, results
