"""Many ranks: one agreed level per micro-batch, the worst rank's memory, and two real gloo runs.

The two-process tests start ``tests/distributed_worker.py`` through torchrun (``--standalone``: a free port),
bound it in time, kill its whole process group if it overruns, and assert here on the JSON each rank wrote.
DeepSpeed compiles a small C++ communication op on first use (about 45 s): it is cached in
``TORCH_EXTENSIONS_DIR``, by default under ``~/.cache/autooffload``, so that happens once per machine and
environment.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import LAYERS, model
from distributed_worker import HIDDEN, LENGTHS, reference_losses
from distributed_worker import LAYERS as WORKER_LAYERS

from autooffload import AutoOffloadCallback, HysteresisPolicy, OffloadController, Settings, SettingsError, distributed
from autooffload.distributed import RankPeak
from autooffload.history import read_history

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 180
DEEPSPEED_TIMEOUT_S = 300  # three Trainer runs on a busy machine
BUILD_TIMEOUT_S = 600  # DeepSpeed's communication op, built once: about 45 s idle, minutes on a loaded machine
# One build directory per Python environment: a build made against another environment's torch headers is
# rebuilt, so the two environments of ./dev test would otherwise rebuild each other's op on every run.
TORCH_EXTENSIONS_DIR = (
    Path.home() / ".cache" / "autooffload" / "torch_extensions" / hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
)

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
    with pytest.raises(SettingsError, match=r"argument sync_ranks=1 is an integer, not a boolean"):
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


def two_ranks(monkeypatch) -> None:
    """Two ranks as this rank sees them, both with layers: the join at attach makes no collective."""
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "AgreementGroup", lambda: None)
    monkeypatch.setattr(distributed, "join_ranks", lambda ready, gave_up, group, made: made() or (True, None))


def fake_group(monkeypatch, group_level: int) -> list[int]:
    """Two ranks, the other one asking for ``group_level``; returns the values this rank sent."""
    sent: list[int] = []
    two_ranks(monkeypatch)

    def group(values, group=None, made=None):
        made()
        level, *rest = values
        sent.append(level)
        return [max(level, group_level), *rest]

    monkeypatch.setattr(distributed, "all_reduce_max", group)
    return sent


def test_without_a_process_group_no_collective_is_made(monkeypatch):
    def no_collective(values, group=None, made=None):
        raise AssertionError("collective without a process group")

    monkeypatch.setattr(distributed, "all_reduce_max", no_collective)
    assert not torch.distributed.is_initialized()
    controller = attached(Settings(seq_high=200, seq_low=100))
    assert [controller.before_forward(seq, seq) for seq in (64, 256)] == [0, LAYERS]
    assert controller.finish().endswith("0.0 MiB moved to host") and controller.record.worst_rank is None


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

    monkeypatch.setattr(
        distributed, "all_reduce_max", lambda values, group=None, made=None: made() or sent.append(values[0]) or values
    )
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


def test_the_group_runs_the_smallest_host_cap(monkeypatch):
    sent: list[list[int]] = []
    two_ranks(monkeypatch)
    # The other rank asks for no offload, but its host budget holds only one layer's input.
    monkeypatch.setattr(
        distributed,
        "all_reduce_max",
        lambda values, group=None, made=None: made() or sent.append(values) or [values[0], -1, *values[2:]],
    )
    controller = attached(Settings(seq_high=200, seq_low=100, policy="hysteresis"))
    assert controller.before_forward(256, 256) == 1
    # This rank: all layers, its budget (the default) holds them all, keeps none, has not given up.
    assert sent == [[LAYERS, -LAYERS, 0, 0, 0, 0, 0]]


@pytest.mark.parametrize(
    ("peaks", "worst"),
    [
        ([0.42, 0.93, 0.7], RankPeak(0.93, 1, 3)),
        ([0.93, 0.42], RankPeak(0.93, 0, 2)),
        ([None, 0.3, float("nan"), 0.25], RankPeak(0.3, 1, 4)),  # no reading, and one that is no number
        ([0.5, 0.5], RankPeak(0.5, 0, 2)),  # a tie: the lowest rank
        ([None, -1.0], None),
    ],
)
def test_the_worst_rank_is_the_highest_peak_and_where_it_was_read(peaks, worst):
    world = len(peaks)
    code = max(distributed.peak_code(peak, rank, world) for rank, peak in enumerate(peaks))
    assert distributed.worst_of(code, world) == worst


def test_summary_names_the_worst_rank():
    controller = attached(Settings(mode="on"))
    controller.memory.peak_fraction = 0.42
    controller.record.worst_rank = RankPeak(0.93, 3, 8)
    assert controller.summary().endswith("peak memory 0.42 of device, worst of 8 ranks: rank 3 at 0.93")


# ---- two processes, gloo ---------------------------------------------------------------------------------


def worker_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOOFFLOAD_", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(TORCH_EXTENSIONS_DIR))
    return env


def run_bounded(command: list[str], env: dict[str, str], timeout_s: int, what: str) -> str:
    """Run ``command``; kill its whole process group if it overruns; fail unless it exits 0. Returns its output."""
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{what} did not finish in {timeout_s} s:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    return output


def run_ranks(scenario: str, out: Path, timeout_s: int = TIMEOUT_S) -> list[dict]:
    """Run the worker on two ranks; kill its whole process group if it overruns; return each rank's JSON."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(TESTS / "distributed_worker.py"), scenario, str(out)]
    run_bounded(command, worker_environment(), timeout_s, scenario)
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
        assert result["collectives"] == len(LENGTHS) + 1  # one per micro-batch, and the end's
    # What each policy said alone: only the rank with the long micro-batch asked for offload.
    assert ranks[0]["local"] == [0, every, 0, 0] and ranks[1]["local"] == [0, 0, 0, every]
    assert ranks[0]["parameters"] == ranks[1]["parameters"]
    # Rank 0 logs the summary with the worst rank's peak (rank 1's scripted 0.50 against its own 0.30).
    assert ranks[0]["worst_rank"] == ranks[1]["worst_rank"] == {"fraction": 0.5, "rank": 1, "world_size": 2}
    (summary,) = ranks[0]["summaries"]
    assert summary.endswith("peak memory 0.30 of device, worst of 2 ranks: rank 1 at 0.50")
    assert ranks[1]["summaries"] == []
    # Each rank writes its own history; a level taken from the group is marked as such.
    reasons = [
        ["below_high", "seq_high", "below_low", "rank_agreement"],
        ["below_high", "rank_agreement", "below_low", "seq_high"],
    ]
    for rank in range(2):
        records = read_history(tmp_path / "trainer" / "autooffload" / f"history-rank{rank}.jsonl")
        assert [r["seq_lens"] for r in records] == [[pair[rank]] for pair in LENGTHS]
        assert [r["offloaded"] for r in records] == [[0], [every], [0], [every]]
        assert [r["reasons"] for r in records] == [[reason] for reason in reasons[rank]]
    assert not (tmp_path / "trainer" / "autooffload" / "history.jsonl").exists()


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
        # Over a gloo side group made at attach: the same levels and the same losses, every collective on it.
        side = result["side"]
        assert side["levels"] == synced["levels"] and side["step_bytes"] == synced["step_bytes"]
        assert side["collectives"] == side["side_collectives"] == len(LENGTHS)
        assert side["losses"] == synced["losses"]
    assert [level for _, level in ranks[0]["alone"]["levels"]] == [0, every, 0, 0]
    assert [level for _, level in ranks[1]["alone"]["levels"]] == [0, 0, 0, every]


