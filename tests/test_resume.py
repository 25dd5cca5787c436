"""Resuming from a Trainer checkpoint continues with the same offload level, dwell counter and switch count."""

from __future__ import annotations

import pytest
from conftest import InOrderTrainer, dataset, expected_bytes, model, training_args

from autooffload import AutoOffloadCallback, ScriptedProbe

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
    assert first.controller.state_dict()["level"] == 4 and first.controller.switches == 1

    probe = ScriptedProbe([0.5])
    second = AutoOffloadCallback(seq_high=200, seq_low=100, min_steps=4, probe=probe, policy="hysteresis")
    args = training_args(tmp_path, 5, save_strategy="no", restore_callback_states_from_checkpoint=rebuild)
    trainer = InOrderTrainer(model=model(), args=args, train_dataset=dataset(LENGTHS), callbacks=[second])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))

    (resumed,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AutoOffloadCallback)]
    assert (resumed is not second) == rebuild
    # Steps 3 and 4 are short, but the switch at step 1 is still inside its 4-step dwell: offload stays on.
    assert offload_logs(trainer)[3:] == [(4, 1.0, expected_bytes(64)), (5, 1.0, expected_bytes(64))]
    assert resumed.controller.step == 5 and resumed.controller.switches == 1
    # With restore_callback_states_from_checkpoint Trainer rebuilds the callback from its saved arguments;
    # the probe object, which cannot go through JSON, comes from the instance it replaced.
    assert resumed.controller.probe is probe and resumed.controller.memory_fraction == 0.5


def test_a_fresh_run_without_the_state_would_have_switched_off(tmp_path):
    callback = AutoOffloadCallback(seq_high=200, seq_low=100, min_steps=4, probe=None)
    args = training_args(tmp_path, 2, save_strategy="no")
    trainer = InOrderTrainer(model=model(), args=args, train_dataset=dataset(LENGTHS[3:]), callbacks=[callback])
    trainer.train()
    assert [active for _, active, _ in offload_logs(trainer)] == [0.0, 0.0]
