"""Many ranks: one agreed level per micro-batch, the worst rank's memory, and two real gloo runs.

The two-process tests start ``tests/distributed_worker.py`` through torchrun (``--standalone``: a free port),
bound it in time, kill its whole process group if it overruns, and assert here on the JSON each rank wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import LAYERS, model
from distributed_worker import HIDDEN, LENGTHS, reference_losses
from distributed_worker import LAYERS as WORKER_LAYERS

from autooffload import AutoOffloadCallback, HysteresisPolicy, OffloadController, Settings, SettingsError, distributed
from autooffload.distributed import RankPeak

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 180

needs_gloo = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs gloo"
)


# ---- the setting -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("0", False), ("true", True), ("OFF", False)])
def test_sync_ranks_from_the_environment(raw, value):
    assert Settings.from_env({}).sync_ranks is True
    assert Settings.from_env({"AUTOOFFLOAD_SYNC_RANKS": raw}).sync_ranks is value


def test_bad_sync_ranks_fails_at_construction(monkeypatch):
    with pytest.raises(SettingsError, match=r"AUTOOFFLOAD_SYNC_RANKS='2' is not a boolean: expected 1 or 0"):
        Settings.from_env({"AUTOOFFLOAD_SYNC_RANKS": "2"})
    with pytest.raises(SettingsError, match=r"AUTOOFFLOAD_SYNC_RANKS=1 is not allowed: expected a boolean"):
        Settings(sync_ranks=1)
    monkeypatch.setenv("AUTOOFFLOAD_SYNC_RANKS", "yes please")
    with pytest.raises(SettingsError, match="AUTOOFFLOAD_SYNC_RANKS"):
        AutoOffloadCallback()
    monkeypatch.setenv("AUTOOFFLOAD_SYNC_RANKS", "1")
    assert AutoOffloadCallback(sync_ranks=False).controller.settings.sync_ranks is False


# ---- the agreement, with the group stood in for ----------------------------------------------------------


def attached(settings: Settings) -> OffloadController:
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    controller = OffloadController(settings, probe=None)
    controller.attach(net)
    return controller


def fake_group(monkeypatch, group_level: int) -> list[int]:
    """Two ranks, the other one asking for ``group_level``; returns the values this rank sent."""
    sent: list[int] = []
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "all_reduce_max", lambda value: sent.append(value) or max(value, group_level))
    return sent


def test_without_a_process_group_no_collective_is_made(monkeypatch):
    def no_collective(value):
        raise AssertionError("collective without a process group")

    monkeypatch.setattr(distributed, "all_reduce_max", no_collective)
    assert not torch.distributed.is_initialized()
    controller = attached(Settings(seq_high=200, seq_low=100))
    assert [controller.before_forward(seq, seq) for seq in (64, 256)] == [0, LAYERS]
    assert controller.finish().endswith("0.0 MiB moved to host") and controller.worst_rank is None


@pytest.mark.parametrize("name", ["hysteresis", "predictive"])
def test_the_group_level_runs_and_the_policy_follows_it(monkeypatch, name):
    sent = fake_group(monkeypatch, group_level=LAYERS)
    controller = attached(Settings(seq_high=200, seq_low=100, min_steps=2, policy=name))
    # Without memory readings the predictive policy decides through its hysteresis fallback.
    policy = controller.policy if name == "hysteresis" else controller.policy.fallback
    assert isinstance(policy, HysteresisPolicy)

    assert controller.before_forward(64, 64) == LAYERS  # this rank said 0, the other rank said all
    assert sent == [0] and controller.switch.offloaded == LAYERS
    # The policy took the group's switch at step 0 as its own: its dwell counts from there, as on the other rank.
    assert (policy.offloading, policy.last_switch_step) == (True, 0)
    controller.end_step()

    monkeypatch.setattr(distributed, "all_reduce_max", lambda value: sent.append(value) or value)
    assert controller.before_forward(64, 64) == LAYERS  # inside the dwell: still on, now by its own decision
    controller.end_step()
    controller.end_step()
    assert controller.before_forward(64, 64) == 0  # dwell over, both calm
    assert sent == [0, LAYERS, 0]


@pytest.mark.parametrize("settings", [Settings(sync_ranks=False), Settings(mode="on"), Settings(mode="off")])
def test_no_collective_when_turned_off_or_the_level_is_fixed(monkeypatch, settings):
    sent = fake_group(monkeypatch, group_level=LAYERS)
    controller = attached(settings)
    controller.before_forward(64, 64)
    assert sent == []
    assert controller.level == (LAYERS if settings.mode == "on" else 0)


def test_a_policy_without_agreed_keeps_its_own_state(monkeypatch):
    fake_group(monkeypatch, group_level=LAYERS)

    class Stateless:
        def decide(self, observation):
            return 0

    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    controller = OffloadController(Settings(), probe=None, policy=Stateless())
    controller.attach(net)
    assert controller.before_forward(64, 64) == LAYERS


def test_summary_names_the_worst_rank():
    controller = attached(Settings(mode="on"))
    controller.peak_memory_fraction = 0.42
    controller.worst_rank = RankPeak(0.93, 3, 8)
    assert controller.summary().endswith("peak memory 0.42 of device, worst of 8 ranks: rank 3 at 0.93")


# ---- two processes, gloo ---------------------------------------------------------------------------------


def run_ranks(scenario: str, out: Path) -> list[dict]:
    """Run the worker on two ranks; kill its whole process group if it overruns; return each rank's JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOOFFLOAD_", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(TESTS / "distributed_worker.py"), scenario, str(out)]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{scenario} did not finish in {TIMEOUT_S} s:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def moved(rank: int, levels: list[int]) -> list[int]:
    """Bytes each step must move on ``rank``: all layers' saved inputs when offloading, else none."""
    seqs = [pair[rank] for pair in LENGTHS]
    return [WORKER_LAYERS * seq * HIDDEN * 4 if level else 0 for seq, level in zip(seqs, levels, strict=True)]


