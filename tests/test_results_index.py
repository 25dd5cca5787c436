"""benchmarks/results/INDEX.md cannot drift: it is what ``python benchmarks/index.py`` writes from runs.toml, every
results folder has one table in runs.toml and every table a folder, and a ``superseded_by`` names a folder. And,
as a report for the pages' editors, which links from README.md and docs/benchmarks.md land on a run a later one
superseded without the line saying so. And results are data, probes are code: a results folder holds outputs and a
README naming the command, the commit and the releases, never a script (those live in benchmarks/probes/, each naming
the folder it produced). No torch here: the index is text."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("results_index", ROOT / "benchmarks" / "index.py")
index = sys.modules["results_index"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(index)

RUNS = index.load()
PRESENT = index.folders()
PAGES = ("README.md", "docs/benchmarks.md")
# A link into benchmarks/results/<folder>/, from the repository root or from docs/.
LINK = re.compile(r"\]\((?:\.\./)?benchmarks/results/([^/)#]+)")
# Words on a line that say its numbers are from an earlier run or older code.
CODE = ("*.py", "*.sh", "*.ipynb")
# What a run's README names, anywhere in it: the command (in backticks, wrapped or not), a commit and the releases,
# each or "not recorded" where nothing recorded it.
COMMAND = re.compile(r"`[^`]*\bpython3?\s[^`]*`")
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b|not recorded")
TORCH = re.compile(r"\btorch\s+\d|not recorded")
TRANSFORMERS = re.compile(r"\btransformers\s+\d|not recorded")
PROBES = ROOT / "benchmarks" / "probes"
SAYS_EARLIER = re.compile(r"earlier|older|previous|superseded|first day|first run|before (?:the|its|issue)", re.I)


def test_index_is_what_the_generator_writes():
    assert index.INDEX.read_text(encoding="utf-8") == index.render(RUNS), (
        "benchmarks/results/INDEX.md is stale: run `python benchmarks/index.py`"
    )


def test_every_results_folder_has_a_table():
    assert sorted(PRESENT - RUNS.keys()) == [], "add a table for each to benchmarks/results/runs.toml"


def test_every_table_names_a_folder():
    assert sorted(RUNS.keys() - PRESENT) == []


def test_every_superseded_by_names_a_folder():
    missing = {
        name: run["superseded_by"] for name, run in RUNS.items() if run.get("superseded_by", name) not in PRESENT
    }
    assert missing == {}


def test_runs_toml_has_no_problem():
    assert index.problems(RUNS, PRESENT) == []
    assert index.main(["--check"]) == 0


def test_the_checks_catch_what_they_promise(tmp_path, monkeypatch, capsys):
    run = {"question": "q", "machine": "CPU", "commit": "abc1234", "releases": "unrecorded", "script": "s"}
    runs = {"2026-01-01-a": {**run, "superseded_by": "2026-01-02-gone"}, "2026-01-01-b": run}
    found = index.problems(runs, {"2026-01-01-a", "2026-01-03-new"})
    assert found == [
        "2026-01-03-new: a results folder with no table in runs.toml",
        "2026-01-01-b: a table in runs.toml with no folder",
        "2026-01-01-a: superseded_by names no folder: 2026-01-02-gone",
    ]
    circle = {
        "2026-01-01-a": {**run, "superseded_by": "2026-01-01-b"},
        "2026-01-01-b": {**run, "superseded_by": "2026-01-01-a"},
    }
    assert "circle" in index.problems(circle, set(circle))[0]
    assert index.problems({"2026-01-01-a": {**run, "commit": ""}}, {"2026-01-01-a"}) == ["2026-01-01-a: no `commit`"]

    stale = tmp_path / "INDEX.md"
    stale.write_text(index.render(RUNS).replace("**current**", "current", 1), encoding="utf-8")
    monkeypatch.setattr(index, "INDEX", stale)
    assert index.main(["--check"]) == 1
    assert "INDEX.md is stale" in capsys.readouterr().err


def superseded_links() -> list[str]:
    """Each link from the pages into a superseded run's folder where neither its line nor the one before says the run
    is an earlier one."""
    found = []
    for page in PAGES:
        lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            beside = lines[number - 2] + " " + line if number > 1 else line  # a claim may wrap onto this line
            for folder in dict.fromkeys(LINK.findall(line)):
                if RUNS.get(folder, {}).get("superseded_by") and not SAYS_EARLIER.search(beside):
                    found.append(f"{page}:{number}: {folder} (now {index.current(RUNS, folder)})")
    return found


def test_the_pages_link_current_runs_or_say_the_run_is_earlier():
    assert superseded_links() == []


def folder_problems(results: Path) -> list[str]:
    """What keeps a run folder under ``results`` from being data a reader can trust: code in it, or a README.md
    missing, or one that names no command, commit or releases."""
    found = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        code = sorted({str(f.relative_to(results)) for pattern in CODE for f in folder.rglob(pattern)})
        found += [f"{name}: code in a results folder (a probe belongs in benchmarks/probes/)" for name in code]
        readme = folder / "README.md"
        if not readme.exists():
            found.append(f"{folder.name}: no README.md")
            continue
        text = readme.read_text(encoding="utf-8")
        named = {"command": COMMAND, "commit": COMMIT, "torch release": TORCH, "transformers release": TRANSFORMERS}
        found += [f"{folder.name}/README.md names no {what}" for what, rx in named.items() if not rx.search(text)]
    return found


def test_results_folders_hold_outputs_and_a_readme_naming_the_run():
    assert folder_problems(index.RESULTS) == []


def test_the_folder_check_catches_code_and_a_readme_that_names_nothing(tmp_path):
    complete = "`python benchmarks/x.py --out DIR` at abc1234, torch 2.13.0, transformers 5.25.0\n"
    for name, files in {
        "2026-01-01-ok": {"README.md": complete, "x.json": "{}"},
        "2026-01-02-probe": {"README.md": complete, "sub/probe.py": "", "run.sh": ""},
        "2026-01-03-bare": {"x.md": ""},
        "2026-01-04-prose": {"README.md": "Made by x.py; commit not recorded."},
    }.items():
        for file, text in files.items():
            (tmp_path / name / file).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / file).write_text(text)
    assert folder_problems(tmp_path) == [
        "2026-01-02-probe/run.sh: code in a results folder (a probe belongs in benchmarks/probes/)",
        "2026-01-02-probe/sub/probe.py: code in a results folder (a probe belongs in benchmarks/probes/)",
        "2026-01-03-bare: no README.md",
        "2026-01-04-prose/README.md names no command",
    ]


def test_each_probe_names_its_question_its_results_and_its_command():
    """A probe's docstring is where a reader arrives from a results folder: it names the folder it produced (one
    that exists) and the command that reruns it from the checkout."""
    probes = sorted(p for p in PROBES.glob("*.py") if p.name != "__init__.py")
    assert probes
    for path in probes:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        assert f"python benchmarks/probes/{path.name}" in doc, f"{path.name}: no command in its docstring"
        folders = re.findall(r"benchmarks/results/([^/\s)]+)/", doc)
        assert folders and all(f in PRESENT for f in folders), f"{path.name}: names no results folder that exists"
