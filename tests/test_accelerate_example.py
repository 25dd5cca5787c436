"""examples/accelerate_loop.py, run as a user runs it: a subprocess, bounded in time; under ``accelerate launch``
with each config in examples/accelerate/ (DDP, DeepSpeed ZeRO-2, FSDP2: two gloo processes on this CPU), it must
run what the config names, move the arithmetic, and train as the DDP run does."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distributed import deepspeed_comm_op, worker_environment  # noqa: F401  (a fixture, used by name)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "accelerate_loop.py"
STEP = re.compile(r"rank (\d) step (\d): seq \[[\d, ]+\] offloaded layers \[[\d, ]+\] bytes ([\d,]+) expected ([\d,]+) "
                  r"loss ([\d.]+)")  # fmt: skip


def test_accelerate_loop_example_runs_and_its_bytes_add_up():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOOFFLOAD_", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, str(EXAMPLE)], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == "running: one process, 1 process(es), parameters sharded: False"
    steps = [line for line in result.stdout.splitlines() if line.startswith("rank 0 step")]
    # Two micro-batches per optimizer step; the 512 turns offload on for its step (4 layers x seq x 64 x 4 B).
    assert steps[1].startswith("rank 0 step 2: seq [512, 64] offloaded layers [4, 4] bytes 589,824 expected 589,824")
    assert len(steps) == 4 and "bytes 0 expected 0" in steps[0]
    assert "autooffload: mode=auto, 4 step(s), offload in 2 (50%)" in result.stdout


def free_port() -> int:
    """A port no process listens on now: accelerate's default, 29500, is shared by every suite on the machine (./dev
    test runs two at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(config: str) -> str:
    """``accelerate launch --config_file examples/accelerate/CONFIG.yaml examples/accelerate_loop.py``."""
    env = worker_environment()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port())]
    command += ["--config_file", str(ROOT / "examples" / "accelerate" / f"{config}.yaml"), str(EXAMPLE)]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"accelerate launch with {config}.yaml did not finish in 300 s:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    return output


def has_fully_shard() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


RUNS = {
    "ddp": "running: DDP (MULTI_CPU), 2 process(es), parameters sharded: False",
    "zero2": "running: DeepSpeed ZeRO-2 (DeepSpeedEngine), 2 process(es), parameters sharded: False",
    "fsdp2": "running: FSDP2 (torch fully_shard), 2 process(es), parameters sharded: True",
}
NEEDS = {
    "zero2": pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="no DeepSpeed (./dev has it)"),
    "fsdp2": pytest.mark.skipif(not has_fully_shard(), reason="torch.distributed.fsdp.fully_shard: torch >= 2.6"),
}


def steps_of(output: str) -> dict[tuple[int, int], tuple[int, int, float]]:
    """(rank, step) -> (bytes moved, bytes expected, mean loss), from the example's lines."""
    return {
        (int(rank), int(step)): (int(moved.replace(",", "")), int(expected.replace(",", "")), float(loss))
        for rank, step, moved, expected, loss in STEP.findall(output)
    }


@pytest.fixture(scope="module")
def ddp_output() -> str:
    return launch("ddp")


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("config", [pytest.param(name, marks=NEEDS.get(name, ())) for name in RUNS])
def test_accelerate_launch_runs_what_its_config_names(config, ddp_output, request):
    if config == "zero2":
        request.getfixturevalue("deepspeed_comm_op")  # built once, before two ranks race to build it
    output = ddp_output if config == "ddp" else launch(config)
    # Two ranks share one pipe, with no line boundary between their writes: what a rank prints, wherever it lands.
    assert RUNS[config] in output, output[-4000:]
    steps = steps_of(output)
    assert sorted(steps) == [(0, 1), (0, 2), (1, 1), (1, 2)], output[-4000:]
    assert all(moved == expected for moved, expected, _ in steps.values()), output[-4000:]
    # Rank 0's long micro-batches (512, 384) come second in its steps; the ranks agree, so both ranks offload
    # every layer of their second micro-batches: 4 layers x (512 + 384 + 64 + 64) tokens x 64 x 4 bytes.
    assert sum(moved for moved, _, _ in steps.values()) == 4 * (512 + 384 + 64 + 64) * 64 * 4
    # The same training as DDP's (the reductions' order differs: not bit for bit).
    reference = {key: loss for key, (_, _, loss) in steps_of(ddp_output).items()}
    assert {key: loss for key, (_, _, loss) in steps.items()} == pytest.approx(reference, rel=1e-5)
