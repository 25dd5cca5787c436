"""The import circles of a graph of modules: shared by the package's shape test (tests/test_architecture.py) and
benchmarks/' (tests/test_benchmarks_imports.py), which read their imports each their own way."""

from __future__ import annotations


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle in ``graph`` (module -> the modules it imports) found by a depth-first walk, each reported
    once, from where the walk entered it (``[a, b, a]``)."""
    done: set[str] = set()
    found: list[list[str]] = []

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            found.append([*trail[trail.index(name) :], name])
            return
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, [*trail, name])
        done.add(name)

    for name in graph:
        visit(name, [])
    return found
