"""The conformance counts the README and the coverage page state are those of the sweep's table they link.

The sweep (``python -m benchmarks.conformance``) writes ``conformance.json`` next to its table; a page that links a
table must state that table's counts, and the size of the suite's subset must be the subset's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import test_conformance

ROOT = Path(__file__).resolve().parents[1]

TABLE = re.compile(r"benchmarks/results/([^/)\s]+)/conformance\.md")
PHRASES = {
    "correct": "{} correct",
    "plain-with-warning": "{} plain with one warning",
    "wrong": "{} wrong",
    "crash": "{} crash",
    "skipped": "{} skipped",
}


@pytest.mark.parametrize("page", ["README.md", "docs/coverage.md"])
def test_a_page_states_the_counts_of_the_table_it_links(page):
    text = (ROOT / page).read_text()
    linked = TABLE.findall(text)
    assert linked, f"{page} links no conformance table"
    counts = json.loads((ROOT / "benchmarks" / "results" / linked[-1] / "conformance.json").read_text())["counts"]
    flat = " ".join(text.split())
    missing = [PHRASES[k].format(v) for k, v in counts.items() if PHRASES[k].format(v) not in flat]
    assert not missing, f"{page} links {linked[-1]} but does not say: {missing}"


def test_the_pages_name_the_subset_the_suite_runs():
    size = len(test_conformance.SUBSET) + len(test_conformance.QUIRKS_SUBSET) + len(test_conformance.MEDIA_SUBSET)
    for page in ("docs/coverage.md", "docs/conformance.md"):
        flat = " ".join((ROOT / page).read_text().split())
        assert f"subset of {size} types" in flat, page
