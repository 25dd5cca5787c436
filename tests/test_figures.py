"""A figure the docs quote beside a link to benchmark results is in those results, so a page cannot drift.

A page quotes a result as a sentence, list item or table row that links to a folder under `benchmarks/results/`
(a table with no link of its own takes the links of the paragraph just above it). Every number in that passage
must be found in the Markdown or JSON files of the linked folders: the same number, or a more precise one that
rounds to it (1.0393 for 1.039; bytes for a size in GiB, MiB or GB; a fraction for a percentage; seconds for
milliseconds). What is not a figure is left out before numbers are read: code spans (settings, paths, commands),
link targets, dates, releases (`5.25.0`, "torch 2.11", "Python >= 3.10"), "issue 10", names with digits in them
(H200, bf16, Qwen3-8B, ZeRO-3, 32k) and exponents (4e-6).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = "benchmarks/results/"

LINK = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")
CODE = re.compile(r"`[^`]*`")
NOT_FIGURES = [
    re.compile(r"<!--.*?-->"),
    re.compile(r"\b\d{4}-\d{2}-\d{2}(?:T[\d:+.]+)?"),  # dates
    re.compile(r"\b\d+\.\d+\.\d+\S*"),  # releases: 5.25.0, 2.13.0+cpu
    re.compile(
        r"\b(?:torch|transformers|TRL|trl|PEFT|peft|accelerate|DeepSpeed|deepspeed|Lightning|lightning|Python|CUDA|"
        r"setuptools|pip|LLaMA-Factory|axolotl)\s*(?:[<>=]=?\s*)?\d+(?:\.\d+)*",
    ),
    re.compile(r"\b[Ii]ssues? \d+"),
    re.compile(r"\d+(?:\.\d+)?e-?\d+"),  # exponents
    re.compile(r"\^\d+"),  # powers: 2^30
]
# A number that stands alone (not inside a name such as H200 or ZeRO-3), with the unit written after it.
FIGURE = re.compile(
    r"(?<![\w.^/-])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![\w.,]*\d)"
    r"(x|%|ms\b|s\b|\s(?:GiB|MiB|KiB|GB|MB|ms|s)\b)?(?!\w)"
)
SCALES = {"%": (100.0,), "ms": (1000.0,), "GiB": (2.0**-30,), "MiB": (2.0**-20,), "KiB": (2.0**-10,)}
SCALES |= {"GB": (1e-9,), "MB": (1e-6,)}
NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Figure:
    text: str
    value: float
    decimals: int
    unit: str


@dataclass
class Passage:
    page: Path
    line: int
    text: str
    links: list[str]


def figures(text: str) -> list[Figure]:
    """The numbers a passage quotes as figures (module docs)."""
    text = LINK.sub(lambda m: m.group(1), CODE.sub(" ", text))
    for pattern in NOT_FIGURES:
        text = pattern.sub(" ", text)
    text = re.sub(r"(?<=\d)-(?=\d)", " - ", text)  # ranges: 4-25% quotes 4 and 25
    found = []
    for match in FIGURE.finditer(text):
        whole, fraction, unit = match.group(1), match.group(2) or "", (match.group(3) or "").strip()
        value = float(whole.replace(",", "") + fraction)
        found.append(Figure(match.group(0).strip(), value, max(len(fraction) - 1, 0), unit))
    return found


def passages(page: Path) -> list[Passage]:
    """Paragraphs, list items and table rows outside code fences, with the links each carries; a table row without
    a link carries those of the paragraph above its table."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Passage] = []
    fenced, above, current = False, [], None
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced, current = not fenced, None
            continue
        if fenced:
            continue
        if not line.strip() or line.startswith("#"):
            current = None
            if line.startswith("#"):
                above = []
            continue
        links = [target for _, target in LINK.findall(line)]
        if line.startswith("|"):
            current = None
            found.append(Passage(page, number, line, links or above))
            continue
        starts_item = re.match(r"\s*[-*] ", line) is not None
        if current is None or starts_item:
            current = Passage(page, number, line, links)
            found.append(current)
        else:
            current.text += " " + line
            current.links += links
        above = current.links
    return found


def sources(passage: Passage) -> list[Path]:
    """The results a passage links to: a Markdown or JSON file and the file of the same name beside it
    (`gpu_check.md` and `gpu_check.json`); a folder or its README.md stands for every such file in the folder."""
    found: list[Path] = []
    for target in passage.links:
        path = (passage.page.parent / target.partition("#")[0]).resolve()
        if RESULTS not in path.as_posix() or not path.exists():
            continue
        if path.is_dir() or path.name == "README.md":
            folder = path if path.is_dir() else path.parent
            files = [*folder.glob("*.md"), *folder.glob("*.json")]
        else:
            files = [path.with_suffix(".md"), path.with_suffix(".json")]
        found += [file for file in sorted(files) if file.exists() and file not in found]
    return found


