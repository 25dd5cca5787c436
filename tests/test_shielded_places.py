"""The shielded places that the custom loops of tests/test_in_step_faults.py do not reach (issue 49, section 2):
the optimizer's pre-step hook, the simulated device's count, plain checkpointing's check after a give-up, a host
memory manager's finalizer, and the methods of the Trainer callback and wrapper that the fault matrix, which attaches
to a built Trainer, does not reach as entry points. Each fails at its first call: training finishes every step with
plain checkpointing's losses, one warning names the place (where a run is there to give up), nothing escapes."""

from __future__ import annotations

import gc
import sys
import warnings
from typing import Any

import pytest
import torch
from conftest import InOrderTrainer, dataset, model, training_args

import autooffload
import autooffload.rescue
from autooffload import AutoOffloadCallback, AutoOffloadWarning, OffloadController, Settings, SimulatedDevice
from autooffload.apply.host_memory import HostMemory
from autooffload.guard import IN_STEP

LENGTHS = [64, 192, 64, 192]
# Each place, by the run that reaches it.
ELSEWHERE = {
    "the optimizer's pre-step hook": "loop",
    "the simulated device's count": "loop",
    "plain checkpointing's check": "given up",
    "host memory's finalizer": "finalizer",
    "the callback's settings at Trainer's init": "trainer",
    "the rescue's step start": "trainer",
    "the callback's restored state": "resumed",
}


class Failing:
    """Makes ``where`` raise at its first call while in use; counts its calls."""

    def __init__(self, where: str | None) -> None:
        self.where, self.calls = where, 0

    def __enter__(self) -> Failing:
        if self.where is not None:
            IN_STEP[self.where].fault = self.fault
        return self

    def fault(self) -> None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError(f"injected at {self.where}")

    def __exit__(self, *exc: object) -> None:
        if self.where is not None:
            IN_STEP[self.where].fault = None


def loop(fail_at: str | None, plain: bool = False, give_up: bool = False) -> tuple[list[float], list[str], Any]:
    """A custom loop through AdamW, its memory read by a SimulatedDevice; ``give_up`` after its second step."""
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    controller = None if plain else OffloadController(Settings(mode="on"), probe=SimulatedDevice("1GiB"))
    losses = []
    with warnings.catch_warnings(record=True) as caught, Failing(fail_at):
        warnings.simplefilter("always", AutoOffloadWarning)
        if controller is not None:
            controller.attach(net, optimizer=optimizer)
        for step, seq in enumerate(LENGTHS):
            if give_up and step == 2 and controller is not None:
                controller.give_up("a test", RuntimeError("given up on purpose"))
            ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
            loss = net(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if controller is not None:
                controller.end_step()
        if controller is not None:
            controller.detach()
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    return losses, ours, controller


def trainer_run(
    tmp_path, fail_at: str | None, plain: bool = False, resume: bool = False
) -> tuple[list[float], list[str]]:
    """Trainer over ``LENGTHS``, ``autooffload.attach``-ed to a callback passed at construction; ``resume``: from its
    second step's checkpoint, the callback object restored from it."""
    extra = dict(save_strategy="steps", save_steps=2, restore_callback_states_from_checkpoint=True)
    args = training_args(tmp_path, len(LENGTHS), None if plain else "auto", **extra)
    callbacks = [] if plain else [AutoOffloadCallback(probe=SimulatedDevice("2.4MiB"), mode="on")]
    with warnings.catch_warnings(record=True) as caught, Failing(fail_at):
        warnings.simplefilter("always", AutoOffloadWarning)
        trainer = InOrderTrainer(model=model(), args=args, train_dataset=dataset(LENGTHS), callbacks=callbacks)
        if not plain:
            autooffload.attach(trainer)
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2") if resume else None)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]


def test_every_place_elsewhere_is_registered():
    assert set(ELSEWHERE) <= set(IN_STEP)


@pytest.mark.parametrize("where", ["the optimizer's pre-step hook", "the simulated device's count"])
def test_a_failure_in_a_hook_of_a_custom_loop_leaves_training_as_plain(where):
    reference, _, _ = loop(None, plain=True)
    losses, ours, controller = loop(where)
    assert losses == reference
    (warning,) = ours
    if where == "the simulated device's count":  # the probe's failure: the run goes on without its reading
        assert f"SimulatedDevice failed in {where} (RuntimeError: injected at {where})" in warning, warning
        assert not controller.failed
    else:
        assert f"internal error in {where} (RuntimeError: injected at {where})" in warning, warning
        assert controller.failed


def test_a_failure_in_plain_checkpointings_check_after_a_give_up_changes_nothing():
    reference, _, _ = loop(None, plain=True)
    losses, ours, controller = loop("plain checkpointing's check", give_up=True)
    assert losses == reference
    (warning,) = ours  # the give-up's own, nothing more
    assert "given up on purpose" in warning and controller.failed


def test_a_failure_in_host_memorys_finalizer_escapes_nowhere(monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with Failing("host memory's finalizer") as failing:
        host = HostMemory()
        del host
        gc.collect()
    assert failing.calls >= 1 and unraisable == []


@pytest.mark.parametrize("where", ["the callback's settings at Trainer's init", "the rescue's step start"])
def test_a_failure_in_a_method_trainer_calls_gives_up_and_trains_as_plain(tmp_path, where):
    reference, _ = trainer_run(tmp_path / "plain", None, plain=True)
    losses, ours = trainer_run(tmp_path / "with", where)
    assert losses == reference and len(losses) == len(LENGTHS)
    (warning,) = ours
    assert f"internal error in {where} (RuntimeError: injected at {where})" in warning, warning


def test_a_failure_restoring_the_callbacks_state_gives_up_and_the_resumed_run_trains_as_plain(tmp_path):
    where = "the callback's restored state"
    trainer_run(tmp_path / "plain", None, plain=True)
    reference, _ = trainer_run(tmp_path / "plain", None, plain=True, resume=True)
    trainer_run(tmp_path / "with", None)
    losses, ours = trainer_run(tmp_path / "with", where, resume=True)
    assert losses == reference and len(losses) == len(LENGTHS)  # the history of the run resumed included
    (warning,) = ours
    assert f"internal error in {where} (RuntimeError: injected at {where})" in warning, warning
