"""benchmarks/peers.py runs end to end (the ladder's tiny model, one round, ``aot_eager_decomp_partition``, whose
partitioner reads ``activation_memory_budget`` as inductor's does): every peer runs, autooffload's modes fit the
real-peak budget, and compiled ``auto`` gives compiled plain checkpointing's loss and gradients bit for bit with no
graph compiled in a timed step."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from conftest import compiles_whole

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(ROOT / "benchmarks"))
peers = _load("peers")

MODES = ["none", "plain", "auto", "hf-offload", "sac", "every-2nd", "compile-plain", "compile-0.5", "compile-auto"]


def test_quick_run_of_every_kind_of_peer(tmp_path):
    argv = ["--out", str(tmp_path), "--quick", "--scenario", "b", "--backend", "aot_eager_decomp_partition"]
    assert peers.main([*argv, "--modes", *MODES]) == 0
    data = json.loads((tmp_path / "peers.json").read_text())
    (result,) = data["results"]
    modes = result["modes"]
    options = peers.transformers_options()  # every_n_layers from transformers 5.16, offload from 5.17
    needs = {"every-2nd": "every_n_layers", "hf-offload": "offload"}
    ran = [m for m in MODES if m not in needs or needs[m] in options]
    assert list(modes) == ran and "| b | compile-auto |" in (tmp_path / "peers.md").read_text()
    assert not modes["none"]["fits"]  # (b)'s long micro-batch does not fit without checkpointing
    assert modes["auto"]["fits"] and modes["compile-auto"]["fits"]
    assert modes["auto"]["kept"] > 0 and modes["compile-auto"]["kept"] > 0
    assert modes["compile-auto"]["compile"]["graphs"]["timed"] == 0
    # Bit for bit where transformers' checkpointed layers compile as one graph with the model; where they break the
    # graph (transformers 5.25), a kept layer's graph and a recomputing one's are partitioned apart and may order
    # their sums differently
    equal = (lambda r: r["grads_equal"]) if compiles_whole() else (lambda r: r["grad_diff_rel"] < 1e-5)
    assert result["compiled_equal"] and all(r["loss_equal"] and equal(r) for r in result["compiled_equal"])
    if "hf-offload" in modes:  # transformers' offload=True moves the layer inputs out of the allocator
        assert modes["hf-offload"]["max_reading_over_budget"] <= modes["plain"]["max_reading_over_budget"]


@pytest.mark.one_suite("newest")
def test_auto_on_layers_compiled_in_place_where_offload_is_needed(tmp_path):
    """(c): the layers compiled in place, the rest eager; ``auto`` offloads no more layers than ``always`` does
    eagerly (what the real peak needs), no timed step over the budget, compiles nothing in a timed step and gives
    the same model's plain checkpointing's loss. Before: it offloaded every layer here, two of four on the CPU
    model (inductor), where one brings the peak under the budget: the first step of the offloading form traces
    the layer's frames (no graph compiled, so the benchmark did not see it) and its count held the tracing's own
    allocations, 1.0125 of the budget against 0.9875 counted again; the controller took it for one layer not
    being enough. A warm-up step in which dynamo compiled is now no sample for the controller, and is left out of
    the warm-up's steps over the budget. Its gradients are not bit-identical there (5e-7 of their largest where a
    layer offloads; on the whole model compiled they are, tests/test_compile.py): held close here, the cause not
    yet found."""
    argv = ["--out", str(tmp_path), "--quick", "--scenario", "c", "--backend", "aot_eager_decomp_partition"]
    assert peers.main([*argv, "--modes", "plain", "always", "layers-plain", "layers-auto"]) == 0
    (result,) = json.loads((tmp_path / "peers.json").read_text())["results"]
    auto, always = result["modes"]["layers-auto"], result["modes"]["always"]
    assert auto["steps_over_budget"] == 0 and auto["compile"]["graphs"]["timed"] == 0
    assert auto["offloaded"] <= always["offloaded"] and auto["fits"]
    assert auto["warmup_steps_over_budget"] <= always["warmup_steps_over_budget"] + 1
    rows = [r for r in result["compiled_equal"] if r["auto"] == "layers-auto"]
    assert rows and all(r["loss_equal"] and r["grad_diff_rel"] < 1e-5 for r in rows)
    assert "layers-auto against layers-plain" in (tmp_path / "peers.md").read_text()


def test_round_by_round_the_machines_drift_cancels_and_a_tie_stays_a_tie():
    """Every round runs each mode step by step, interleaved: a slow round (the shared machine's load) is slow for
    all. Each mode's own spread holds that drift, and two modes 8% apart read as within it; round by round the
    drift cancels and the one faster in every round is beyond. A mode faster in some rounds only is not."""
    drift = [1.0, 1.0, 1.3, 1.0, 1.25, 1.0, 1.0, 1.0]
    values = {
        "auto": dict(round_s=[0.92 * d for d in drift], fits=True),
        "every-2nd": dict(round_s=[1.0 * d for d in drift], fits=True),
        "sac": dict(round_s=[(0.9 if i % 2 else 0.95) * d for i, d in enumerate(drift)], fits=True),
    }
    for v in values.values():
        v["median_s"] = sorted(v["round_s"])[4]
    beyond = peers.paired(values, "auto", "every-2nd")
    assert beyond["beyond"] and beyond["faster_rounds"] == 8 and abs(beyond["median"] - 0.92) < 1e-9
    assert (max(values["auto"]["round_s"]) - min(values["auto"]["round_s"])) / values["auto"]["median_s"] / 2 > 0.08
    tie = peers.paired(values, "auto", "sac")
    assert not tie["beyond"] and 0 < tie["faster_rounds"] < 8
    assert peers.fastest_peer(values, "auto") == "sac"
