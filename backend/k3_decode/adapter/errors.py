"""The adapter's one error type and the collector that gathers every problem before raising it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class AdapterError(ValueError):
    """vLLM's model, caches or metadata do not fit the executor; ``problems`` lists EVERY reason."""

    def __init__(self, what: str, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{what}: {len(self.problems)} problem(s)\n{lines}")


def join(path: str, name: str) -> str:
    """``path.name`` (``name`` alone at the root, where ``path`` is empty)."""
    return f"{path}.{name}" if path else name


class Problems:
    """Collects mismatches while walking a module tree; ``raise_if_any`` raises them together."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, message: str) -> None:
        """Record one problem."""
        self.items.append(message)

    def child(self, obj: Any, path: str, name: str) -> Any | None:
        """``obj.name`` (a submodule or attribute), or None with a 'missing' problem."""
        value = getattr(obj, name, None) if obj is not None else None
        if value is None and obj is not None:
            self.add(f"{join(path, name)}: missing")
        return value

    def tensor(self, obj: Any, path: str, name: str, shape: tuple[int, ...],
               dtypes: tuple[torch.dtype, ...]) -> torch.Tensor | None:
        """``obj.name`` checked for shape and dtype; None (and a problem) when it does not fit."""
        t = self.child(obj, path, name)
        return None if t is None else self.check(t, join(path, name), shape, dtypes)

    def check(self, t: Any, where: str, shape: tuple[int, ...],
              dtypes: tuple[torch.dtype, ...]) -> torch.Tensor | None:
        """``t`` detached (same storage) when it has ``shape`` and one of ``dtypes``, else None
        with one problem per mismatch."""
        if not isinstance(t, torch.Tensor):
            self.add(f"{where}: expected a tensor, got {type(t).__name__}")
            return None
        ok = True
        if tuple(t.shape) != shape:
            self.add(f"{where}: shape {tuple(t.shape)}, expected {shape}")
            ok = False
        if t.dtype not in dtypes:
            names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            self.add(f"{where}: dtype {str(t.dtype).removeprefix('torch.')}, expected {names}")
            ok = False
        return t.detach() if ok else None

    def raise_if_any(self, what: str) -> None:
        """Raise one ``AdapterError`` listing every recorded problem (nothing when there is none)."""
        if self.items:
            raise AdapterError(what, self.items)
