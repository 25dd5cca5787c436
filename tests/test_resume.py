"""Resuming from a Trainer checkpoint continues with the same offload level, dwell counter and switch count."""

from __future__ import annotations

import pytest
from conftest import InOrderTrainer, dataset, expected_bytes, model, training_args
from transformers import TrainerCallback

from autooffload import AutoOffloadCallback, ScriptedProbe
from autooffload.history import history_path, read_history
from autooffload.observe.costs import FIELDS as COSTS

LENGTHS = [64, 256, 64, 64, 64]


def offload_logs(trainer):
    return [
        (h["step"], h["autooffload/active"], h["autooffload/offloaded_bytes"])
        for h in trainer.state.log_history
        if "loss" in h
    ]


@pytest.mark.parametrize("rebuild", [False, True], ids=["default", "restore_callback_states"])
def test_resume_restores_the_controller_state(tmp_path, rebuild):
    first = AutoOffloadCallback(seq_high=200, seq_low=100, min_steps=4, probe=None, policy="hysteresis")
    args = training_args(tmp_path, 3, save_strategy="steps", save_steps=3)
    InOrderTrainer(model=model(), args=args, train_dataset=dataset(LENGTHS), callbacks=[first]).train()
    assert first.controller.state_dict()["level"] == 4 and first.controller.record.switches == 1

    probe = ScriptedProbe([0.5])
    second = AutoOffloadCallback(seq_high=200, seq_low=100, min_steps=4, probe=probe, policy="hysteresis")
    args = training_args(tmp_path, 5, save_strategy="no", restore_callback_states_from_checkpoint=rebuild)
    trainer = InOrderTrainer(model=model(), args=args, train_dataset=dataset(LENGTHS), callbacks=[second])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))

    (resumed,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AutoOffloadCallback)]
    assert (resumed is not second) == rebuild
    # Steps 3 and 4 are short, but the switch at step 1 is still inside its 4-step dwell: offload stays on.
    assert offload_logs(trainer)[3:] == [(4, 1.0, expected_bytes(64)), (5, 1.0, expected_bytes(64))]
    assert resumed.controller.step == 5 and resumed.controller.record.switches == 1
    # With restore_callback_states_from_checkpoint Trainer rebuilds the callback from its saved arguments;
    # the probe object, which cannot go through JSON, comes from the instance it replaced.
    assert resumed.controller.memory.probe is probe and resumed.controller.memory_fraction == 0.5


def test_a_fresh_run_without_the_state_would_have_switched_off(tmp_path):
    callback = AutoOffloadCallback(seq_high=200, seq_low=100, min_steps=4, probe=None)
    args = training_args(tmp_path, 2, save_strategy="no")
    trainer = InOrderTrainer(model=model(), args=args, train_dataset=dataset(LENGTHS[3:]), callbacks=[callback])
    trainer.train()
    assert [active for _, active, _ in offload_logs(trainer)] == [0.0, 0.0]


class MicroBatchLevels(TrainerCallback):
    """The offload level of every micro-batch (Trainer calls on_substep_end after each one but the last of a
    step, on_step_end after the last) and the bytes moved in every step."""

    def __init__(self) -> None:
        self.levels: list[int] = []
        self.moved: list[int] = []

    def on_substep_end(self, args, state, control, **kwargs):
        self.levels.append(self.controller.level)

    def on_step_end(self, args, state, control, **kwargs):
        self.levels.append(self.controller.level)
        self.moved.append(self.controller.last_step_bytes)


CURVE = [0.3, 0.35, 0.99, 0.3, 0.3, 0.3]  # the step before the resume read 0.99: the next one must offload
ACCUMULATED = [64, 96, 128, 80, 112, 72, 96, 64, 80, 128, 64, 96]  # 6 steps of 2 micro-batches


def levels_run(tmp_path, policy, steps, fractions, resume=None, save_steps=None):
    callback = AutoOffloadCallback(min_steps=2, probe=ScriptedProbe(fractions), policy=policy)
    recorder = MicroBatchLevels()
    save = dict(save_strategy="steps", save_steps=save_steps) if save_steps else dict(save_strategy="no")
    args = training_args(tmp_path, steps, gradient_accumulation_steps=2, **save)
    trainer = InOrderTrainer(
        model=model(), args=args, train_dataset=dataset(ACCUMULATED), callbacks=[callback, recorder]
    )
    recorder.controller = callback.controller
    trainer.train(resume_from_checkpoint=resume)
    return recorder