@needs_gloo
def test_a_rank_without_checkpointed_layers_leaves_no_rank_waiting(tmp_path):
    # Before: rank 0 waited in new_group (the side group) or in every micro-batch's all_reduce for rank 1,
    # which had returned from attach early and never joined either.
    ranks = run_ranks("uneven", tmp_path, timeout_s=120)
    assert [r["attached"] for r in ranks] == [True, False]
    assert [r["collectives"] for r in ranks] == [0, 0]  # one check at attach, none per micro-batch
    assert [level for _, level in ranks[0]["levels"]] == ranks[0]["local"] == [0, WORKER_LAYERS, 0, 0]
    assert ranks[1]["levels"] == []
    assert ranks[0]["worst_rank"] is ranks[1]["worst_rank"] is None
    for result in ranks:
        assert any("a rank has no checkpointed layers" in w for w in result["warnings"]), result["warnings"]


@needs_gloo
def test_one_rank_giving_up_takes_every_rank_to_plain_checkpointing(tmp_path):
    """Rank 1 alone fails inside autooffload, in its second micro-batch's pre-forward hook or in attach, under
    Trainer DDP over gloo (the agreement on the default group, and on a gloo side group as under NCCL). Before:
    rank 1 stopped joining the agreement, rank 0's met rank 1's gradient all-reduce and gloo aborted both (or,
    on a side group, rank 0 waited there). Now every rank finishes every step with the losses and parameters of
    a run without autooffload, the same collectives on both ranks, and one warning each."""
    ranks = run_ranks("give_up", tmp_path, timeout_s=240)
    for result in ranks:
        plain = result["none"]
        assert plain["steps"] == len(LENGTHS)
        for case in ("forward", "attach", "forward_side", "attach_side"):
            run = result[case]
            assert run["steps"] == len(LENGTHS), case
            assert run["losses"] == plain["losses"] and run["parameters"] == plain["parameters"], case
            assert run["pre_hooks"] == 0, case  # nothing left on the model
    for case in ("forward", "attach", "forward_side", "attach_side"):
        # Rank 1 failed in its second micro-batch, before that micro-batch's agreement: it made that one with
        # the flag, and no rank made another. At attach the flag rode on the join: no agreement at all.
        assert ranks[0][case]["collectives"] == ranks[1][case]["collectives"] == (2 if "forward" in case else 0)
        where = "the pre-forward hook" if "forward" in case else "attach"
        (mine,) = ranks[1][case]["warnings"]
        assert f"internal error in {where} (RuntimeError: injected failure on rank 1)" in mine
        (theirs,) = ranks[0][case]["warnings"]
        since = "this micro-batch on" if "forward" in case else "the start"
        assert "rank 1 gave up (its own warning says why)" in theirs
        assert f"every rank goes on with plain checkpointing from {since}" in theirs


