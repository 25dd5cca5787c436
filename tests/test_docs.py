"""The documentation cannot go stale: its examples run, its links resolve, every warning has its section.

Examples: every fenced ```python and ```bash block in README.md and docs/*.md runs, a page's blocks in order
(a later block may use what an earlier one wrote), each in a fresh process from the repository root with this
checkout first on the path, with the page's paths under /tmp/ moved into a folder of the test's own (the two suites of
./dev test run side by side). Two HTML comments on the line before a fence, invisible on a code host, change
that: ``<!-- not-run: why -->`` (installs, long runs, a GPU) and ``<!-- needs: transformers>=5.23 -->`` (any
package: skipped where it is absent or older). Other languages (```text, ```json) are output and are not run.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

from autooffload.warn import ANCHORS, TROUBLESHOOTING, doc_link

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*(not-run|needs):\s*(.*?)\s*-->\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


@dataclasses.dataclass
class Block:
    page: Path
    line: int
    language: str
    code: str
    marker: tuple[str, str] | None


def blocks(page: Path) -> list[Block]:
    found, lines = [], page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        found.append(
            Block(page, i + 1, match.group(1), "\n".join(lines[i + 1 : end]) + "\n", marker and marker.groups())
        )
        i = end + 1
    return found


def runnable(block: Block) -> bool:
    return block.language in ("python", "bash") and (block.marker is None or block.marker[0] != "not-run")


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOOFFLOAD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    return env


def _needs_met(block: Block) -> bool:
    """``<!-- needs: PACKAGE>=VERSION -->``: run only where that release or a later one is installed."""
    if block.marker is None or block.marker[0] != "needs":
        return True
    name, minimum = (part.strip() for part in block.marker[1].split(">="))
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return Version(installed) >= Version(minimum)


def _slug(heading: str) -> str:
    """The anchor a code host gives a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("#")}


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


# Collected once: a page with nothing to run here is no test case (it would skip in every run), and an example
# whose release is not installed here is a case of its own that says so, next to its page's case.
RUN_HERE = [page for page in PAGES if any(runnable(b) and _needs_met(b) for b in blocks(page))]
NOT_HERE = [b for page in PAGES for b in blocks(page) if runnable(b) and not _needs_met(b)]