@pytest.mark.parametrize("policy", ["hysteresis", "predictive"])
def test_a_resumed_run_decides_as_the_uninterrupted_one(tmp_path, policy):
    whole = levels_run(tmp_path / "whole", policy, 6, CURVE, save_steps=3)  # the save the resumed one comes from
    levels_run(tmp_path / "first", policy, 3, CURVE, save_steps=3)
    # The resumed run's probe continues the curve where the first run's stopped.
    resumed = levels_run(tmp_path / "first", policy, 6, CURVE[3:], resume=str(tmp_path / "first" / "checkpoint-3"))

    assert whole.levels[6] > 0  # the step after the save offloads, from the reading saved with the checkpoint
    assert resumed.levels == whole.levels[6:]
    assert resumed.moved == whole.moved[3:]


# Resume is exact: a run resumed from a checkpoint decides, step by step and micro-batch by micro-batch, as the
# run that saved it went on to decide (same saves: a save between two steps is in the uninterrupted run too).
EXACT_LENGTHS = [64, 96, 128, 64, 160, 64, 96, 64, 128, 80]  # 5 steps of 2 micro-batches
EXACT = {
    # 95% read up to step 2, the checkpoint's step, then 50%: hysteresis holds offload through step 4
    "high_until_the_checkpoint": ({}, [0.95, 0.95, 0.5]),
    "high_after_the_checkpoint": ({}, [0.5, 0.5, 0.95, 0.5]),
    "short_dwell_low_thresholds": (
        {"min_steps": 1, "memory_high": 0.6, "memory_low": 0.4},
        [0.3, 0.65, 0.5, 0.35, 0.7],
    ),
    "recompute_auto": ({"recompute": "auto"}, [0.3, 0.5, 0.95, 0.3]),
    "sequence_trigger": ({"seq_high": 150, "seq_low": 100, "min_steps": 3}, [0.3]),
}


def exact_run(out, settings, curve, steps, resume=None):
    callback = AutoOffloadCallback(probe=ScriptedProbe(curve), **settings)
    args = training_args(out, steps, gradient_accumulation_steps=2, save_strategy="steps", save_steps=2)
    trainer = InOrderTrainer(model=model(), args=args, train_dataset=dataset(EXACT_LENGTHS), callbacks=[callback])
    trainer.train(resume_from_checkpoint=resume)
    return read_history(history_path(out)), callback.controller.state_dict()


@pytest.mark.filterwarnings("ignore:.*RECOMPUTE=auto needs a policy that predicts")  # hysteresis keeps nothing
@pytest.mark.parametrize("policy", ["predictive", "hysteresis"])
@pytest.mark.parametrize("name", list(EXACT))
def test_resume_is_exact_for_every_policy_and_setting(tmp_path, monkeypatch, policy, name):
    monkeypatch.setenv("AUTOOFFLOAD_POLICY", policy)
    settings, curve = EXACT[name]
    whole, whole_state = exact_run(tmp_path / "whole", settings, curve, 5)
    exact_run(tmp_path / "cut", settings, curve, 2)
    checkpoint = str(tmp_path / "cut" / "checkpoint-2")
    rest = curve[2:] or curve[-1:]  # the probe goes on where the first run's stopped
    resumed, resumed_state = exact_run(tmp_path / "cut", settings, rest, 5, resume=checkpoint)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert [(r["offloaded"], r["kept"], r["reasons"]) for r in resumed] == [
        (r["offloaded"], r["kept"], r["reasons"]) for r in whole
    ]
    assert decided(resumed) == decided(whole)
    assert resumed_state == whole_state


def decided(records: list[dict]) -> list[dict]:
    """A history less what each step cost beside its compute (collections, seconds, buffers newly mapped): those
    measure the process and the machine, which a resume changes; everything decided and moved must not."""
    return [{key: value for key, value in record.items() if key not in COSTS} for record in records]
