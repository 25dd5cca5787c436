"""benchmarks/simulate.py: the replay drives autooffload's own policies, meets its targets on the committed
trace, and calibrates from a measured results file of benchmarks/bench.py."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("simulate", ROOT / "benchmarks" / "simulate.py")
simulate = sys.modules["simulate"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(simulate)

OPTIONS = argparse.Namespace(seed=0, noise=0.03, micro_batches=1, bandwidth=25.0, flops=400.0)


def test_committed_trace_runs_every_policy():
    lengths = simulate.read_trace(simulate.FIXED_TRACE)
    assert len(lengths) == 1000 and max(lengths) == 32768
    result = simulate.compare(simulate.SCENARIOS["8b-lora-24gb"], "longtail", lengths, simulate.Calibration(), OPTIONS)
    rows = {row["policy"]: row for row in result["rows"]}
    assert rows["threshold"]["oom_steps"] > 0 and rows["never"]["oom_steps"] > rows["threshold"]["oom_steps"]
    assert rows["predictive"]["oom_steps"] == 0 and rows["oracle"]["oom_steps"] == 0
    assert rows["oracle"]["bytes"] <= rows["predictive"]["bytes"] < rows["threshold"]["bytes"]
    assert rows["threshold"]["distinct_levels"] == [0, 36] and rows["always"]["distinct_levels"] == [36]
    assert set(rows["predictive, compiled"]["distinct_levels"]) <= {0, 12, 24, 35, 36}


@pytest.mark.parametrize(
    "scenario, lengths",
    [
        ("8b-lora-24gb", simulate.bursty(1, 600)),
        ("8b-lora-24gb", simulate.packed(32768, 40)),
        ("32b-lora-80gb", simulate.packed(32768, 40)),
        ("8b-lora-80gb-logits", simulate.packed(8192, 40)),
    ],
    ids=["bursty", "pack-32k", "pack-32k-32b", "pack-8k-logits"],
)
def test_short_runs_meet_the_targets(scenario, lengths):
    """No out-of-memory step after step 0 where the oracle has none, at most 1.05x its bytes, at most one
    switch on a constant trace."""
    result = simulate.compare(simulate.SCENARIOS[scenario], "short", lengths, simulate.Calibration(), OPTIONS)
    assert all(result["target"].values()), result["target"]


def test_oracle_offloads_the_fewest_layers_that_fit():
    from simulation.policies import oracle_level

    model = simulate.MemoryModel(simulate.SCENARIOS["8b-lora-24gb"], simulate.Calibration())
    limit = 0.9 * model.total
    level = oracle_level(model, 20_000, 0.0, limit)
    assert model.peak(20_000, level) <= limit < model.peak(20_000, level - 1)
    # The last layer's input does not lower the peak at the start of the backward.
    assert model.peak(20_000, model.layers) == model.peak(20_000, model.layers - 1)


def test_calibration_from_measured_peaks(tmp_path):
    layers, hidden, c, work, freed = 4, 128, 128 * 2, 5000.0, 0.6
    estimate = (4 * hidden + 9 * hidden) * 2 + 1024 * (2 + 4)
    rows = []
    for seq in (1024, 2048, 4096):
        plain = 10**9 + seq * (layers * c + work)
        rows.append(dict(layers=layers, hidden=hidden, seq=seq, batch=1, mode="checkpointing", peak_bytes=plain))
        on = plain - freed * (layers - 1) * c * seq
        rows.append(dict(layers=layers, hidden=hidden, seq=seq, batch=1, mode="on", peak_bytes=on))
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"device": "cuda", "plan": {"dtype": "bf16", "vocab": 1024}, "rows": rows}))
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"device": "cpu", "plan": {}, "rows": rows}))
    calibration = simulate.calibrate([path, cpu, tmp_path / "missing.json"])
    assert calibration.work_scale == pytest.approx(work / estimate)
    assert calibration.freed_fraction == pytest.approx(freed)
    assert str(path) in calibration.source and str(cpu) not in calibration.source
    assert simulate.calibrate([cpu]) == simulate.Calibration()


def test_main_writes_table_json_and_plot(tmp_path):
    trace = tmp_path / "short.txt"
    trace.write_text("# a comment\n512\n30000\n1024\n28000\n")
    out = tmp_path / "out"
    assert (
        simulate.main(["--out", str(out), "--scenario", "8b-lora-24gb", "--trace", str(trace), "--seeds", "--packed"])
        == 0
    )
    data = json.loads((out / "simulate.json").read_text())
    assert [r["trace"] for r in data["results"]] == ["short"]
    assert [row["policy"] for row in data["results"][0]["rows"]] == list(simulate.POLICIES)
    assert "| 8b-lora-24gb | short | predictive |" in (out / "simulate.md").read_text()
    pytest.importorskip("matplotlib")
    assert (out / "simulate.png").stat().st_size > 0


def test_the_ladder_keeps_where_there_is_room_and_saves_recompute_time():
    lengths = simulate.read_trace(simulate.FIXED_TRACE)
    results = {
        name: simulate.compare(simulate.SCENARIOS[name], "longtail", lengths, simulate.Calibration(), OPTIONS)
        for name in ("8b-lora-24gb", "8b-fsdp-80gb")
    }
    for result in results.values():
        rows = {row["policy"]: row for row in result["rows"]}
        ladder, predictive = rows["ladder"], rows["predictive"]
        # Keeping never costs a step: the same out-of-memory steps and bytes as the predictive policy alone.
        assert (ladder["oom_steps"], ladder["bytes"]) == (predictive["oom_steps"], predictive["bytes"])
        assert ladder["kept_share"] > 0 and ladder["time_vs_plain"] < predictive["time_vs_plain"]
    roomy = {row["policy"]: row for row in results["8b-fsdp-80gb"]["rows"]}
    assert roomy["never"]["time_vs_plain"] == 1.0  # plain checkpointing, nothing copied, nothing failed
    assert roomy["ladder"]["kept_share"] > 0.8 and roomy["ladder"]["time_vs_plain"] < 0.9
