"""lm-eval task objects for a suite: lm-eval's own task config, fed our local documents.

The task YAML shipped with lm-eval (``gsm8k/gsm8k.yaml``, ``aime/aime25.yaml``, ...) is loaded
as is, so its prompt, filters and scoring are lm-eval's; only the dataset keys are replaced by a
``custom_dataset`` that returns the documents already in memory (nothing is fetched from the hub,
and GPQA questions never touch the disk). MRCR is not in lm-eval 0.4.13: ``MrcrTask`` sends each
row's chat messages as they are and grades with MRCR's rule.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from k3fasttrack.tiers.evals import gpqa, mrcr
from k3fasttrack.tiers.evals.datasets import SuiteData
from k3fasttrack.tiers.evals.suite import GpqaZipData, Suite, SuiteError

_DATASET_KEYS = ("dataset_path", "dataset_name", "dataset_kwargs", "tag", "group", "include")


def lm_eval_tasks_dir() -> Path:
    """The folder of task YAMLs inside the installed lm-eval."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _base_config(suite: Suite) -> dict[str, Any]:
    from lm_eval.tasks._yaml_loader import load_yaml

    if suite.task.builtin == "mrcr":
        return _mrcr_config()
    rel = suite.task.lm_eval or ""
    path = lm_eval_tasks_dir() / rel
    if not path.is_file():
        raise SuiteError(f"suite {suite.name}: lm-eval task file not found: {rel}")
    return dict(load_yaml(path))


def _mrcr_config() -> dict[str, Any]:
    return {
        "task": "k3ft_mrcr",
        "output_type": "generate_until",
        "test_split": "test",
        "doc_to_text": "prompt",
        "doc_to_target": "answer",
        "process_results": mrcr.process_results,
        "metric_list": [{"metric": "score", "aggregation": "mean", "higher_is_better": True}],
        "generation_kwargs": {"until": [], "do_sample": False, "temperature": 0.0},
        "num_fewshot": 0,
        "metadata": {"version": 1.0},
    }


def task_config(suite: Suite, data: SuiteData) -> dict[str, Any]:
    """The full lm-eval task config of ``suite`` over ``data`` (documents in memory)."""
    import datasets

    cfg = _base_config(suite)
    for key in _DATASET_KEYS:
        cfg.pop(key, None)
    cfg.update(suite.task.overrides)
    splits = {name: datasets.Dataset.from_list(docs) for name, docs in data.splits.items()}

    def _custom_dataset(**_: Any) -> datasets.DatasetDict:
        return datasets.DatasetDict(splits)

    cfg["custom_dataset"] = _custom_dataset
    if isinstance(suite.data, GpqaZipData):
        cfg["process_docs"] = gpqa.keep_docs
        if "fewshot_config" in cfg and isinstance(cfg["fewshot_config"], dict):
            cfg["fewshot_config"] = {**cfg["fewshot_config"], "process_docs": gpqa.keep_docs}
    gen = dict(cfg.get("generation_kwargs") or {})
    gen.update(
        max_gen_toks=suite.generation.max_gen_toks,
        temperature=suite.generation.temperature,
        do_sample=suite.generation.temperature > 0,
    )
    cfg["generation_kwargs"] = gen
    cfg["num_fewshot"] = suite.num_fewshot
    cfg["task"] = task_name(suite)
    return cfg


def task_name(suite: Suite) -> str:
    """The name lm-eval reports the suite's task under."""
    return f"k3ft_{suite.name}"


def build_task(suite: Suite, data: SuiteData) -> Any:
    """An lm-eval ``Task`` object for ``suite`` (``MrcrTask`` for MRCR)."""
    from lm_eval.api.task import ConfigurableTask

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    cfg = task_config(suite, data)
    if suite.task.builtin == "mrcr":
        return _mrcr_task_class()(config=cfg)
    return ConfigurableTask(config=cfg)


def _mrcr_task_class() -> type:
    from lm_eval.api.task import ConfigurableTask

    class MrcrTask(ConfigurableTask):  # type: ignore[misc]
        """Sends a row's whole conversation as chat messages (needs the chat API)."""

        def fewshot_context(self, doc: dict[str, Any], num_fewshot: int, **kwargs: Any) -> Any:
            chat_template = kwargs.get("chat_template")
            if chat_template is None:
                raise SuiteError("MRCR needs the chat API (suite api: chat)")
            return chat_template(mrcr.messages_of(doc), add_generation_prompt=True)

    return MrcrTask
