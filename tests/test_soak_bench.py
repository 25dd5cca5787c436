"""benchmarks/soak.py runs end to end (two configurations, a few dozen steps) and reads its runs right: one history
line per optimizer step, every sample taken, the keep rung keeping for short micro-batches, and under a host
budget every planned input moved. The soak itself (thousands of steps) is the script's, not the suite's."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("soak_bench", ROOT / "benchmarks" / "soak.py")
soak = sys.modules["soak_bench"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)


@pytest.mark.one_suite("oldest")
def test_a_short_soak_writes_its_results(tmp_path, monkeypatch):
    monkeypatch.setenv("SOAK_TMP", str(tmp_path))
    argv = ["--out", str(tmp_path / "out"), "--steps", "40", "--every", "10"]
    assert soak.main([*argv, "--config", "predictive-sync-auto", "budget-on-sync"]) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    results = {r["name"]: r for r in data["results"]}
    assert set(results) == {"predictive-sync-auto", "budget-on-sync"}
    for result in results.values():
        assert result["history_steps"] and [s["step"] for s in result["samples"]] == [10, 20, 30, 40]
        assert all(s["history_lines"] == 0 and s["controller_ms"] > 0 for s in result["samples"])
        assert set(result["trends"]) == set(soak.METRICS)
    assert sum(w["short_kept"] for w in results["predictive-sync-auto"]["windows"]) > 0
    budget = results["budget-on-sync"]
    assert sum(w["short_bytes"] for w in budget["windows"]) == 0 and budget["samples"][-1]["host_held_kib"] <= 256
    assert "| budget-on-sync | 40 |" in (tmp_path / "out" / "results.md").read_text()


def test_lengths_are_heavy_tailed_and_within_bounds():
    lengths = soak.lengths(4000)
    assert min(lengths) == 16 and max(lengths) == 512
    assert sorted(lengths)[len(lengths) // 2] < 40 and sum(n > 256 for n in lengths) > 40
