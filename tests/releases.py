"""The releases the suite runs against: what ``./dev`` installs (the lock files in requirements/), what an
environment holds, and the table docs/coverage.md shows, generated from the locks.

``./dev test`` installs every package of its two environments at the release its lock pins
(``requirements/newest.txt``, ``requirements/oldest.txt``), so a release published elsewhere changes nothing until
``./dev test-newest`` adopts it, in a change of its own. tests/test_package.py fails where an environment differs
from its lock or the docs' table from the locks.

``python tests/releases.py ENV`` prints ENV's row as it is installed (``./dev versions``);
``python tests/releases.py --table`` prints the table from the locks; ``--write-docs`` writes it into the docs;
``--lock FILE`` writes this environment's releases to FILE as a lock, keeping FILE's comment lines."""

from __future__ import annotations

import re
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELEASES = ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "lightning")
# ./dev's environments, as the docs' table names them, and the lock each installs from.
ENVIRONMENTS = {
    ".venv": "newest (`./dev test`)",
    ".venv-oldest": "oldest (`./dev test`)",
    ".venv-newest-torch": "newest torch (`./dev test-newest-torch`)",
}
LOCKS = {".venv": "requirements/newest.txt", ".venv-oldest": "requirements/oldest.txt"}
# The newest-torch environment installs the newest lock with requirements/newest-torch.txt's torch instead.
NEWEST_TORCH = "requirements/newest-torch.txt"
DOCS = ROOT / "docs" / "coverage.md"
HEADER = "| run | " + " | ".join(RELEASES) + " |"
# What a lock leaves out: the package itself, and the installer (./dev's pip is the interpreter's).
UNLOCKED = {"autooffload", "pip"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def release(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def releases() -> str:
    """``torch 2.13.0+cpu, transformers 5.24.0, ...`` ("absent" where a package is not installed)."""
    return ", ".join(f"{name} {release(name) or 'absent'}" for name in RELEASES)


def read_pins(path: Path) -> dict[str, str]:
    """A requirements file's ``name==version`` lines, by canonical name (comments and blank lines skipped)."""
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = version.strip()
    return pins


def locked(environment: str) -> dict[str, str]:
    """What ./dev installs into ``environment`` (``.venv``, ...): its lock's pins ({} for an environment without)."""
    if environment == ".venv-newest-torch":
        return {**read_pins(ROOT / LOCKS[".venv"]), **read_pins(ROOT / NEWEST_TORCH)}
    return read_pins(ROOT / LOCKS[environment]) if environment in LOCKS else {}


def cells(environment: str, versions: dict[str, str | None]) -> str:
    return (
        "| "
        + " | ".join([ENVIRONMENTS.get(environment, environment)] + [versions.get(n) or "none" for n in RELEASES])
        + " |"
    )


def row(environment: str) -> str:
    """This environment's row of the docs' table, as installed: its name, then each release ("none" where absent)."""
    return cells(environment.rstrip("/"), {name: release(name) for name in RELEASES})


def table() -> str:
    """The docs' table, from the locks: one row for each environment ./dev makes."""
    rows = [cells(env, {name: locked(env).get(canonical(name)) for name in RELEASES}) for env in ENVIRONMENTS]
    return "\n".join([HEADER, "|" + "---|" * (len(RELEASES) + 1), *rows])


def documented_table(text: str) -> str:
    """The table in the docs: the header line and the lines that follow it."""
    lines = text.splitlines()
    start = lines.index(HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[start:end])


def write_docs() -> None:
    text = DOCS.read_text(encoding="utf-8")
    DOCS.write_text(text.replace(documented_table(text), table()), encoding="utf-8")


def lock_lines() -> list[str]:
    """This environment's installed distributions as ``name==version`` lines, sorted (autooffload and pip left out):
    those in its own site-packages, not those a path added at run time holds (the testers' own test dependencies)."""
    site = sorted({sysconfig.get_paths()[key] for key in ("purelib", "platlib")})
    found = metadata.distributions(path=site)
    installed = {canonical(d.metadata["Name"]): d.version for d in found if d.metadata["Name"]}
    return [f"{name}=={version}" for name, version in sorted(installed.items()) if name not in UNLOCKED]


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments == ["--table"]:
        print(table())
    elif arguments == ["--write-docs"]:
        write_docs()
    elif len(arguments) == 2 and arguments[0] == "--lock":
        path = Path(arguments[1])
        old = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        comment = [line for line in old if line.startswith("#")]
        path.write_text("\n".join([*comment, *lock_lines()]) + "\n", encoding="utf-8")
    else:
        print(row(arguments[0] if arguments else sys.prefix))
