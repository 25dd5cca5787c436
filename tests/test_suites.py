"""``./dev test``'s two suites share the benchmarks' quick runs (tests/conftest.py): a test marked ``one_suite`` runs
in the suite it names and is skipped, with the reason, in the other; a mark or a ``DEV_SUITE`` that names neither
suite would skip it in both, so either stops the run with a usage error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOAK = "tests/test_soak_bench.py::test_a_short_soak_writes_its_results"  # marked for the oldest suite


def pytest_run(suite: str, *args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEV_SUITE": suite, **env}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_a_test_marked_for_the_other_suite_is_skipped_with_its_reason_and_runs_in_its_own():
    result = pytest_run("newest", SOAK)
    assert result.returncode == 0 and "1 skipped" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    assert "./dev test runs it in its oldest suite" in result.stdout
    for suite in ("oldest", ""):  # its own suite, and any run outside ./dev test: set up, not skipped
        result = pytest_run(suite, "--setup-only", SOAK)
        assert result.returncode == 0 and "skipped" not in result.stdout, result.stdout[-2000:]
        assert "SETUP    F tmp_path" in result.stdout, result.stdout[-2000:]


def test_a_mark_or_a_dev_suite_naming_neither_suite_stops_the_run(tmp_path):
    """Before: ``one_suite('neweset')`` (or one in single quotes, unseen by a search of the sources) was skipped in
    both suites, and ``DEV_SUITE=Newest`` skipped every marked test."""
    (tmp_path / "test_marked.py").write_text(
        "import pytest\n\n\n@pytest.mark.one_suite('neweset')\ndef test_typo():\n    pass\n\n\n"
        "@pytest.mark.one_suite('newest')\nclass TestRight:\n    def test_right(self):\n        pass\n"
    )
    with_conftest = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    result = pytest_run("newest", "-p", "conftest", "test_marked.py", cwd=tmp_path, **with_conftest)  # any run
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    assert "test_marked.py::test_typo is marked one_suite('neweset')" in result.stderr, result.stderr[-2000:]
    (tmp_path / "test_marked.py").write_text((tmp_path / "test_marked.py").read_text().replace("neweset", "oldest"))
    result = pytest_run("Newest", "-p", "conftest", "test_marked.py", cwd=tmp_path, **with_conftest)
    assert result.returncode == 4 and "DEV_SUITE='Newest'" in result.stderr, result.stdout[-2000:] + result.stderr
    result = pytest_run("newest", "-p", "conftest", "test_marked.py", cwd=tmp_path, **with_conftest)
    assert result.returncode == 0 and "1 passed, 1 skipped" in result.stdout, result.stdout[-2000:]
