"""PyTorch Lightning: ``autooffload.integrations.lightning.AutoOffload`` on a real ``lightning.pytorch.Trainer``
training a LightningModule around a tiny transformers model (tests/lightning_worker.py): one process with
gradient accumulation, a resume from Lightning's checkpoint, two DDP ranks over gloo, a failing step. Bytes moved
must equal the arithmetic, and losses and parameters those of plain checkpointing, bit for bit (fp32, dropout on).
Skipped where lightning is not installed (./dev installs it in .venv, not in the oldest environment)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_worker import HIDDEN, LAYERS, RANK_LENGTHS, CausalLM, fit, parameters, quiet

from autooffload import AutoOffloadWarning, MemoryReading, ScriptedProbe, SettingsError, lifecycle
from autooffload.history import read_history
from autooffload.integrations.lightning import AutoOffload
from autooffload.observe.costs import FIELDS as COSTS

TESTS = Path(__file__).resolve().parent
LENGTHS = [64, 64, 512, 64, 64, 64, 384, 64]
SETTINGS = dict(seq_high=256, seq_low=128, min_steps=1)


@pytest.fixture(autouse=True)
def _quiet_lightning():
    quiet()


def arithmetic(record: dict) -> int:
    """What a step moves: each micro-batch's offloaded layers x its tokens x hidden x 4 bytes (fp32)."""
    return sum(level * tokens * HIDDEN * 4 for level, tokens in zip(record["offloaded"], record["tokens"], strict=True))


def history(callback: AutoOffload) -> list[dict]:
    assert callback.history_path is not None
    return read_history(callback.history_path)


@pytest.mark.parametrize("accumulate", [1, 2, 3])
def test_one_step_per_optimizer_step_bytes_as_arithmetic_losses_as_plain(tmp_path, accumulate):
    callback = AutoOffload(**SETTINGS)
    trainer, module = fit(tmp_path / "with", LENGTHS, [callback], accumulate=accumulate)
    _, plain = fit(tmp_path / "plain", LENGTHS, [], accumulate=accumulate)

    records = history(callback)
    # Lightning's optimizer steps, the epoch's last shorter accumulation included (8 = 3 + 3 + 2).
    sizes = [len(LENGTHS[i : i + accumulate]) for i in range(0, len(LENGTHS), accumulate)]
    assert trainer.global_step == callback.controller.step == len(sizes)
    assert [r["step"] for r in records] == list(range(1, len(sizes) + 1))
    assert [len(r["seq_lens"]) for r in records] == sizes
    assert [seq for r in records for seq in r["seq_lens"]] == LENGTHS
    # The long micro-batches offload every layer; what moved is the arithmetic, step by step.
    levels = [level for r in records for level in r["offloaded"]]
    assert all(level == LAYERS for seq, level in zip(LENGTHS, levels, strict=True) if seq >= 256)
    assert [r["bytes_moved"] for r in records] == [arithmetic(r) for r in records]
    assert sum(r["bytes_moved"] for r in records) == callback.controller.stats.total_bytes > 0
    # Training is plain checkpointing's, bit for bit.
    assert module.losses == plain.losses
    assert parameters(module) == parameters(plain)
    # The history lies in the run's directory; the values went to Lightning's logger, one row per step.
    assert callback.history_path == Path(trainer.log_dir) / "autooffload" / "history.jsonl"
    rows = (Path(trainer.log_dir) / "metrics.csv").read_text().splitlines()
    columns = rows[0].split(",")
    logged = [float(row.split(",")[columns.index("autooffload/offloaded_bytes")]) for row in rows[1:]]
    assert logged == [r["bytes_moved"] for r in records]
    assert {"autooffload/active", "autooffload/switches", "autooffload/host_bytes"} <= set(columns)
    # Detached at the end: no hook, no owner.
    assert callback.controller.switch is None and lifecycle.owner(module.model) is None


def test_resume_from_a_lightning_checkpoint_continues_the_run_exactly(tmp_path):
    # Checkpoints at epoch ends (Lightning restarts a mid-epoch resume at the epoch's first batch unless the
    # dataloader is stateful). No dropout: Lightning's checkpoints do not hold the random state.
    lengths, settings = [64, 64, 512, 64], dict(seq_high=256, seq_low=128, min_steps=2)
    saves = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_epochs=1, save_top_k=-1)
    whole = AutoOffload(**settings)
    _, uninterrupted = fit(
        tmp_path, lengths, [whole, saves], max_epochs=3, enable_checkpointing=True, module=CausalLM(dropout=0.0)
    )
    written = whole.history_path.read_text()
    resumed = AutoOffload(**settings)
    checkpoint = tmp_path / "checkpoints" / "epoch=0-step=2.ckpt"
    _, module = fit(tmp_path, lengths, [resumed], max_epochs=3, ckpt_path=str(checkpoint), module=CausalLM(dropout=0.0))

    # The resumed run holds at step 3 because the saved dwell says so (a fresh one would have switched off),
    # and ends where the uninterrupted one did: same history file (cut back to step 2, then appended), state,
    # losses and parameters.
    records = read_history(resumed.history_path)
    assert records[2]["offloaded"] == [LAYERS, LAYERS] and records[2]["reasons"] == ["dwell", "dwell"]
    # Less what each step cost beside its compute (collections, seconds): a measurement of the process, not a decision.
    whole_records = [json.loads(line) for line in written.splitlines()]
    assert [{k: v for k, v in r.items() if k not in COSTS} for r in records] == [
        {k: v for k, v in r.items() if k not in COSTS} for r in whole_records
    ]
    assert resumed.controller.state_dict() == whole.controller.state_dict()
    assert module.losses == uninterrupted.losses[4:]
    assert parameters(module) == parameters(uninterrupted)


