"""examples/accelerate_loop.py, run as a user runs it: a subprocess, bounded in time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_accelerate_loop_example_runs_and_its_bytes_add_up():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOOFFLOAD_", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "accelerate_loop.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    steps = [line for line in result.stdout.splitlines() if line.startswith("rank 0 step")]
    # Two micro-batches per optimizer step; the 512 turns offload on for its step (4 layers x seq x 64 x 4 B).
    assert steps[1] == "rank 0 step 2: seq [512, 64] offloaded layers [4, 4] bytes 589,824 expected 589,824"
    assert len(steps) == 4 and steps[0].endswith("bytes 0 expected 0")
    assert "autooffload: mode=auto, 4 step(s), offload in 2 (50%)" in result.stdout
