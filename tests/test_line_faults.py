"""A sample of the line-level fault injection (``benchmarks/line_faults.py``; the whole of it, every line of
``autooffload/`` a training run executes, runs there with its results in ``benchmarks/results/``): 20 lines spread
over the package, each failing once in its own Trainer run on one process. Every run must finish every step with
plain checkpointing's losses and parameters bit for bit, warn at most once and leave no host bytes lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_fault_at_any_line_leaves_the_run_plain_checkpointings(tmp_path: Path):
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "benchmarks.line_faults", "--out", str(tmp_path), "--quick"]
    done = subprocess.run(command, env=environment, cwd=ROOT, capture_output=True, text=True, timeout=600)
    data = json.loads((tmp_path / "results.json").read_text())
    base, runs = data["baselines"]["one"], data["runs"]["one"]
    assert base["trace_identical_to_plain"] == [True] and base["trace"][0]["bytes_moved"] > 0  # it offloaded
    assert len(runs) == 20, done.stdout[-2000:] + done.stderr[-2000:]
    from benchmarks.line_faults.report import kind

    broken = {line: run["broken"] for line, run in runs.items() if not run["survived"] and not kind(line, run)}
    assert not broken, broken
    assert all(run["fired"] == [True] for run in runs.values()), {k: r["fired"] for k, r in runs.items()}