class DeviceReading(ScriptedProbe):
    """Reads as a GPU's probe does: ``peek()`` is the step's peak so far, which before the step's first training
    forward is only what the device held when the step began (1% here), and the step's reading after it."""

    def __init__(self) -> None:
        super().__init__([0.30])
        self.forwards, self.hook = 0, None

    def watch_model(self, model: torch.nn.Module, optimizer: object = None) -> None:
        self.hook = model.register_forward_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))

    def unwatch_model(self) -> None:
        if self.hook is not None:
            self.hook.remove()

    def reset(self) -> None:
        self.forwards = 0

    def peek(self) -> MemoryReading:
        return MemoryReading(round((0.30 if self.forwards else 0.01) * self.total_bytes), self.total_bytes)


def test_the_first_step_counts_the_optimizer_state_once_though_its_backward_runs_inside_the_step(tmp_path):
    # Lightning runs a step's last micro-batch (without accumulation, its only one) in the closure it hands to
    # optimizer.step(): a read before that step is not the backward's peak, so the AdamW state it creates (two
    # moments per parameter) is still to come, whole.
    callback = AutoOffload(**SETTINGS, probe=DeviceReading())
    _, module = fit(tmp_path, [512], [callback], accumulate=1, max_steps=1)
    state = 2 * sum(p.numel() * p.element_size() for p in module.parameters())
    assert callback.controller.memory.last.pending_bytes == state


def test_a_failing_step_leaves_the_model_detached_and_the_history_written(tmp_path):
    callback = AutoOffload(**SETTINGS)
    module = CausalLM(fail_at_step=2)
    with pytest.raises(RuntimeError, match="a failing training step"):
        fit(tmp_path, LENGTHS, [callback], module=module, log_every_n_steps=50)
    assert callback.controller.switch is None and lifecycle.owner(module.model) is None
    assert [r["step"] for r in history(callback)] == [1, 2]
    # The model trains on afterwards with plain checkpointing (no hook of ours left on it).
    module.fail_at_step = None
    loss = module.model(input_ids=torch.ones(1, 8, dtype=torch.long), labels=torch.ones(1, 8, dtype=torch.long)).loss
    loss.backward()


LIGHTNING_ENTRIES = (
    "Lightning on_train_start",
    "Lightning on_train_batch_start",
    "Lightning on_train_batch_end",
    "Lightning on_save_checkpoint",
    "Lightning state_dict",
    "Lightning on_train_end",
)


@pytest.mark.parametrize("where", LIGHTNING_ENTRIES)
def test_a_failure_at_an_entry_point_warns_once_and_fit_trains_as_plain(tmp_path, where):
    """Each of the callback's entry points failing at its second call (its first for those called once): one
    warning naming it, fit goes on to the end with plain checkpointing's losses and parameters, nothing left
    attached, and the next fit offloads again (a give-up lasts one run)."""
    from autooffload.guard import ENTRY_POINTS

    assert {w for w in ENTRY_POINTS if w.startswith("Lightning ")} == {
        *LIGHTNING_ENTRIES,
        "Lightning on_exception",
        "Lightning on_validation_end",
        "Lightning load_state_dict",
    }
    point, calls = ENTRY_POINTS[where], []
    original = point.method

    def failing(owner, *args, **kwargs):
        calls.append(1)
        if len(calls) == (1 if where in ("Lightning on_train_start", "Lightning on_train_end") else 2):
            raise RuntimeError("injected")
        return original(owner, *args, **kwargs)

    callback = AutoOffload(**SETTINGS)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    point.method = failing
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, module = fit(tmp_path / "with", LENGTHS, [callback, checkpoints], enable_checkpointing=True)
    finally:
        point.method = original
    _, plain = fit(tmp_path / "plain", LENGTHS, [])
    ours = [
        str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning) and "injected" in str(w.message)
    ]
    assert len(ours) == 1 and where in ours[0], ours
    assert module.losses == plain.losses
    assert parameters(module) == parameters(plain)
    assert callback.controller.switch is None and lifecycle.owner(module.model) is None
    assert not callback.controller.failed
    fit(tmp_path / "again", LENGTHS, [callback])
    assert callback.controller.stats.total_bytes > 0