def numbers_in(path: Path, cache: dict[Path, list[float]]) -> list[float]:
    if path not in cache:
        text = path.read_text(encoding="utf-8")
        numbers = _json_numbers(json.loads(text)) if path.suffix == ".json" else _text_numbers(text)
        cache[path] = sorted(set(numbers))
    return cache[path]


def _text_numbers(text: str) -> list[float]:
    return [float(n.replace(",", "")) for n in NUMBER.findall(text)]


def _json_numbers(value: object) -> list[float]:
    """The numbers a JSON value holds, in its keys and strings too; a list of bare numbers (per-step samples, which
    a page summarises and does not quote) is left out, as it would match most figures by chance."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [abs(float(value))]
    if isinstance(value, str):
        return _text_numbers(value)
    if isinstance(value, dict):
        return [n for key, item in value.items() for n in (*_text_numbers(key), *_json_numbers(item))]
    if isinstance(value, list) and not all(isinstance(item, (int, float)) for item in value):
        return [n for item in value for n in _json_numbers(item)]
    return []


def matches(figure: Figure, values: list[float]) -> bool:
    scales = (1.0, *SCALES.get(figure.unit, ()))
    return any(round(value * scale, figure.decimals) == figure.value for value in values for scale in scales)


def drift(pages: list[Path]) -> list[str]:
    """Every figure quoted beside a results link that its results do not hold, as ``page:line: figure``."""
    cache: dict[Path, list[float]] = {}
    missing = []
    for page in pages:
        for passage in passages(page):
            files = sources(passage)
            if not files:
                continue
            values = [v for file in files for v in numbers_in(file, cache)]
            for figure in figures(passage.text):
                if not matches(figure, values):
                    names = ", ".join(sorted({f"{file.parent.name}/{file.stem}" for file in files}))
                    where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
                    missing.append(f"{where}:{passage.line}: {figure.text!r} not in {names}")
    return missing


def test_every_figure_beside_a_results_link_is_in_those_results():
    missing = drift(PAGES)
    assert not missing, "figures the linked results do not hold:\n" + "\n".join(missing)


def test_a_changed_figure_is_caught_and_what_is_not_a_figure_is_not(tmp_path):
    folder = tmp_path / "benchmarks" / "results" / "2026-12-04-run"
    folder.mkdir(parents=True)
    (folder / "r.json").write_text(json.dumps({"ratio": 1.0531, "peak": 17197040640, "kept": 0.9, "steps": 3000}))
    (folder / "r.md").write_text("auto 1.053x, freed 3.50 of 3.50 GiB, +4.47%\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    link = "[run](../benchmarks/results/2026-12-04-run/r.md)"
    right = (
        "- On 2026-12-04 (torch 2.11, transformers 5.17.0, issue 41, an H200, bf16, ZeRO-3, 32k tokens,"
        " `seq_high=1024`, 4e-6): `auto` 1.053x and 1.05x, +4.47%, 3.50 GiB, a peak of 16.0 GiB and 17.20 GB,"
        f" 90% kept, 3000 steps {link}\n"
    )
    (docs / "right.md").write_text(right)
    assert drift([docs / "right.md"]) == []

    (docs / "wrong.md").write_text(right.replace("1.053x", "1.058x"))
    (docs / "table.md").write_text(f"Steps {link}:\n\n| mode | steps |\n|---|---|\n| auto | 3001 |\n")
    assert [line.split(": ", 1)[1] for line in drift([docs / "wrong.md", docs / "table.md"])] == [
        "'1.058x' not in 2026-12-04-run/r",
        "'3001' not in 2026-12-04-run/r",
    ]


@pytest.mark.parametrize(
    ("text", "quoted"),
    [
        ("4-25% of 349 rows", ["4", "25%", "349"]),
        ("Qwen3-8B at 32,768 tokens: 0.31-0.47 ms", ["32,768", "0.31", "0.47 ms"]),
        ("commit 05b1567, ff03c97 and d72c342; transformers 5.25.0, torch 2.13", []),
        ("[`2026-12-04-h200`](../benchmarks/results/2026-12-04-h200/gpu_check.md) at 2.08 s", ["2.08 s"]),
    ],
)
def test_what_counts_as_a_figure(text, quoted):
    assert [figure.text for figure in figures(text)] == quoted
