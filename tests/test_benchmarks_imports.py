"""The shape benchmarks/ keeps: no import circle among its scripts and modules, and the conformance sweep's package
(``benchmarks/conformance/``) in layers that import only downwards, each module short enough to read in one sitting.
Read from the source (ast), importing nothing: no torch here."""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph import circles

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
PACKAGE = "conformance"

# From the bottom up, as benchmarks/conformance/__init__.py draws them. A module imports modules of its own layer or
# of the layers below it, never above.
LAYERS = (
    ("tiny", "calls", "media_batches", "upstream"),
    ("quirks",),
    ("models", "steps"),
    ("rows", "testers"),
    ("sweep", "report"),
    ("__main__", "__init__"),
)
MODULE_LINES = 400


def module_name(path: Path) -> str:
    """A module by the name it is imported with, benchmarks/ on the path (as its scripts put it): a script by its
    name (``ladder``), a package's module by its dotted name (``conformance.rows``); a probe kept with its results,
    in no package, by its path (nothing imports it)."""
    parts = path.relative_to(BENCHMARKS).with_suffix("").parts
    packaged = all((BENCHMARKS.joinpath(*parts[:k]) / "__init__.py").exists() for k in range(1, len(parts)))
    if not packaged:
        return "/".join(parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(BENCHMARKS.rglob("*.py"))}


def resolve(name: str) -> str:
    """``benchmarks.conformance.rows`` (the checkout on the path, as the tests import it) is ``conformance.rows``."""
    return name.removeprefix("benchmarks.")


def imports(path: Path) -> set[str]:
    """The modules of benchmarks/ that ``path`` imports, anywhere in it: at the top, inside functions, and under
    ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = resolve(".".join(base + ([node.module] if node.module else [])))
            named = {resolve(f"{module}.{alias.name}") for alias in node.names} & MODULES.keys()
            found |= named or {module}
        elif isinstance(node, ast.Import):
            found |= {resolve(alias.name) for alias in node.names}
    return {other for other in found if other in MODULES}


def graph() -> dict[str, set[str]]:
    return {name: imports(path) - {name} for name, path in MODULES.items()}


def layer_of(name: str) -> int:
    rest = name.removeprefix(PACKAGE).lstrip(".")
    top = rest.split(".")[0] if rest else "__init__"
    return next(index for index, layer in enumerate(LAYERS) if top in layer)


SWEEP = {name: path for name, path in MODULES.items() if name == PACKAGE or name.startswith(PACKAGE + ".")}


def test_the_finder_sees_the_imports_it_is_there_for():
    """The finder itself: a relative import, a lazy one inside a function, and a sibling script's."""
    assert "conformance.quirks" in imports(MODULES["conformance.models"])
    assert "conformance.upstream" in imports(MODULES["conformance.rows"])
    assert "conformance.tiny" in imports(MODULES["conformance.quirks.text"])
    assert {"bench", "ladder"} <= imports(MODULES["mixed"])


def test_no_import_circle_in_benchmarks():
    found = circles(graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(circle) for circle in found)


def test_every_module_of_the_sweep_has_a_layer():
    for name in SWEEP:
        assert layer_of(name) is not None, name


def test_the_sweeps_modules_import_only_their_layer_and_the_ones_below():
    for name, path in SWEEP.items():
        outside = {other for other in imports(path) if other not in SWEEP}
        assert not outside, f"{name} imports {sorted(outside)}, outside the sweep's package"
        upward = {other for other in imports(path) if layer_of(other) > layer_of(name)}
        assert not upward, f"{name} (layer {LAYERS[layer_of(name)]}) imports {sorted(upward)} from above"


def test_the_package_file_imports_nothing():
    """Importing one module of the sweep runs ``__init__`` first: it must not pull in the layers above."""
    assert imports(MODULES[PACKAGE]) == set()


def test_no_module_of_the_sweep_is_longer_than_a_sitting():
    long = {name: n for name, path in SWEEP.items() if (n := len(path.read_text().splitlines())) > MODULE_LINES}
    assert not long, f"modules over {MODULE_LINES} lines: {long}"
