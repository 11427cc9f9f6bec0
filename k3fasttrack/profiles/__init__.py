"""Profile loading: embedded profiles by name, or a YAML file by path; errors name file, line and
field."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from k3fasttrack.errors import ProfileError
from k3fasttrack.models.profile import Profile

DEFAULT_PROFILE = "cpu-demo"


def embedded_names() -> list[str]:
    """Names of the profiles shipped inside the package."""
    return sorted(
        p.name[: -len(".yaml")]
        for p in resources.files(__package__).iterdir()
        if p.name.endswith(".yaml")
    )


def _line_of(node: yaml.Node | None, loc: tuple[int | str, ...]) -> int | None:
    """Follow a pydantic error location through the YAML node tree to a 1-based line."""
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            match = [v for k, v in node.value if k.value == key]
            if not match:
                break
            node = match[0]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            break
        line = node.start_mark.line + 1
    return line


def parse_profile(text: str, source: str) -> Profile:
    """Validate YAML text as a Profile; any problem becomes a one-line ProfileError."""
    try:
        node = yaml.compose(text)
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # The construct that failed to parse starts at context_mark; the parser notices at
        # problem_mark (often the end of the file). Name where the construct starts.
        mark = getattr(exc, "context_mark", None) or getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        context = getattr(exc, "context", None)
        problem = f"{problem} ({context})" if context else problem
        raise ProfileError(f"{where}: malformed YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a profile must be a YAML mapping")
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        field = ".".join(str(p) for p in loc) or "(top level)"
        line = _line_of(node, loc)
        where = f"{source}:{line}" if line else source
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ProfileError(f"{where}: field '{field}': {err['msg']}{more}") from None


def load_profile(name_or_path: str | None) -> Profile:
    """An embedded profile by name, or a YAML file by path."""
    name = name_or_path or DEFAULT_PROFILE
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or path.exists():
        try:
            text = path.read_text()
        except OSError as exc:
            raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
        return parse_profile(text, str(path))
    if name not in embedded_names():
        known = ", ".join(embedded_names())
        raise ProfileError(f"unknown profile '{name}' (known: {known}; or give a .yaml path)")
    text = resources.files(__package__).joinpath(f"{name}.yaml").read_text()
    return parse_profile(text, f"<embedded {name}.yaml>")
