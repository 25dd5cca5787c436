"""The shape docs/architecture.md promises: modules in layers that import only downwards (type-only imports
included), no import circle anywhere, a pure policy, and a controller small enough to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph import circles

PACKAGE = Path(__file__).resolve().parents[1] / "autooffload"

# From the bottom up. A module imports modules of its own layer or of the layers below it, never above.
LAYERS = (
    ("settings", "warn", "guard", "console"),
    ("decide",),
    ("observe",),
    ("apply",),
    ("history", "distributed", "fallback", "lifecycle", "record"),
    ("run",),
    ("controller",),
    ("callback", "rescue", "integrations", "demo", "plot", "estimate", "__main__", "__init__"),
)
CONTROLLER_LINES = 300
CONTROLLER_ATTRIBUTES = 20
MODULE_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path) -> set[str]:
    """The package's modules ``path`` imports, anywhere in it: at the top, inside functions, and under
    ``if TYPE_CHECKING:`` (a type-only import is still a dependency on what it names)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path).split(".") if path.name == "__init__.py" else module_name(path).split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            named = {f"{module}.{alias.name}" for alias in node.names} & MODULES.keys()
            found |= named or {module}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name in MODULES}


def layer_of(name: str) -> int:
    top = name.split(".")[1] if "." in name else "__init__"
    return next(index for index, layer in enumerate(LAYERS) if top in layer)


def test_every_module_has_a_layer():
    for name in MODULES:
        assert layer_of(name) is not None, name


def test_modules_import_only_their_layer_and_the_ones_below():
    for name, path in MODULES.items():
        upward = {other for other in imports(path) if layer_of(other) > layer_of(name)}
        assert not upward, f"{name} (layer {LAYERS[layer_of(name)]}) imports {sorted(upward)} from above"


def test_no_import_circle():
    graph = {name: imports(path) - {name} for name, path in MODULES.items()}
    found = circles(graph)
    assert not found, "import circle: " + " -> ".join(found[0])


def test_the_policy_is_pure():
    for name, path in MODULES.items():
        if layer_of(name) != LAYERS.index(("decide",)):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        outside = {
            alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        absolute = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level]
        outside |= {node.module.split(".")[0] for node in absolute}
        assert not outside & {"torch", "autooffload"}, f"{name} imports {sorted(outside & {'torch', 'autooffload'})}"
        assert all(other.startswith("autooffload.decide") for other in imports(path)), f"{name} imports outside decide/"


def test_no_module_is_longer_than_a_sitting():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MODULE_LINES}
    assert not long, f"modules over {MODULE_LINES} lines: {long}"
    lines = len((PACKAGE / "controller.py").read_text().splitlines())
    assert lines <= CONTROLLER_LINES, f"controller.py has {lines} lines"


def test_the_controller_holds_a_handful_of_parts():
    """Every attribute an ``OffloadController`` holds, its own and its base's (autooffload.run), counted from the
    source: the ``self.x = ...`` assignments and the class-level declarations."""
    names: set[str] = set()
    for path, classes in ((PACKAGE / "controller.py", {"OffloadController"}), (PACKAGE / "run.py", {"Run"})):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name in classes):
            names |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            for node in ast.walk(cls):
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                for target in targets if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) else []:
                    for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                        if isinstance(item, ast.Attribute) and getattr(item.value, "id", None) == "self":
                            names.add(item.attr)
    assert 10 <= len(names) <= CONTROLLER_ATTRIBUTES, sorted(names)
