"""The layering docs/architecture.md promises: lower modules never import upper ones; the policy is pure."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "autooffload"
LOWER = ("settings", "warn", "history", "observe", "decide", "apply")
UPPER = ("controller", "callback", "rescue", "distributed", "demo", "plot", "estimate")


def runtime_imports(path: Path) -> set[str]:
    """Modules ``path`` imports when it runs (``if TYPE_CHECKING:`` blocks left out), as package paths."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for child in ast.walk(statement)
    }
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _modules(*names: str) -> list[Path]:
    paths = []
    for name in names:
        target = PACKAGE / name
        paths += sorted(target.rglob("*.py")) if target.is_dir() else [target.with_suffix(".py")]
    return paths


def test_lower_modules_never_import_the_controller_or_what_sits_on_it():
    for path in _modules(*LOWER):
        upper = {m for m in runtime_imports(path) if m.split(".")[:2] in (["autooffload", u] for u in UPPER)}
        assert not upper, f"{path.relative_to(PACKAGE.parent)} imports {sorted(upper)}"


def test_the_policy_is_pure():
    for path in _modules("decide"):
        imports = runtime_imports(path)
        assert not {m for m in imports if m.split(".")[0] == "torch"}, f"{path.name} imports torch"
        outside = {m for m in imports if m.startswith("autooffload.") and not m.startswith("autooffload.decide")}
        assert not outside, f"{path.name} imports {sorted(outside)} from outside decide/"
