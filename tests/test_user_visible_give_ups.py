"""Giving up, as a user sees it (issue 54, item 4): the one warning names what failed first, a run that ended
(or raised) leaves nothing behind that stops the next one, and an optimizer without torch's step hooks (accelerate's
wrapper of DeepSpeed's) is no reason to give up. Real tiny Qwen3 models, real torch optimizers, a real Trainer;
failures are injected through the registry the guard keeps for that (``autooffload.guard.IN_STEP``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import InOrderTrainer, dataset, expected_bytes, model, random_ids, training_args
from transformers import TrainerCallback

from autooffload import AutoOffloadWarning, OffloadController, Settings, SimulatedDevice
from autooffload.apply.host_memory import HostMemory
from autooffload.callback import attach
from autooffload.guard import IN_STEP

PACK, UNPACK = "the sync engine's pack hook", "the sync engine's unpack hook"
SEQ = 48


def pinned_host() -> HostMemory:
    return HostMemory(pin=True, register=lambda t: None, unregister=lambda t: None, drain=lambda d: None)


class Faults:
    """Make the places named fail: ``plan[where]`` lists the calls (counted from 1) of that place that raise."""

    def __init__(self, plan: dict[str, set[int]], armed: bool = True) -> None:
        self.plan, self.calls, self.armed = plan, {where: 0 for where in plan}, armed

    def __enter__(self) -> Faults:
        for where in self.plan:
            IN_STEP[where].fault = self._fault(where)
        return self

    def _fault(self, where: str):
        def fault() -> None:
            if not self.armed:
                return
            self.calls[where] += 1
            if self.calls[where] in self.plan[where]:
                raise RuntimeError(f"injected at {where}, call {self.calls[where]}")

        return fault

    def __exit__(self, *exc) -> None:
        for where in self.plan:
            IN_STEP[where].fault = None


def ours(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]


def checkpointed() -> torch.nn.Module:
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return net.train()


def step(net, controller, optimizer=None) -> None:
    ids = random_ids(SEQ)
    net(input_ids=ids, labels=ids).loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()
    else:
        net.zero_grad()
    controller.end_step()


def test_the_give_up_warning_names_the_first_failure_of_a_step():
    """Two failures inside one backward, with no entry point between them: the unpack hook fails at its first call
    and again at its second. The one warning names the first (what started it; a later one may be its
    consequence, and naming it sends the user to the wrong place). Fails if ``StepFaults.shield`` keeps the latest
    failure (autooffload/guard.py:83, ``if self.first is None:`` made ``if True:``)."""
    net = checkpointed()
    controller = OffloadController(
        Settings(mode="on", host_memory="1GiB", engine="sync"), probe=None, host=pinned_host()
    )
    with warnings.catch_warnings(record=True) as caught, Faults({UNPACK: {1, 2}}) as faults:
        warnings.simplefilter("always", AutoOffloadWarning)
        assert controller.attach(net)
        step(net, controller)
    assert faults.calls[UNPACK] >= 2  # both failed in the step's backward
    (warning,) = ours(caught)
    assert f"internal error in {UNPACK} (RuntimeError: injected at {UNPACK}, call 1)" in warning, warning
    assert controller.failed


class FailInStep(TrainerCallback):
    """The user's own callback, ahead of autooffload's: at step ``at`` it arms ``faults`` as the step begins (the
    step's forward fails inside), and raises as the step ends, so train() ends with no entry point of autooffload's
    after that step's forward and backward."""

    def __init__(self, faults: Faults, at: int, raises: bool = True) -> None:
        self.faults, self.at, self.raises = faults, at, raises

    def on_step_begin(self, args, state, control, **kwargs):
        self.faults.armed = self.at is not None and state.global_step + 1 == self.at

    def on_step_end(self, args, state, control, **kwargs):
        if self.raises and self.at is not None and state.global_step == self.at:
            raise KeyboardInterrupt


def test_a_failure_inside_the_last_step_of_a_train_that_raised_does_not_stop_the_next_train(tmp_path):
    """``train()`` raises (the user's callback, at step 2's end) right after an in-step failure in that step's
    backward, before any entry point of autooffload's took it. The clean-up of ``attach(trainer)`` ends the run; the
    next ``train()`` must offload every step, not give up at its first entry with the dead run's failure. Fails if
    ``end_run`` keeps the pending failure (autooffload/run.py:264, ``self.faults.take()`` dropped)."""
    faults = Faults({UNPACK: {1}}, armed=False)
    user = FailInStep(faults, 2)
    trainer = InOrderTrainer(
        model=model(), args=training_args(tmp_path, 3), train_dataset=dataset([64] * 3), callbacks=[user]
    )
    callback = attach(trainer, mode="on", probe=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with faults:
            with pytest.raises(KeyboardInterrupt):
                trainer.train()
            assert faults.calls[UNPACK] >= 1 and not callback.controller.failed  # failed inside, never taken
            user.at = None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", AutoOffloadWarning)
                trainer.train()
    assert ours(caught) == [] and not callback.controller.failed
    assert trainer.state.global_step == 3
    assert callback.controller.stats.total_bytes == 3 * expected_bytes(64)


def test_a_train_after_one_that_gave_up_inside_a_step_offloads_every_step(tmp_path):
    """A ``train()`` gives up at the entry after an in-step failure of its second step (one warning) and goes on
    with plain checkpointing to its end; the next ``train()`` of the same trainer offloads every step: the give-up
    lasts until its run ends, not for the controller's life, and says nothing more."""
    faults = Faults({PACK: {1}}, armed=False)
    trainer = InOrderTrainer(
        model=model(), args=training_args(tmp_path, 3), train_dataset=dataset([64] * 3), callbacks=[]
    )
    callback = attach(trainer, mode="on", probe=None)
    with warnings.catch_warnings(record=True) as caught, faults:
        warnings.simplefilter("always", AutoOffloadWarning)
        trainer.add_callback(FailInStep(faults, 2, raises=False))
        trainer.train()
        first = callback.controller.stats.total_bytes
        assert faults.calls[PACK] >= 1 and len(ours(caught)) == 1 and PACK in ours(caught)[0]
        assert first < 2 * expected_bytes(64)  # step 1's, and step 2's before its failure; none of step 3's
        faults.plan[PACK] = set()
        trainer.train()
    assert len(ours(caught)) == 1 and not callback.controller.failed
    assert callback.controller.stats.total_bytes == 3 * expected_bytes(64)  # a new run counts from 0


class ZeroStageOptimizer:
    """What DeepSpeed's engine hands accelerate: an optimizer that is no ``torch.optim.Optimizer`` (it steps,
    zeroes and keeps state of its own). Stands in for DeepSpeed, which this suite runs without."""

    def __init__(self, params) -> None:
        self.param_groups = [{"params": list(params), "lr": 1e-3}]
        self.state: dict = {}

    def step(self, closure=None) -> None:
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-1e-3)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_an_optimizer_without_torchs_step_hooks_trains_on_without_giving_up():
    """accelerate's ``DeepSpeedOptimizerWrapper`` is a ``torch.optim.Optimizer`` whose ``__init__`` never ran: it has
    no step hooks, and registering one raises. With a probe that can peek (SimulatedDevice), each step's start
    looks at the optimizer: it must skip the hook, not give up the run at ``begin_step`` with an internal-error
    warning. Runs without DeepSpeed (accelerate's own wrapper, around an optimizer of DeepSpeed's kind). Fails if
    the check for the hooks goes (autooffload/observe/memory.py:152, ``or hooks is None`` dropped)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedOptimizerWrapper

    Accelerator(cpu=True)  # the state accelerate's wrappers read, as under Trainer
    net = checkpointed()
    optimizer = DeepSpeedOptimizerWrapper(ZeroStageOptimizer(net.parameters()))
    assert (
        isinstance(optimizer, torch.optim.Optimizer) and getattr(optimizer, "_optimizer_step_pre_hooks", None) is None
    )
    controller = OffloadController(Settings(recompute="auto"), probe=SimulatedDevice(2**34))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        assert controller.attach(net, optimizer=optimizer)
        for _ in range(3):
            controller.begin_step()
            ids = random_ids(SEQ)
            net(input_ids=ids, labels=ids).loss.backward()
            optimizer.optimizer.step()  # DeepSpeed's engine steps; the wrapper's step() does nothing
            optimizer.zero_grad()
            controller.end_step()
    assert ours(caught) == [] and not controller.failed
    assert controller.switch is not None and controller.memory.last.bytes is not None
    controller.detach()
