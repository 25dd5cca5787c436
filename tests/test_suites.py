"""``./dev test``'s two suites share the benchmarks' quick runs (tests/conftest.py): a test marked ``one_suite`` runs
in the suite it names and is skipped, with the reason, in the other; a name that is neither suite's would skip it in
both, so none may."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOAK = "tests/test_soak_bench.py::test_a_short_soak_writes_its_results"  # marked for the oldest suite


def pytest_run(suite: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEV_SUITE": suite}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_test_marked_for_the_other_suite_is_skipped_with_its_reason():
    result = pytest_run("newest", SOAK)
    assert result.returncode == 0 and "1 skipped" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    assert "./dev test runs it in its oldest suite" in result.stdout


def test_every_mark_names_one_of_the_two_suites():
    names = [
        name
        for path in (ROOT / "tests").glob("test_*.py")
        for name in re.findall(r"one_suite\(\"([^\"]*)\"\)", path.read_text())
    ]
    assert {"newest", "oldest"} <= set(names) <= {"newest", "oldest"}, names
