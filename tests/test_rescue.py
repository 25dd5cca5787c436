"""Rescue: an out-of-memory error in a step is rerun with every layer offloaded, and nothing is counted twice.

The error is injected where a real one strikes: in the forward (a pre-hook on the final norm, after every
checkpointed layer has saved its input) or in the backward (a gradient hook on the first layer's weight,
after the later layers have already accumulated this micro-batch's gradients). With gradient accumulation
of 2 the error hits the second micro-batch of a step, so the first one's gradients are already there too.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from conftest import LAYERS, dataset, expected_bytes, model, training_args
from transformers import Trainer, TrainerCallback

from autooffload import AutoOffloadCallback, AutoOffloadWarning, OffloadController, Rescue, Settings, attach

LENGTHS = [64, 96, 128, 80, 112, 72]  # 3 steps of 2 micro-batches
FAIL_AT = 4  # the 4th micro-batch: the second of step 1


class Injector:
    """Raises torch.OutOfMemoryError at the ``at``-th call of a forward pre-hook or a gradient hook, ``times``
    times in a row; remembers the errors it raised and whether the failed forward's input was freed by the
    next call."""

    def __init__(self, at: int, times: int = 1) -> None:
        self.at, self.times = at, times
        self.calls = 0
        self.errors: list[torch.OutOfMemoryError] = []
        self.failed_input: weakref.ref | None = None
        self.freed_at_retry: bool | None = None

    def _maybe_raise(self) -> None:
        self.calls += 1
        if self.at <= self.calls < self.at + self.times:
            self.errors.append(torch.OutOfMemoryError(f"injected at call {self.calls}"))
            raise self.errors[-1]

    def forward_hook(self, module, args):
        if not (module.training and torch.is_grad_enabled()):
            return
        if self.failed_input is not None and self.freed_at_retry is None:
            self.freed_at_retry = self.failed_input() is None
        self.failed_input = weakref.ref(args[0]) if self.calls + 1 == self.at else self.failed_input
        self._maybe_raise()

    def gradient_hook(self, grad):
        self._maybe_raise()

    def install(self, net: torch.nn.Module, where: str) -> None:
        if where == "forward":
            net.model.norm.register_forward_pre_hook(self.forward_hook)
        else:
            net.model.layers[0].mlp.down_proj.weight.register_hook(self.gradient_hook)


class StepBytes(TrainerCallback):
    def __init__(self, callback: AutoOffloadCallback) -> None:
        self.controller = callback.controller
        self.moved: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.moved.append(self.controller.last_step_bytes)


def run(tmp_path, injector: Injector | None, where: str = "forward", **callback_kwargs):
    net = model()
    if injector is not None:
        injector.install(net, where)
    args = training_args(tmp_path, len(LENGTHS) // 2, gradient_accumulation_steps=2)
    from conftest import InOrderTrainer

    trainer = InOrderTrainer(model=net, args=args, train_dataset=dataset(LENGTHS))
    callback = attach(trainer, probe=None, **callback_kwargs)
    recorder = StepBytes(callback)
    trainer.add_callback(recorder)
    trainer.train()
    return trainer, net, callback, recorder.moved


def losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_rescued_step_gives_the_losses_and_parameters_of_a_run_that_never_failed(tmp_path, where):
    reference, reference_net, _, _ = run(tmp_path / "reference", None)
    injector = Injector(at=FAIL_AT)
    trainer, net, callback, moved = run(tmp_path / "rescued", injector, where)

    assert len(injector.errors) == 1 and callback.controller.record.rescues == 1
    assert losses(trainer) == losses(reference)
    for (name, a), (_, b) in zip(net.named_parameters(), reference_net.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    # The failed attempt ran plain; the rerun replayed both micro-batches of step 1 with every layer offloaded,
    # and step 2 is plain again.
    assert moved == [0, expected_bytes(128) + expected_bytes(80), 0]
    assert trainer.state.log_history[1]["autooffload/rescues"] == 1.0
    if where == "forward":
        assert injector.freed_at_retry is True


def test_a_second_failure_raises_the_original_error(tmp_path):
    injector = Injector(at=FAIL_AT, times=10)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        run(tmp_path, injector, "backward")
    assert raised.value is injector.errors[0] and len(injector.errors) == 2
    if hasattr(raised.value, "__notes__"):
        assert "ran out of memory too" in raised.value.__notes__[0]


def test_rescue_off_raises_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_RESCUE", "0")
    injector = Injector(at=FAIL_AT)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        run(tmp_path, injector, "forward")
    assert raised.value is injector.errors[0] and injector.calls == FAIL_AT


def test_a_mock_over_training_step_is_rescued_through(tmp_path):
    """A test that counts the steps patches ``trainer.training_step`` with a ``MagicMock`` calling the real one
    before ``attach``. A mock answers every attribute: it must not be taken for the rescue's own wrapper (then
    nothing is wrapped and the out-of-memory error ends the run)."""
    import unittest.mock

    from conftest import InOrderTrainer

    reference, reference_net, _, _ = run(tmp_path / "reference", None)
    net = model()
    injector = Injector(at=FAIL_AT)
    injector.install(net, "forward")
    args = training_args(tmp_path / "mocked", len(LENGTHS) // 2, gradient_accumulation_steps=2)
    trainer = InOrderTrainer(model=net, args=args, train_dataset=dataset(LENGTHS))
    with unittest.mock.patch.object(trainer, "training_step", side_effect=trainer.training_step) as step:
        callback = attach(trainer, probe=None)
        trainer.train()
    assert len(injector.errors) == 1 and callback.controller.record.rescues == 1
    assert step.call_count == len(LENGTHS) + 2  # the rerun replays step 1's two micro-batches through the mock
    assert losses(trainer) == losses(reference)
    for (name, a), (_, b) in zip(net.named_parameters(), reference_net.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_attach_uses_the_trainer_callback_and_wraps_once(tmp_path):
    from conftest import InOrderTrainer

    callback = AutoOffloadCallback(probe=None)
    args = training_args(tmp_path, 1)
    trainer = InOrderTrainer(model=model(), args=args, train_dataset=dataset([64]), callbacks=[callback])
    assert attach(trainer) is callback
    wrapped = trainer.training_step
    assert attach(trainer) is callback and trainer.training_step is wrapped
    with pytest.raises(TypeError, match="already has an AutoOffloadCallback"):
        attach(trainer, mode="on")


def test_attach_raises_the_callers_type_errors_and_gives_up_on_its_own(tmp_path, monkeypatch):
    """Review of issue 49: ``attach(trainer)`` let every ``TypeError`` out as the caller's, its own bugs too (here one
    inside the rescue's wrapping): the job stopped. Now a wrong argument raises, and a ``TypeError`` of autooffload's
    gives one warning, the run training as plain checkpointing does."""
    import warnings

    from conftest import InOrderTrainer

    import autooffload.rescue

    def trainer():
        args = training_args(tmp_path, 2, offload=None)
        torch.manual_seed(0)
        return InOrderTrainer(model=model(), args=args, train_dataset=dataset([64, 128]))

    with pytest.raises(TypeError, match="bogus"):
        attach(trainer(), bogus=1)
    plain = trainer()
    plain.train()
    monkeypatch.setattr(autooffload.rescue, "with_rescue", lambda *args: None + 1)
    ours = trainer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        attach(ours, probe=None)
        ours.train()
    (warning,) = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert "internal error in attach(trainer) (TypeError" in warning
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (plain, ours)]
    assert losses[0] == losses[1] and len(losses[0]) == 2


def test_custom_loop_rescue_matches_a_loop_that_never_failed():
    def loop(injector: Injector | None) -> tuple[torch.nn.Module, list[float], OffloadController]:
        net = model()
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        net.train()
        if injector is not None:
            injector.install(net, "backward")
        controller = OffloadController(Settings(), probe=None)
        controller.attach(net)
        rescue = Rescue(controller, net)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        data = dataset(LENGTHS)
        step_losses = []
        for start in range(0, len(LENGTHS), 2):
            batches = [data[i] for i in (start, start + 1)]

            def forward_backward(batches=batches) -> float:
                total = 0.0
                for batch in batches:
                    loss = net(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss / 2
                    loss.backward()
                    total += loss.item()
                return total

            step_losses.append(rescue.run(forward_backward))
            optimizer.step()
            optimizer.zero_grad()
            controller.end_step()
        return net, step_losses, controller

    reference, reference_losses, _ = loop(None)
    injector = Injector(at=2)  # the backward of step 0's second micro-batch
    rescued, rescued_losses, controller = loop(injector)
    assert len(injector.errors) == 1 and controller.record.rescues == 1
    assert rescued_losses == reference_losses
    for (name, a), (_, b) in zip(rescued.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert controller.stats.total_bytes == expected_bytes(64 + 96) and controller.level == 0
    # the rerun offloaded every layer of both micro-batches; the steps after it, none
    assert [(r.offloaded, r.reasons, r.rescued) for r in controller.history] == [
        ([LAYERS, LAYERS], ["rescue", "rescue"], True),
        ([0, 0], ["below_high", "below_high"], False),
        ([0, 0], ["below_high", "below_high"], False),
    ]


class CounterBufferTrainer(Trainer):
    """Like TRL's GRPO: ``_prepare_inputs`` returns an entry of a buffer indexed by a counter that
    ``training_step`` advances after each micro-batch, so calling ``training_step`` again with the same
    ``inputs`` gives another micro-batch."""

    def __init__(self, *args, buffer, **kwargs):
        super().__init__(*args, **kwargs)
        self.buffer, self.calls, self.trained = buffer, 0, []

    def _get_train_sampler(self, *args, **kwargs):
        from torch.utils.data import SequentialSampler

        return SequentialSampler(self.train_dataset)

    def _prepare_inputs(self, inputs):
        batch = self.buffer[self.calls % len(self.buffer)]
        self.trained.append(self.calls % len(self.buffer))
        return super()._prepare_inputs(batch)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.calls += 1
        return loss


def test_a_trainer_with_its_own_prepare_inputs_is_not_rescued_and_says_why(tmp_path):
    data = dataset(LENGTHS)
    buffer = [{k: v[None] for k, v in data[i].items()} for i in range(len(LENGTHS))]
    net = model()
    Injector(at=FAIL_AT).install(net, "forward")
    args = training_args(tmp_path, len(LENGTHS) // 2, gradient_accumulation_steps=2)
    trainer = CounterBufferTrainer(model=net, args=args, train_dataset=data, buffer=buffer)
    with pytest.warns(AutoOffloadWarning, match="overrides _prepare_inputs") as warned:
        attach(trainer, probe=None)
    assert len([w for w in warned if issubclass(w.category, AutoOffloadWarning)]) == 1
    # A replay would have trained micro-batches 0 and 1 of the buffer's next entries (4 and 5), not 2 and 3.
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train()
    assert trainer.trained == [0, 1, 2, 3]


@pytest.mark.parametrize("engine", ["is_deepspeed_enabled", "is_fsdp_enabled"])
def test_no_rescue_under_deepspeed_or_fsdp_with_one_warning(tmp_path, engine):
    from conftest import InOrderTrainer

    net = model()
    injector = Injector(at=FAIL_AT)
    injector.install(net, "forward")
    args = training_args(tmp_path, len(LENGTHS) // 2, gradient_accumulation_steps=2)
    trainer = InOrderTrainer(model=net, args=args, train_dataset=dataset(LENGTHS))
    setattr(trainer, engine, True)  # what Trainer sets from the accelerator's DeepSpeed or FSDP plugin
    with pytest.warns(AutoOffloadWarning, match="not rescued: under (DeepSpeed|FSDP)"):
        callback = attach(trainer, probe=None)
    setattr(trainer, engine, False)  # there is no DeepSpeed or FSDP on this CPU: train plainly
    with pytest.raises(torch.OutOfMemoryError) as raised:
        trainer.train()
    assert raised.value is injector.errors[0] and callback.controller.record.rescues == 0


def test_a_model_wrapped_in_an_engine_at_the_first_step_is_not_rescued(tmp_path):
    from conftest import InOrderTrainer

    from autooffload.rescue import with_rescue

    class FullyShardedDataParallel(torch.nn.Module):  # named as torch's FSDP wrapper: the rescue reads the name
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    controller = OffloadController(Settings(), probe=None)
    assert controller.attach(net)
    trainer = InOrderTrainer(model=net, args=training_args(tmp_path, 1), train_dataset=dataset([64]))
    errors = []

    def failing(model, inputs, *args, **kwargs):
        errors.append(torch.OutOfMemoryError("injected"))
        raise errors[-1]

    trainer.training_step = failing
    with_rescue(trainer, controller)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        trainer.training_step(FullyShardedDataParallel(net), {})
    assert raised.value is errors[0] and len(errors) == 1 and controller.record.rescues == 0
    assert any("no rescue: under FSDP" in note for note in raised.value.__notes__)


def test_a_rescued_step_is_not_counted_as_forwards_alive_together(tmp_path):
    """``recompute="auto"``: the forward that ran out of memory never reaches its backward, and the rerun replays
    the step. Before: the failed forward stayed in the keep planner's group, so the replay counted as a second
    forward alive before one backward: keep was planned for two forwards (about half as many layers) for the next
    16 steps."""
    from autooffload import SimulatedDevice

    net = model()
    injector = Injector(at=FAIL_AT)
    injector.install(net, "forward")
    args = training_args(tmp_path, len(LENGTHS) // 2, gradient_accumulation_steps=2)
    from conftest import InOrderTrainer

    trainer = InOrderTrainer(model=net, args=args, train_dataset=dataset(LENGTHS))
    callback = attach(trainer, probe=SimulatedDevice("64MiB"), recompute="auto")
    trainer.train()
    assert len(injector.errors) == 1 and callback.controller.record.rescues == 1
    assert callback.controller.planner.keep.alive == 1
