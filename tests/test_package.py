"""The package as users get it: one version, the command that prints it, the public API's type hints (mypy over
``[tool.mypy]`` in pyproject.toml, with tests/typecheck_public_api.py as a user's typed code), a changelog entry for
the version, each environment of ./dev test exactly as its lock pins it, and the docs' table of releases generated from
the locks (``./dev versions``). The wheel itself is built and installed into a clean environment by ``./dev test``
(``./dev wheel``), outside pytest."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from releases import ENVIRONMENTS, LOCKS, documented_table, lock_lines, row, table

import autooffload

ROOT = Path(__file__).resolve().parent.parent


def run(*command: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_version_is_written_once():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in config["project"] and config["project"]["dynamic"] == ["version"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "autooffload.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+)?", autooffload.__version__)


def test_the_license_is_the_spdx_string_the_build_backend_reads():
    """setuptools 77 reads ``license = "Apache-2.0"`` (PEP 639) and warns that the old table form stops building in
    2027; the build must ask for a setuptools that reads the string."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert config["project"]["license"] == "Apache-2.0"
    assert config["build-system"]["requires"] == ["setuptools>=77"]


def test_the_command_prints_the_version():
    result = run(sys.executable, "-m", "autooffload", "--version", timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"autooffload {autooffload.__version__}\n"


# The command in a fresh process, then what it imported: --help, --version and estimate are arithmetic and text, and
# importing torch and transformers alone took ~8 s of every call (issue 54).
IMPORTED = """
import sys
from autooffload.__main__ import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(sorted(name for name in ("torch", "transformers") if name in sys.modules))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["estimate", "--help"],
        ["estimate", "--layers", "36", "--hidden", "4096", "--seq", "32768", "--device-memory", "80"],
        ["estimate", "--layers", "36", "--hidden", "4096", "--seq", "0"],
    ],
)
def test_the_quick_commands_import_neither_torch_nor_transformers(argv):
    result = run(sys.executable, "-c", IMPORTED, *argv, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]", result.stdout[-500:]


def test_the_changelog_says_what_this_version_changed():
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"(?m)^## (\S+)", changelog)
    release = re.sub(r"\.dev\d+$", "", autooffload.__version__)  # a development version: the release it leads to
    assert release in headings, headings


def test_py_typed_ships_with_the_package():
    assert (ROOT / "autooffload" / "py.typed").is_file()
    assert 'autooffload = ["py.typed"]' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (./dev has it in .venv)")
def test_the_public_api_type_checks():
    result = run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert result.stdout.startswith("Success: no issues found")


def test_the_docs_table_of_releases_is_the_locks():
    """docs/coverage.md's table is generated from requirements/ (``python tests/releases.py --write-docs``)."""
    assert documented_table((ROOT / "docs" / "coverage.md").read_text(encoding="utf-8")) == table()


@pytest.mark.skipif(Path(sys.prefix).name not in LOCKS, reason="not one of ./dev test's locked environments")
def test_this_environment_holds_exactly_what_its_lock_pins():
    """./dev test installs every release from its lock: nothing published since moves a test (a package the lock
    lacks would move with every release). An environment made before the lock moved: remove it, ./dev remakes it."""
    lock = ROOT / LOCKS[Path(sys.prefix).name]
    pinned = [line for line in lock.read_text(encoding="utf-8").splitlines() if not line.startswith("#")]
    installed = lock_lines()
    assert installed == pinned, {
        "installed, not as pinned": sorted(set(installed) - set(pinned)),
        "pinned, not installed": sorted(set(pinned) - set(installed)),
    }


@pytest.mark.skipif(Path(sys.prefix).name not in ENVIRONMENTS, reason="not one of ./dev's environments")
def test_the_docs_name_the_releases_this_environment_holds():
    # ./dev versions prints this row; docs/coverage.md's table (from the locks) holds it.
    expected = row(Path(sys.prefix).name)
    name = expected.split(" | ")[0]
    documented = [line for line in table().splitlines() if line.startswith(name + " |")]
    assert documented == [expected], f"the locks pin {documented}; ./dev versions prints {expected}"
