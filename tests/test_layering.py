"""The toolkit's modules import only from their own layer or from the layers below it.

Layers, bottom to top; a module belongs to the layer of the longest prefix that names it (the
package ``k3fasttrack`` itself only by its exact name):

- core: errors, data, stats, models, depth, profiles, envinfo, plugins, the package root
- runtime: what a tier runs against (context, cell store, progress, atomic writes, traces)
- serving: the baseline / candidate server pair and its counters
- tier support: the tier spec, the status rules, the verdict
- tiers: one package per tier (a tier may use another tier's modules)
- registry: the list of tiers
- bundle: signing, archives, verification and recheck of bundles
- reports: summary, diff, PR bot
- pipeline: planning, preflight and the run of the tiers
- cli: the commands, ``__main__`` and the schema writer

Every import counts, also one inside a function (lazy imports keep ``k3ft --help`` fast, but
they are dependencies all the same); imports under ``if TYPE_CHECKING:`` are for annotations
only and are not counted.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = "k3fasttrack"
ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("k3fasttrack", "k3fasttrack.errors", "k3fasttrack.data", "k3fasttrack.stats",
              "k3fasttrack.models", "k3fasttrack.depth", "k3fasttrack.profiles",
              "k3fasttrack.envinfo", "k3fasttrack.plugins")),
    ("runtime", ("k3fasttrack.runtime",)),
    ("serving", ("k3fasttrack.serving",)),
    ("tier support", ("k3fasttrack.tiers", "k3fasttrack.tiers.spec", "k3fasttrack.tiers.restatus",
                      "k3fasttrack.tiers.verdict")),
    ("tiers", ("k3fasttrack.tiers.isolation", "k3fasttrack.tiers.kernels",
               "k3fasttrack.tiers.tokens", "k3fasttrack.tiers.evals", "k3fasttrack.tiers.features",
               "k3fasttrack.tiers.perf", "k3fasttrack.tiers.proof",
               "k3fasttrack.tiers.sizing")),
    ("registry", ("k3fasttrack.tiers.registry",)),
    ("bundle", ("k3fasttrack.bundle",)),
    ("reports", ("k3fasttrack.summary", "k3fasttrack.diff", "k3fasttrack.prbot")),
    ("pipeline", ("k3fasttrack.pipeline",)),
    ("cli", ("k3fasttrack.cli", "k3fasttrack.__main__", "k3fasttrack.schemas")),
)
EXACT_ONLY = frozenset({"k3fasttrack", "k3fasttrack.tiers"})
"""Package roots that name only their ``__init__`` (their subpackages are declared apart)."""


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}


def layer_of(module: str, layers=LAYERS) -> int | None:
    """Index of the module's layer, or None when no layer names it."""
    best: tuple[int, int] | None = None  # (prefix length, layer index)
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            exact = module == prefix
            below = module.startswith(prefix + ".") and prefix not in EXACT_ONLY
            if (exact or below) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _runtime_imports(node: ast.AST):
    """Import statements outside ``if TYPE_CHECKING:`` bodies (the ``else`` branch counts)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _runtime_imports(ast.Module(body=[stmt], type_ignores=[]))
            continue
        yield from _runtime_imports(child)


def imported_modules(module: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) for each toolkit module the file imports; ``from a import b`` names
    ``a.b`` when that is a module."""
    is_package = path.name == "__init__.py"
    out: list[tuple[int, str]] = []
    for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        out.extend((node.lineno, t) for t in dict.fromkeys(targets)
                   if t == PACKAGE or t.startswith(PACKAGE + "."))
    return out


def upward_imports(root: Path = ROOT, layers=LAYERS) -> list[str]:
    """One line per import of a module in a higher layer than the importer's."""
    modules = package_modules(root)
    known = set(modules)
    problems = []
    for module, path in modules.items():
        own = layer_of(module, layers)
        for line, target in imported_modules(module, path, known):
            theirs = layer_of(target, layers)
            if own is not None and theirs is not None and theirs > own:
                problems.append(f"{path.relative_to(root)}:{line}: {module} ({layers[own][0]}) "
                                f"imports {target} ({layers[theirs][0]})")
    return problems


def test_every_module_has_a_layer() -> None:
    missing = [m for m in package_modules(ROOT) if layer_of(m) is None]
    assert not missing, f"modules in no layer (add them to LAYERS): {missing}"


def test_every_declared_prefix_exists() -> None:
    known = set(package_modules(ROOT))
    stale = [p for _, prefixes in LAYERS for p in prefixes if p not in known]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_no_upward_import() -> None:
    problems = upward_imports()
    assert not problems, "imports from a higher layer:\n" + "\n".join(problems)


def test_checker_sees_lazy_relative_and_type_only_imports(tmp_path: Path) -> None:
    pkg = tmp_path / PACKAGE
    for rel, text in {
        "__init__.py": "",
        "models/__init__.py": ("from typing import TYPE_CHECKING\n"
                               "if TYPE_CHECKING:\n    from k3fasttrack.cli import main\n"
                               "def f():\n    from ..pipeline import run\n"),
        "pipeline/__init__.py": "",
        "pipeline/run.py": "",
        "cli/__init__.py": "",
        "cli/main.py": "from k3fasttrack import models\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    problems = upward_imports(tmp_path)
    assert len(problems) == 1 and "imports k3fasttrack.pipeline.run (pipeline)" in problems[0]


HARNESS = ROOT / "backend/harness.py"
"""The backend's perf harness: the one backend module the perf tier loads by name."""


def test_the_backend_harness_uses_only_the_protocol_and_the_layers_below_it() -> None:
    """backend/harness.py imports the toolkit's core and runtime layers only (the harness
    protocol lives in ``k3fasttrack.models.harness``), and those imports load no tier module."""
    known = set(package_modules(ROOT))
    targets = [t for _, t in imported_modules("backend.harness", HARNESS, known)]
    assert "k3fasttrack.models.harness" in targets
    allowed = {index for index, (name, _) in enumerate(LAYERS) if name in ("core", "runtime")}
    above = [t for t in targets if layer_of(t) not in allowed]
    assert not above, f"backend/harness.py imports above the runtime layer: {above}"
    code = ("import sys\n" + "".join(f"import {t}\n" for t in dict.fromkeys(targets))
            + "print(sorted(m for m in sys.modules if m.startswith('k3fasttrack.tiers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    assert out == "[]", f"the harness's toolkit imports load tier modules: {out}"