@pytest.fixture(scope="module")
def deepspeed_comm_op() -> None:
    """Build DeepSpeed's communication op once, in one process, before any rank needs it.

    torch guards a build with a lock file that a killed build leaves behind, and every later build then waits
    on it forever. Builds started here hold an ``flock`` (released when its holder dies, so two test sessions
    never build at once), under which a lock file older than a no-op rebuild can be is such a leftover.
    """
    env = worker_environment()
    extensions = Path(env["TORCH_EXTENSIONS_DIR"])
    extensions.mkdir(parents=True, exist_ok=True)
    with open(extensions / "autooffload-build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        for stale in extensions.glob("*/lock"):
            if time.time() - stale.stat().st_mtime > 30:
                stale.unlink()
        command = [
            sys.executable,
            "-c",
            "from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None",
        ]
        output = run_bounded(command, env, BUILD_TIMEOUT_S, "building DeepSpeed's communication op")
        assert "built successfully" in output, output[-4000:]


@needs_gloo
@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed (./dev installs it)"
)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_trainer(tmp_path, stage, deepspeed_comm_op):
    """Trainer under ZeRO-2/3, two gloo ranks, one long micro-batch and one short at each step. Three runs in
    one process group: with ``attach(trainer)`` (saving at step 2), without autooffload, and resumed from the
    DeepSpeed checkpoint of step 2 with the callback."""
    ranks = run_ranks(f"zero{stage}", tmp_path, DEEPSPEED_TIMEOUT_S)
    every = WORKER_LAYERS
    for rank, result in enumerate(ranks):
        attached, plain, resumed = result["attach"], result["none"], result["resumed"]
        assert result["world_size"] == 2
        assert {run["engine"] for run in (attached, plain, resumed)} == {"DeepSpeedEngine"}
        # ZeRO-3 shards every parameter across the ranks; ZeRO-2 keeps whole ones.
        assert attached["sharded"] is (stage == 3)
        # The ranks agree: both offload at the steps where either has the long micro-batch.
        assert [seq for seq, _ in attached["levels"]] == [pair[rank] for pair in LENGTHS]
        assert [level for _, level in attached["levels"]] == [0, every, 0, every]
        assert attached["collectives"] == len(LENGTHS) + 1  # and the end's
        assert attached["step_bytes"] == moved(rank, [0, every, 0, every])
        # Losses and final parameters are those of the run without autooffload (bit for bit on a CPU).
        assert attached["losses"] == plain["losses"]
        assert attached["parameters"] == plain["parameters"]
        # Resumed at step 2: the controller goes on where it was (level, dwell, switches, step) and the run
        # ends as the uninterrupted one did.
        assert [level for _, level in resumed["levels"]] == [0, every]
        assert resumed["step_bytes"] == moved(rank, [0, every, 0, every])[2:]
        assert resumed["losses"] == plain["losses"][2:]
        assert resumed["parameters"] == plain["parameters"]

        # Trainer saves rank 0's callback state, so a resumed rank 1 counts its moved bytes from rank 0's. The
        # first run saved a checkpoint after step 2, so its step-3 reading is no sample and the hysteresis need
        # stays step 2's; the resumed run saved nothing there. The levels above are the same either way.
        def comparable(state):
            policy = {k: v for k, v in state["policy"].items() if k != "need"}
            return {**{k: v for k, v in state.items() if k != "total_bytes"}, "policy": policy}

        assert comparable(resumed["state"]) == comparable(attached["state"])
        # attach() under DeepSpeed: no rescue (a rerun is not safe there), said once; the callback alone says
        # nothing.
        assert attached["rescue_wrapped"] is False and attached["rescue_setting"] is True
        assert len(attached["warnings"]) == 1
        assert "out-of-memory steps are not rescued: under DeepSpeed" in attached["warnings"][0]
        assert resumed["warnings"] == []
    assert ranks[0]["attach"]["local"] == [0, every, 0, 0] and ranks[1]["attach"]["local"] == [0, 0, 0, every]
    assert ranks[0]["resumed"]["state"]["total_bytes"] == ranks[0]["attach"]["state"]["total_bytes"]