def test_settings_from_the_environment_and_arguments_over_them(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_MODE", "on")
    on = AutoOffload()
    fit(tmp_path / "on", LENGTHS[:4], [on])
    assert [r["offloaded"] for r in history(on)] == [[LAYERS, LAYERS]] * 2
    off = AutoOffload(mode="off")
    fit(tmp_path / "off", LENGTHS[:4], [off])
    assert [r["offloaded"] for r in history(off)] == [[0, 0]] * 2
    monkeypatch.setenv("AUTOOFFLOAD_MODE", "sometimes")
    with pytest.raises(SettingsError, match="AUTOOFFLOAD_MODE"):
        AutoOffload()


def test_the_rescue_is_refused_once_when_asked_for_and_silent_otherwise(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path / "default", LENGTHS[:2], [AutoOffload(**SETTINGS)])
    refusal = "out-of-memory steps are not rescued under Lightning"
    assert not [w for w in caught if refusal in str(w.message)]  # (a CPU's no-probe warning is there)
    with pytest.warns(AutoOffloadWarning, match=refusal) as caught:
        fit(tmp_path / "asked", LENGTHS[:4], [AutoOffload(rescue=True, **SETTINGS)])
    assert len([w for w in caught if refusal in str(w.message)]) == 1


def test_what_it_controls():
    module = CausalLM()
    assert AutoOffload().controlled(module) is module.model  # the first module with a config
    assert AutoOffload(model="model").controlled(module) is module.model
    assert AutoOffload(model=lambda m: m.model.model).controlled(module) is module.model.model


def test_without_checkpointing_it_warns_once_and_training_goes_on(tmp_path):
    module = CausalLM()
    module.model.gradient_checkpointing_disable()
    callback = AutoOffload(**SETTINGS)
    with pytest.warns(AutoOffloadWarning, match="no checkpointed layers found"):
        _, plain = fit(tmp_path, LENGTHS[:4], [callback], module=module)
    assert callback.controller.step == 2 and callback.history_path is None and len(plain.losses) == 4


def test_importing_autooffload_does_not_import_lightning():
    code = "import sys, autooffload, autooffload.callback; print('lightning' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.stdout.strip() == "False", result.stderr


# ---- two DDP ranks over gloo, started by torchrun --------------------------------------------------------


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="needs gloo"
)
def test_ddp_two_ranks_agree_write_their_own_history_and_train_as_plain(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOOFFLOAD_", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(TESTS / "lightning_worker.py"), str(tmp_path)]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the two ranks did not finish in 240 s:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]

    directory = Path(ranks[0]["log_dir"]) / "autooffload"
    assert sorted(p.name for p in directory.iterdir()) == ["history-rank0.jsonl", "history-rank1.jsonl"]
    histories = [read_history(directory / f"history-rank{rank}.jsonl") for rank in range(2)]
    for rank, (result, records) in enumerate(zip(ranks, histories, strict=True)):
        assert result["world_size"] == 2 and result["step"] == 4 and not result["attached"]
        assert [seq for r in records for seq in r["seq_lens"]] == [pair[rank] for pair in RANK_LENGTHS]
        assert [r["bytes_moved"] for r in records] == [arithmetic(r) for r in records]
        assert sum(r["bytes_moved"] for r in records) == result["total_bytes"]
        assert result["losses"] == result["plain_losses"]
        assert result["parameters"] == result["plain_parameters"]
    # One level per micro-batch on both ranks: the long micro-batch of either rank offloads both (rank 0's
    # first in step 2, rank 1's second in step 4); the other rank took it from the group.
    levels = [[r["offloaded"] for r in records] for records in histories]
    assert levels[0] == levels[1] == [[0, 0], [LAYERS, LAYERS], [0, 0], [0, LAYERS]]
    assert histories[1][1]["reasons"][0] == histories[0][3]["reasons"][1] == "rank_agreement"
    assert ranks[0]["parameters"] == ranks[1]["parameters"]


def test_ddp_one_rank_failing_at_train_start_leaves_no_rank_in_a_collective(tmp_path):
    """Rank 1 fails in on_train_start before it reads trainer.log_dir (a broadcast under DDP): it must still make
    that broadcast, or rank 0 waits in it and the ranks' next collectives mismatch (a hang; under gloo an abort)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOOFFLOAD_", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(TESTS / "lightning_worker.py"), str(tmp_path), "give_up"]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the two ranks did not finish in 180 s:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [r["step"] for r in ranks] == [4, 4]
    assert ranks[0]["parameters"] == ranks[1]["parameters"]
    assert any("internal error in Lightning on_train_start" in w for w in ranks[1]["warnings"]), ranks[1]
    assert any("rank 1 gave up" in w for w in ranks[0]["warnings"]), ranks[0]
