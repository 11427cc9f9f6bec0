"""Per-cell results on disk: written atomically when a cell finishes; resume skips them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from k3fasttrack.runtime.atomic import write_json_atomic


class CellStore:
    """Results of finished cells under ``<bundle>/cells/<cell id>.json``.

    A cell that started but did not finish leaves ``<id>.running``; ``--resume`` reruns it.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, cell_id: str) -> Path:
        return self.root / f"{cell_id}.json"

    def is_done(self, cell_id: str) -> bool:
        """True when the cell's result was written."""
        return self._path(cell_id).is_file()

    def load(self, cell_id: str) -> dict[str, Any]:
        """The stored result of a finished cell."""
        return json.loads(self._path(cell_id).read_text())

    def start(self, cell_id: str) -> None:
        """Mark a cell as running (left behind if the run is interrupted)."""
        (self.root / f"{cell_id}.running").write_text("")

    def save(self, cell_id: str, result: dict[str, Any]) -> None:
        """Atomically store a finished cell's result, then clear its running mark."""
        write_json_atomic(self._path(cell_id), result)
        (self.root / f"{cell_id}.running").unlink(missing_ok=True)

    def interrupted(self) -> list[str]:
        """Cells that started and never finished."""
        return sorted(p.name[: -len(".running")] for p in self.root.glob("*.running"))

    def clear_marks(self) -> None:
        """Drop running marks (they are not evidence and do not go into a bundle)."""
        for p in self.root.glob("*.running"):
            p.unlink()