@needs_gloo
def test_a_rank_giving_up_inside_a_running_forward_tells_at_the_next_micro_batch(tmp_path):
    """Rank 1 fails inside a forward after its micro-batch's agreement: a tiny T5 in an encoder layer's report (the
    decoder stack's entry follows in the same forward), a tiny Qwen3 in its pre-forward hook after the agreement
    (Qwen3Model's entry follows). Before: its notice fired at that inner entry, in the forward already running, and
    met rank 0's gradient all-reduce (gloo aborted both ranks). Now it is made at the next micro-batch's agreement:
    every rank finishes every step with the losses and parameters of the run without autooffload."""
    ranks = run_ranks("give_up_in_forward", tmp_path, timeout_s=300)
    for name in ("t5", "qwen3"):
        for result in ranks:
            plain, run = result[f"{name}_False"], result[f"{name}_True"]
            assert plain["steps"] == run["steps"] == len(LENGTHS), name
            assert run["losses"] == plain["losses"] and run["parameters"] == plain["parameters"], name
        # Micro-batch 1 agreed, micro-batch 2 agreed before rank 1 failed, micro-batch 3 carried the flag: 3 each.
        assert ranks[0][f"{name}_True"]["collectives"] == ranks[1][f"{name}_True"]["collectives"] == 3, name
        (mine,) = ranks[1][f"{name}_True"]["warnings"]
        where = "a layer call's report" if name == "t5" else "the pre-forward hook"
        assert f"internal error in {where} (RuntimeError: injected failure on rank 1)" in mine
        (theirs,) = ranks[0][f"{name}_True"]["warnings"]
        assert "rank 1 gave up (its own warning says why)" in theirs
    assert ranks[1]["t5_True"]["failed_at"] == [1]  # an encoder layer


@needs_gloo
def test_ranks_with_different_numbers_of_micro_batches_fail_safe_with_one_warning(tmp_path):
    """Issue 37, item 4.4: rank 0 runs 3 micro-batches, rank 1 runs 2, under DDP's join() (which trains on uneven
    inputs by shadowing DDP's collectives on the rank that ran out) and on the bare model (an uneven dataset).
    Before: rank 0's third agreement met join()'s shadow all-reduce, or rank 1's gather at the end, and gloo aborted
    both ranks. Now both finish, each with one warning, and no rank waits."""
    ranks = run_ranks("uneven_micro_batches", tmp_path, timeout_s=180)
    for case in ("join", "bare"):
        assert [r[case]["steps"] for r in ranks] == [3, 2]
        for result in ranks:
            (warning,) = result[case]["warnings"]
            assert "the ranks run different numbers of micro-batches" in warning, warning
    assert "DDP's join()" in ranks[0]["join"]["warnings"][0]
    assert "while this one has micro-batches left" in ranks[0]["bare"]["warnings"][0]
    assert "while another had micro-batches left" in ranks[1]["bare"]["warnings"][0]


