"""The fast part of the fault matrix (``benchmarks/faults.py``; the whole of it runs there, with its results in
``benchmarks/results/``): every guarded entry point failing, before and after its body, a probe and host memory
that fail, and a process killed between two steps then resumed, in one process; and a few entry points failing on
one of two DDP ranks over gloo. Every cell must finish every step with the fault-free run's losses and parameters
bit for bit, warn as it should and leave nothing attached. The matrix enumerates the entry points from
``autooffload.guard.ENTRY_POINTS``: a new one is covered here without a line of its own."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("faults_bench", ROOT / "benchmarks" / "faults.py")
faults = sys.modules["faults_bench"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(faults)


def failures(verdicts: list[dict]) -> list[dict]:
    return [v for v in verdicts if not v.get("unreached") and not all(v.get(k, True) for k in faults.CHECKS)]


def test_every_entry_point_is_guarded_once_and_registered():
    """Each ``@guarded("where")`` in the package names a distinct entry point, and each is in the registry the
    matrix enumerates."""
    names = []
    for path in (ROOT / "autooffload").rglob("*.py"):
        if "integrations" in path.parts:  # Lightning's: tests/test_lightning.py fails each of them
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "guarded" and node.args:
                names.append(node.args[0].value)
    assert len(names) == len(set(names)), sorted(names)
    assert set(names) == set(faults.entry_points())


def test_one_process_every_cell_survives_with_identical_results(tmp_path):
    lines: list[str] = []
    verdicts = faults.run_topology("one", tmp_path, quick=True, only=None, log=lines.append)
    assert not failures(verdicts), failures(verdicts)
    injected = {v["fault"].split(": ", 1)[1].split(" (")[0] for v in verdicts if v["fault"].startswith("entry: ")}
    assert injected == set(faults.entry_points())  # every entry point reached and failed, the rescue included
    assert not [v for v in verdicts if v.get("unreached")]
    places = {v["fault"].split(": ", 1)[1] for v in verdicts if v["fault"].startswith("step: ")}
    assert {"the sync engine's pack hook", "the sync engine's unpack hook", "the backward counter"} <= places
    kinds = {v["fault"].split(":")[0] for v in verdicts}
    assert kinds == {"entry", "step", "probe", "host", "kill"}
    (kill,) = [v for v in verdicts if v["fault"] == "kill"]
    assert kill["killed"] and kill["resumed_exactly"] and kill["checkpoint"] == "checkpoint-3"
    assert "moved [0]" not in lines[0]  # the fault-free run offloaded: a fault changes where tensors live


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_two_ranks_a_few_entry_points_fail_on_one_rank(tmp_path):
    """DDP over gloo, rank 1 failing: in a layer's report during the forward, in end_step, at the load of a resumed
    run's state, at the end of training, inside the backward (the sync engine's unpack hook), and the two repros of
    issue 37: a Qwen3's pre-forward hook after the agreement of the last micro-batch of an accumulation, and a T5's
    first layer report of that micro-batch (an encoder layer; the decoder stack's entry follows in the same forward).
    Every rank finishes with identical results and the same collectives. (The pre-forward hook before the agreement
    and attach: tests/test_distributed.py.)"""
    primary = faults.Config("ddp", **faults.PRIMARY)
    last = ("the last micro-batch, forward",)
    only = ("a layer call's report", "end_step", "load", "finish", "nvml-error", "the sync engine's unpack hook")
    chosen = [
        (primary, faults.Plan(only=only, others=True)),
        (primary, faults.Plan(last, after=("the pre-forward hook",), only=("the pre-forward hook",))),
        (faults.Config("ddp", model="t5", **faults.PRIMARY), faults.Plan(last, only=("a layer call's report",))),
    ]
    verdicts = faults.run_topology("ddp", tmp_path, quick=False, only=None, log=print, kill=False, chosen=chosen)
    assert not failures(verdicts), failures(verdicts)
    assert len([v for v in verdicts if not v.get("unreached")]) == len(only) + 3
    repros = {(v["model"], v["fault"]) for v in verdicts if v.get("window") == last[0]}
    assert {("qwen3", "entry: the pre-forward hook (after its body)"), ("t5", "entry: a layer call's report")} <= repros