def has_fully_shard() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@needs_gloo
def test_trainer_ddp_ranks_switch_together(tmp_path):
    ranks = run_ranks("trainer_ddp", tmp_path)
    every = WORKER_LAYERS
    for rank, result in enumerate(ranks):
        assert result["world_size"] == 2
        # Rank 0 gets the long micro-batch at step 1, rank 1 at step 3; both run the same levels.
        assert [seq for seq, _ in result["levels"]] == [pair[rank] for pair in LENGTHS]
        assert [level for _, level in result["levels"]] == [0, every, 0, every]
        assert result["step_bytes"] == moved(rank, [0, every, 0, every])
        assert result["collectives"] == len(LENGTHS)  # one per micro-batch
    # What each policy said alone: only the rank with the long micro-batch asked for offload.
    assert ranks[0]["local"] == [0, every, 0, 0] and ranks[1]["local"] == [0, 0, 0, every]
    assert ranks[0]["parameters"] == ranks[1]["parameters"]
    # Rank 0 logs the summary with the worst rank's peak (rank 1's scripted 0.50 against its own 0.30).
    assert ranks[0]["worst_rank"] == ranks[1]["worst_rank"] == {"fraction": 0.5, "rank": 1, "world_size": 2}
    (summary,) = ranks[0]["summaries"]
    assert summary.endswith("peak memory 0.30 of device, worst of 2 ranks: rank 1 at 0.50")
    assert ranks[1]["summaries"] == []


@needs_gloo
@pytest.mark.skipif(not has_fully_shard(), reason="torch.distributed.fsdp.fully_shard arrived in torch 2.6")
def test_fsdp2_ranks_switch_together_and_losses_equal_one_process(tmp_path):
    ranks = run_ranks("fsdp2", tmp_path)
    every = WORKER_LAYERS
    reference = reference_losses()
    for rank, result in enumerate(ranks):
        synced, alone = result["synced"], result["alone"]
        assert synced["targets"] == ["CheckpointWrapper.checkpoint_fn"] * every
        assert [level for _, level in synced["levels"]] == [0, every, 0, every]
        assert synced["collectives"] == len(LENGTHS) and alone["collectives"] == 0
        assert synced["step_bytes"] == moved(rank, [0, every, 0, every])
        # Without the agreement each rank follows its own policy, and the losses do not change.
        assert [level for _, level in alone["levels"]] == alone["local"]
        assert synced["losses"] == pytest.approx([pair[rank] for pair in reference], rel=1e-5)
        assert alone["losses"] == pytest.approx(synced["losses"], rel=1e-5)
        # recompute="auto": no reading at step 0; at steps 1 and 3 one rank's micro-batch is longer than any
        # its readings covered, so the group keeps nothing; at step 2 both keep every layer.
        assert ranks[rank]["keep"]["kept"] == [0, 0, every, 0]
        assert ranks[rank]["keep"]["losses"] == pytest.approx([pair[rank] for pair in reference], rel=1e-5)
    assert [level for _, level in ranks[0]["alone"]["levels"]] == [0, every, 0, 0]
    assert [level for _, level in ranks[1]["alone"]["levels"]] == [0, 0, 0, every]
