"""benchmarks/ladder.py runs end to end (tiny model, one round) and its budgets hold: autooffload's steps never
pass the budget (warm-up included, beyond what always's first long step does), and each scenario's budget is the
one it claims (none does not fit in (b), plain not in (c)); autocast, two forwards per backward and a hybrid stack
stay within it too. The budget is the step's real peak (the allocator's, backward included): there the keep
model, which plans what a kept layer saves, finds room in (a), (b) and (d) but not in (e) and (f), whose rooms are
sized from real readings (docs/ladder.md)."""

from __future__ import annotations

import gc
import importlib.util
import json
import sys
import weakref
from pathlib import Path

import pytest

from autooffload import MemoryReading

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ladder_bench", ROOT / "benchmarks" / "ladder.py")
ladder_bench = sys.modules["ladder_bench"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ladder_bench)
from harness import scenarios  # noqa: E402  (the ladder's scenarios, modes and budgets: benchmarks/ on the path)


@pytest.mark.one_suite("oldest")
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


def test_a_step_over_the_devices_size_reads_as_a_full_device_and_offload_follows():
    """The budget probe stands for a device of its size: a step that needs more reads as that device full, as
    autooffload's probes read it (SimulatedDevice; NvmlProbe after the allocator's retries). Before: it read more
    than the device's size, a reading the controller drops as garbage (one probe-failed warning, hidden by the
    benchmark): on the H200, scenario (c)'s auto never had a reading and planned no offload at all (always, one
    layer from its one step under the size), every step over the budget."""
    bench = scenarios.Bench(scenarios.SHAPES["quick"], "cpu")
    seq, batch = bench.shape.long, bench.shape.offload_batch
    plain = scenarios.reading(bench, "plain", seq, batch=batch)
    mode = scenarios.Mode("auto", bench)
    mode.probe.total = round(0.9 * plain)  # a step with every layer recomputing needs more than the device holds
    rows = [mode.step(seq, seed=seq, timed=False, batch=batch) for _ in range(3)]
    assert rows[0]["offload"] == 0 and rows[0]["reading"] > mode.probe.total  # no reading yet: nothing planned
    assert rows[1]["offload"] > 0 and rows[2]["offload"] > 0
    mode.probe.last = rows[0]["reading"]
    assert mode.probe.read() == MemoryReading(mode.probe.total, mode.probe.total)


def test_a_mode_keeps_its_host_buffers_across_its_steps():
    """One host memory manager per mode, kept across the mode's steps as one run keeps it (as bench.py does). Before,
    the controller made its own, released at every detach, so every step mapped and pinned its buffers anew: on the
    H200, ladder (c)'s always and auto were 4-5% slower than plain for it."""
    bench = scenarios.Bench(scenarios.SHAPES["quick"], "cpu")
    seq, batch = bench.shape.long, bench.shape.offload_batch
    mode = scenarios.Mode("always", bench)
    mode.probe.total = round(0.9 * scenarios.reading(bench, "plain", seq, batch=batch))
    allocations = []
    for _ in range(4):
        row = mode.step(seq, seed=seq, timed=False, batch=batch)
        allocations.append(mode.controller.host.allocations)
    assert row["offload"] > 0 and allocations[1] > 0
    assert allocations[1:] == [allocations[1]] * 3, allocations


def test_a_timed_step_holds_no_whole_heap_collection_and_the_garbage_before_it_is_collected_first():
    """Python's full collection walks every object of the process (all the modes' models, dynamo's caches) and fell
    in whichever mode's step crossed its threshold: on the Jamba scenario one round in a few took 2x, charged to
    plain, every other layer or autooffload alike. Now the heap is collected before each step, young collections
    run in it as in any run, and the thresholds come back after."""

    class Node:
        pass

    bench = scenarios.Bench(scenarios.SHAPES["quick"], "cpu")
    mode = scenarios.Mode("plain", bench)
    before = gc.get_threshold()
    cycle = Node()
    cycle.self = cycle
    garbage = weakref.ref(cycle)
    del cycle
    seen = {}
    step = mode._cpu_step

    def observed(*args):
        seen.update(thresholds=gc.get_threshold(), garbage_alive=garbage() is not None)
        return step(*args)

    mode._cpu_step = observed
    gc.disable()  # no automatic collection may free the cycle before the step does
    try:
        mode.step(bench.shape.short, seed=1)
    finally:
        gc.enable()
    assert seen["garbage_alive"] is False
    assert seen["thresholds"][:2] == before[:2] and seen["thresholds"][2] >= 1 << 30
    assert gc.get_threshold() == before


def test_a_round_that_raises_leaves_nothing_frozen():
    """The rounds run with what the warm-ups built frozen out of the collector; a step that raises must not leave it
    so (the process's models and graphs would never be collected again: a pytest session, a notebook)."""
    bench = scenarios.Bench(scenarios.SHAPES["quick"], "cpu")
    scenario = scenarios.Scenario([bench.shape.short], 10**12)
    mode = scenarios.Mode("plain", bench)
    step = mode.step

    def failing(seq, seed, timed=True, **how):
        if timed:
            raise RuntimeError("a timed step failed")
        return step(seq, seed, timed=timed, **how)

    mode.step = failing
    with pytest.raises(RuntimeError, match="a timed step failed"):
        scenarios.run_scenario(bench, "a", scenario, 1, [mode])
    assert gc.get_freeze_count() == 0
