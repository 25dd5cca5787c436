"""Writing a run's results: ``<name>.json`` (everything measured, with the environment) and ``<name>.md`` (the
table a page quotes), rewritten after each part so that a run cut short keeps what it measured; a figure where
matplotlib is installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write(out: Path, name: str, data: dict[str, Any], markdown: str, indent: int = 1) -> None:
    """``out/<name>.json`` and ``out/<name>.md``; values JSON does not know are written as their ``str``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=indent, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown)


def pyplot() -> Any:
    """matplotlib's pyplot on its file backend; ImportError where matplotlib is not installed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
