"""The shape benchmarks/ keeps: no import circle among its scripts and modules; one shared harness
(``benchmarks/harness/``) that imports nothing of the scripts, and scripts that take their rounds and verdicts from it
rather than from each other; and the conformance sweep's package (``benchmarks/conformance/``) in layers that import
only downwards, each module short enough to read in one sitting. Read from the source (ast), importing nothing: no
torch here."""

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
    name (``ladder``), a package's module by its dotted name (``conformance.rows``, ``probes.gc_per_step``); a file
    in no package by its path."""
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
HARNESS = {name: path for name, path in MODULES.items() if name == "harness" or name.startswith("harness.")}
SCRIPTS = {name: path for name, path in MODULES.items() if path.parent == BENCHMARKS}
# The GPU check's parts are other scripts' quick runs: it is the one script that imports scripts.
RUNS_OTHER_SCRIPTS = {"gpu_check"}


def test_the_finder_sees_the_imports_it_is_there_for():
    """The finder itself: a relative import, a lazy one inside a function, and a sibling script's."""
    assert "conformance.quirks" in imports(MODULES["conformance.models"])
    assert "conformance.upstream" in imports(MODULES["conformance.rows"])
    assert "conformance.tiny" in imports(MODULES["conformance.quirks.text"])
    assert {"harness.models", "harness.forms"} <= imports(MODULES["mixed"])


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


def test_the_harness_imports_nothing_outside_it():
    """The harness is the bottom of benchmarks/: a script's change cannot reach another script through it."""
    for name, path in HARNESS.items():
        outside = {other for other in imports(path) if other not in HARNESS}
        assert not outside, f"{name} imports {sorted(outside)}, outside the harness"


def test_a_question_script_takes_shared_pieces_from_the_harness_not_from_another_script():
    for name, path in SCRIPTS.items():
        others = {other for other in imports(path) if other in SCRIPTS}
        assert name in RUNS_OTHER_SCRIPTS or not others, f"{name} imports the scripts {sorted(others)}"


# The harness from the bottom up, as benchmarks/harness/__init__.py lists it: a module imports only those before it.
HARNESS_ORDER = (
    "environment", "verdicts", "results", "rounds", "compiled", "models", "forms", "trace_modes", "scenarios",
    "peer_modes", "__init__",
)  # fmt: skip


def test_the_harness_imports_only_downwards():
    assert {name.removeprefix("harness").lstrip(".") or "__init__" for name in HARNESS} == set(HARNESS_ORDER)
    for name, path in HARNESS.items():
        level = HARNESS_ORDER.index(name.removeprefix("harness").lstrip(".") or "__init__")
        above = {other for other in imports(path) if HARNESS_ORDER.index(other.removeprefix("harness.")) >= level}
        assert not above, f"{name} imports {sorted(above)} from its own level or above"


def test_no_module_of_the_harness_is_longer_than_a_sitting():
    long = {name: n for name, path in HARNESS.items() if (n := len(path.read_text().splitlines())) > MODULE_LINES}
    assert not long, f"modules over {MODULE_LINES} lines: {long}"


def test_nothing_imports_a_probe_and_a_probe_imports_downward_only():
    """A probe (benchmarks/probes/) answers one question from the benchmarks and the package below it: no script,
    sweep module or other probe imports one, so rerunning or deleting a probe changes no other figure."""
    probes = {name for name in MODULES if name == "probes" or name.startswith("probes.")}
    assert len(probes) > 1, "benchmarks/probes/ holds no probe"
    importers = {name: sorted(found) for name, path in MODULES.items() if (found := imports(path) & probes - {name})}
    assert importers == {}


def top_level_names(path: Path) -> set[str]:
    """What ``import module`` gives a reader of ``path``'s module: the names its top level defines, assigns or
    imports."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}
    return names


def names_read_from_scripts(path: Path) -> dict[str, set[str]]:
    """The attributes ``path`` reads from the benchmark scripts it imports whole (``import ladder``, then
    ``ladder.SHAPES``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound = {
        alias.asname or alias.name: resolve(alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if resolve(alias.name) in MODULES
    }
    read: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            read.setdefault(bound[node.value.id], set()).add(node.attr)
    return read


def test_every_name_a_probe_reads_from_a_script_is_still_there():
    """Nothing imports a probe, so no run of the suite would notice a script's rename breaking one: the names each
    probe reads (``ladder.SHAPES``, ``peers.paired``) must exist at the script's top level."""
    missing = {
        f"{name} reads {script}.{attr}"
        for name, path in MODULES.items()
        if name.startswith("probes.")
        for script, attrs in names_read_from_scripts(path).items()
        for attr in attrs - top_level_names(MODULES[script])
    }
    assert not missing, sorted(missing)


def test_no_script_or_part_is_longer_than_a_sitting():
    """Every script and package module of benchmarks/ reads in one sitting (``MODULE_LINES``)."""
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MODULE_LINES}
    assert not long, f"over {MODULE_LINES} lines: {long}"
