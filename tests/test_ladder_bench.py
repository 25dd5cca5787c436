"""benchmarks/ladder.py runs end to end (tiny model, one round) and its budgets hold: autooffload's steps never
pass the budget (warm-up included, beyond what always's first long step does), and each scenario's budget is the
one it claims (none does not fit in (b), plain not in (c)); autocast, two forwards per backward and a hybrid stack
stay within it too. The budget is the step's real peak (the allocator's, backward included): there the keep
model, which plans what a kept layer saves, finds room in (a), (b) and (d) but not in (e) and (f), whose rooms are
sized from real readings (docs/ladder.md)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ladder_bench", ROOT / "benchmarks" / "ladder.py")
ladder_bench = sys.modules["ladder_bench"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ladder_bench)


def test_quick_run_writes_results_and_the_budgets_hold(tmp_path):
    assert ladder_bench.main(["--out", str(tmp_path), "--quick", "--scenario", *"abcdef"]) == 0
    data = json.loads((tmp_path / "ladder.json").read_text())
    results = {r["scenario"]: r for r in data["results"]}
    assert set(results) == set("abcdef") and "| a | auto |" in (tmp_path / "ladder.md").read_text()
    for result in results.values():
        assert result["safe"], result["scenario"]
    assert results["a"]["modes"]["auto"]["kept"] == 1.0
    assert results["b"]["modes"]["none"]["steps_over_budget"] > 0
    assert 0 < results["b"]["modes"]["auto"]["kept"] < 1
    assert results["c"]["modes"]["plain"]["steps_over_budget"] > 0
    assert results["c"]["modes"]["auto"]["offloaded"] > 0 and results["c"]["modes"]["auto"]["kept"] == 0
    assert results["d"]["modes"]["auto"]["kept"] > 0
