"""The release of every framework the suite runs against, in this environment: the ``releases:`` line that ends
each pytest run (tests/conftest.py), and ``./dev versions``, which prints one row per environment of the table the
docs quote (docs/coverage.md, "Supported versions"; tests/test_docs.py holds the docs to it).

``python -m releases .venv`` (from tests/) prints the row for ./dev's environment at ``.venv``."""

from __future__ import annotations

import sys
from importlib import metadata

RELEASES = ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "lightning")
# ./dev's environments, as the docs' table names them.
ENVIRONMENTS = {
    ".venv": "newest (`./dev test`)",
    ".venv-oldest": "oldest (`./dev test`)",
    ".venv-newest-torch": "newest torch (`./dev test-newest-torch`)",
}


def release(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def releases() -> str:
    """``torch 2.13.0+cpu, transformers 5.24.0, ...`` ("absent" where a package is not installed)."""
    return ", ".join(f"{name} {release(name) or 'absent'}" for name in RELEASES)


def row(environment: str) -> str:
    """This environment's row of the docs' table: its name, then each release ("none" where absent)."""
    cells = [ENVIRONMENTS.get(environment.rstrip("/"), environment)] + [release(n) or "none" for n in RELEASES]
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    print(row(sys.argv[1] if len(sys.argv) > 1 else sys.prefix))