@pytest.mark.parametrize("page", RUN_HERE, ids=_name)
def test_every_example_on_the_page_runs(page, tmp_path):
    for block in filter(runnable, blocks(page)):
        if not _needs_met(block):
            continue  # test_an_example_for_other_releases_says_it_did_not_run_here
        code = block.code.replace("/tmp/", f"{tmp_path}/")  # the page's own /tmp: ./dev test runs two suites at once
        command = [sys.executable, "-c", code]
        if block.language == "bash":
            command = ["bash", "-euo", "pipefail", "-c", code]
        done = subprocess.run(command, cwd=ROOT, env=_environment(), capture_output=True, text=True, timeout=600)
        where = f"{_name(page)}:{block.line} ({block.language})"
        assert done.returncode == 0, (
            f"{where} failed:\n{block.code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        )


@pytest.mark.parametrize("block", NOT_HERE, ids=lambda b: f"{_name(b.page)}:{b.line}")
def test_an_example_for_other_releases_says_it_did_not_run_here(block):
    name = block.marker[1].split(">=")[0].strip()
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        installed = "none"
    pytest.skip(f"{_name(block.page)}:{block.line} needs {block.marker[1]}; installed here: {installed}")


def test_every_skipped_example_says_why():
    for page in PAGES:
        for block in blocks(page):
            if block.marker is not None:
                assert block.marker[1], f"{page.name}:{block.line}: a marker without a reason"
            assert block.language, f"{page.name}:{block.line}: a fence without a language (python, bash, text, ...)"


def test_long_commands_are_not_run():
    """./dev, the sweep and the GPU check take minutes to hours: their blocks must be marked not-run."""
    slow = re.compile(
        r"\./dev |gpu_check\.py|conformance\.py|benchmarks\.conformance|bench\.py|ladder\.py|simulate\.py|pip install"
    )
    for page in PAGES:
        for block in filter(runnable, blocks(page)):
            assert not slow.search(block.code), f"{page.name}:{block.line}: mark this block <!-- not-run: why -->"


def test_relative_links_and_anchors_resolve():
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for match in LINK.finditer(text):
            target = match.group(1) or match.group(2)
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            assert resolved.exists(), f"{page.relative_to(ROOT)}: link to {target}: no such file"
            if anchor and resolved.suffix == ".md":
                assert anchor in anchors(resolved), f"{page.relative_to(ROOT)}: link to {target}: no such heading"


def test_files_named_in_the_docs_exist():
    """Paths in backticks (`autooffload/...`, `benchmarks/...`, `tests/...`, `examples/...`) name real files
    and folders (a folder ends with "/")."""
    top = "autooffload|benchmarks|tests|examples|docs"
    named = re.compile(rf"`((?:{top})/(?:[\w./-]+\.(?:py|md|txt|png|json)|[\w./-]*/))`")
    for page in PAGES:
        for path in named.findall(page.read_text(encoding="utf-8")):
            assert (ROOT / path).exists(), f"{page.relative_to(ROOT)} names {path}, which does not exist"


def _warning_keys() -> set[str]:
    """Every key autooffload warns with: the first argument of a ``warn(...)`` or ``WarnOnce()(...)`` call, and the
    keys ``apply/paths.py`` hands back with its messages (the part before ":" of keys that name a module)."""
    keys = set()
    for path in (ROOT / "autooffload").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            first = None
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                of_warnings = isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "warnings"
                fresh = isinstance(func, ast.Call) and getattr(func.func, "id", "") == "WarnOnce"  # WarnOnce()(key)
                returned = path.name == "paths.py" and name == "append" and isinstance(node.args[0], ast.Tuple)
                if (name == "warn" and not of_warnings) or fresh or returned:
                    first = node.args[0].elts[0] if isinstance(node.args[0], ast.Tuple) else node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                keys.add(first.value.split(":")[0])
            elif isinstance(first, ast.JoinedStr) and isinstance(first.values[0], ast.Constant):
                keys.add(str(first.values[0].value).split(":")[0])
    return keys


def test_every_warning_names_a_section_of_troubleshooting_that_exists():
    keys = _warning_keys()
    found = {"no-probe", "container-calls", "unknown", "offload-wrapper", "host-budget", "rescue-off"}
    found |= {"axolotl-offloading"}  # raised as WarnOnce()(key, ...), not through a warn attribute
    assert found <= keys, f"the key finder misses {sorted(found - keys)}"
    sections = anchors(ROOT / TROUBLESHOOTING)
    missing = sorted(key for key in keys if doc_link(key) is None)
    assert not missing, f"warning keys without a section in {TROUBLESHOOTING}: add them to warn.ANCHORS: {missing}"
    broken = sorted(f"{key} -> {anchor}" for key, anchor in ANCHORS.items() if anchor not in sections)
    assert not broken, f"anchors missing from {TROUBLESHOOTING}: {broken}"


def test_a_warning_ends_with_its_section(recwarn):
    from autooffload.warn import AutoOffloadWarning, WarnOnce

    warn = WarnOnce()
    assert warn("container-calls:model.layers", "too many calls")
    assert not warn("container-calls:model.layers", "too many calls")
    warn("a-key-without-a-section", "plain")
    messages = [str(w.message) for w in recwarn.list if w.category is AutoOffloadWarning]
    assert messages == [
        "autooffload: too many calls (see docs/troubleshooting.md#container-calls)",
        "autooffload: plain",
    ]


@pytest.mark.parametrize("page", ["README.md", "docs/settings.md"])
def test_the_settings_tables_list_every_setting_with_its_default(page):
    """A settings table has one row per setting, and its default, read as the variable, is the default (a low
    threshold's: the value it takes from its high one's default)."""
    from autooffload.settings import ENV_PREFIX, Settings

    text = (ROOT / page).read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(AUTOOFFLOAD_\w+)` \| `([^`]*)` \|", text, flags=re.M)
    fields = {ENV_PREFIX + field.name.upper(): field.name for field in dataclasses.fields(Settings)}
    assert sorted(name for name, _ in rows) == sorted(fields), f"{page}'s settings table: one row per setting"
    defaults = Settings()
    for name, shown in rows:
        field = fields[name]
        assert getattr(Settings.from_env({name: shown}), field) == getattr(defaults, field), f"{page}: {name}={shown}"