@needs_gloo
def test_a_rank_failing_before_a_collective_makes_it_with_the_flag(tmp_path):
    """Issue 49, 1.1: rank 1 fails after the agreement's bookkeeping and before its ``all_reduce``: building its second
    micro-batch's message, making the side group at the join, building the end's message. Before, the bookkeeping
    marked the collective made first: rank 1 skipped the agreement and its gradient all-reduce met rank 0's agreement
    (gloo aborted both), skipped the join (rank 0's join met rank 1's DDP broadcast), or left rank 0 alone in the
    end's gather. Now the failed rank makes the collective it owes, with the flag: both ranks finish every step with
    the losses and parameters of a run without autooffload, the same collectives, one warning each. The join's mark
    came after the side group but before ``join_ranks`` read the rank and made its tensor ("join-rank"): rank 1 failing
    there skipped the join, and rank 0's join met rank 1's DDP broadcast. The forward hook that decides a micro-batch
    cleared the agreement's due in a ``finally`` where it failed after the agreement fell due and before the controller
    made it ("begin"), and its shield's fallback entered nothing: rank 1's gradient all-reduce met rank 0's agreement
    (gloo aborted both). Failing after the controller made it ("decided"), rank 1 tells at the next micro-batch."""
    ranks = run_ranks("collective_faults", tmp_path, timeout_s=240)
    for result in ranks:
        plain = result["none"]
        assert len(plain["losses"]) == len(LENGTHS)
        for case in ("agree", "join", "join-rank", "worst", "begin", "decided"):
            run = result[case]
            assert run["losses"] == plain["losses"] and run["parameters"] == plain["parameters"], case
            assert run["pre_hooks"] == 0, case
    # The second micro-batch's agreement carried the flag; no agreement at all (the join told); four and the end's.
    cases = (("agree", 2), ("join", 0), ("join-rank", 0), ("worst", len(LENGTHS) + 1), ("begin", 2), ("decided", 3))
    for case, collectives in cases:
        assert ranks[0][case]["collectives"] == ranks[1][case]["collectives"] == collectives, case
    for case, where, since in (
        ("agree", "the pre-forward hook", "every rank goes on with plain checkpointing from this micro-batch on"),
        ("join", "attach", "every rank goes on with plain checkpointing from the start"),
        ("join-rank", "attach", "every rank goes on with plain checkpointing from the start"),
        ("worst", "finish", "this rank learned it at the end"),
        ("begin", "a watched call's entry", "every rank goes on with plain checkpointing from this micro-batch on"),
        ("decided", "a watched call's entry", "every rank goes on with plain checkpointing from this micro-batch on"),
    ):
        (mine,) = ranks[1][case]["warnings"]
        assert f"internal error in {where} (RuntimeError: injected failure on rank 1)" in mine, case
        (theirs,) = ranks[0][case]["warnings"]
        assert "rank 1 gave up" in theirs and since in theirs, (case, theirs)


class Config:
    """A user object whose attributes come from a dict: ``__getattr__`` raises ``KeyError`` for a name it lacks."""

    def __init__(self) -> None:
        self.cfg = {"seq": 64}

    def __getattr__(self, name: str):
        return self.cfg[name]

    def check(self) -> bool:
        return distributed.under_join()


def test_under_join_reads_no_attribute_of_a_user_object():
    """Issue 49, 1.2: ``under_join`` read ``_join_config`` with ``getattr(self, name, None)`` from every frame's
    ``self``; a ``KeyError`` from a user's ``__getattr__`` came out of it (and out of ``model(...)``)."""
    assert Config().check() is False


@needs_gloo
def test_training_from_a_user_object_with_a_dict_getattr_matches_plain_checkpointing(tmp_path):
    """Issue 49, 1.2: a DDP loop run from a method of a user object whose ``__getattr__`` reads a dict. Before, the
    pre-forward hook's join check raised that object's ``KeyError`` out of the first micro-batch's forward on every
    rank. Now both ranks train with the losses and parameters of plain checkpointing, agree every micro-batch, and
    warn nothing."""
    ranks = run_ranks("user_getattr", tmp_path, timeout_s=180)
    every = WORKER_LAYERS
    for result in ranks:
        plain, run = result["False"], result["True"]
        assert run["losses"] == plain["losses"] and run["parameters"] == plain["parameters"]
        assert [level for _, level in run["levels"]] == [0, every, 0, every]
        assert run["collectives"] == len(LENGTHS) + 1 and run["warnings"] == []
