"""What a results file says about where and how it was measured: the date, the device, the releases, the command
and the commit. One place, so that every script's environment line reads the same."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def releases() -> dict[str, str]:
    """torch, transformers, python and autooffload, as the results name them."""
    import torch
    import transformers

    import autooffload

    return dict(
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        autooffload=autooffload.__version__,
    )


def stamp(script: str, argv: list[str], **extra: Any) -> dict[str, Any]:
    """The environment a script's results start with: date, ``extra`` (the device, its name, ...), the releases, and
    the command (``python benchmarks/<script> <argv>``)."""
    return dict(date=now(), **extra, **releases(), command=" ".join(["python", f"benchmarks/{script}", *argv]))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_name(threads: int = 1) -> str:
    """The CPU as a CPU run's results name it: its model and torch's threads of the machine's."""
    return f"{cpu_model()}, {threads} torch thread of {os.cpu_count()}"


def load() -> str:
    """uptime's 1, 5 and 15 minute load averages: what else ran on a shared machine."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "-"


def git_commit(*paths: str) -> str | None:
    """The last commit that changed ``paths`` (the measured code), with "-dirty" when they have uncommitted changes;
    None outside a git checkout. Not HEAD: committing results must not orphan it."""
    code = ["--", *paths]
    try:
        last = subprocess.run(["git", "log", "-1", "--format=%H", *code], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", *code], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return None
    if last.returncode != 0 or not last.stdout.strip():
        return None
    return last.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def own_settings(script: str, remove: bool = True) -> None:
    """A benchmark sets autooffload's settings itself: each ``AUTOOFFLOAD_*`` variable is said and (``remove``)
    taken out of the environment, so that none changes what is measured."""
    for key in [k for k in os.environ if k.startswith("AUTOOFFLOAD_")]:
        if remove:
            os.environ.pop(key)
        print(f"{script}: ignoring {key}: the benchmark sets its own settings", file=sys.stderr)
