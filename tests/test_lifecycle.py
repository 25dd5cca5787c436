"""One run, one state: a fresh train() starts fresh, measurements stay with their model, a model has one
controller, a failed train() leaves nothing behind, and nothing outlives the trainer and the model."""

from __future__ import annotations

import gc
import inspect
import logging
import weakref

import pytest
import torch
from conftest import InOrderTrainer, dataset, expected_bytes, model, training_args
from transformers import TrainerCallback

from autooffload import (
    AutoOffloadCallback,
    AutoOffloadWarning,
    OffloadController,
    ScriptedProbe,
    Settings,
    SettingsError,
    attach,
)
from autooffload.apply.hooks import ForwardHooks
from autooffload.history import history_path, read_history
from autooffload.observe.ours import ours

LOGGER = "transformers.autooffload"


def trainer_for(tmp_path, callback, lengths, net=None, **extra):
    net = net if net is not None else model()
    args = training_args(tmp_path, len(lengths), **extra)
    return InOrderTrainer(model=net, args=args, train_dataset=dataset(lengths), callbacks=[callback])


def decisions(out):
    return [(r["step"], r["offloaded"], r["reasons"], r["kept"]) for r in read_history(history_path(out))]


# ---- a fresh train() starts fresh --------------------------------------------------------------------


def test_a_second_fresh_train_starts_from_step_1_with_no_dwell(tmp_path):
    # Step 2's 256 turns offload on with a 4-step dwell, so a run that carried the state on would still
    # offload the 64 of the next run's first step.
    callback = AutoOffloadCallback(seq_high=200, seq_low=100, min_steps=4, probe=None, policy="hysteresis")
    trainer = trainer_for(tmp_path, callback, [64, 256, 64])
    trainer.train()
    first = decisions(tmp_path)
    trainer.train()
    second = decisions(tmp_path)
    assert [step for step, *_ in first] == [step for step, *_ in second] == [1, 2, 3]
    assert second == first == [(1, [0], ["below_high"], None), (2, [4], ["seq_high"], None), (3, [4], ["dwell"], None)]
    assert callback.controller.step == 3 and callback.controller.record.switches == 1
    assert callback.controller.stats.total_bytes == expected_bytes(256) + expected_bytes(64)


def test_a_callback_reused_on_another_model_measures_that_model(tmp_path):
    # recompute="auto": nothing may be kept before a reading covers the length. A new model of 4x the bytes per
    # layer, trained by the callback that measured a small one, must decide as a new callback does.
    lengths = [64, 64, 96, 64]

    def run(out, callback, hidden):
        trainer_for(out, callback, lengths, net=model(hidden=hidden)).train()
        return decisions(out)

    reused = AutoOffloadCallback(recompute="auto", probe=ScriptedProbe([0.3]))
    small = run(tmp_path / "a", reused, 64)
    assert small[0][3] == [0] and any(kept != [0] for *_, kept in small[1:])  # it keeps once it has a reading
    big = run(tmp_path / "b", reused, 256)
    new = run(tmp_path / "c", AutoOffloadCallback(recompute="auto", probe=ScriptedProbe([0.3])), 256)
    assert big[0][3] == [0]
    assert big == new
    assert reused.controller.sizes.token_bytes == 256 * 4  # the new model's, fp32


# ---- measurements stay with their model ---------------------------------------------------------------


def checkpointed(**kwargs):
    net = model(**kwargs)
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    return net


def measured_state():
    # A reading of 95%: the predictive policy offloads the second step, so bytes per layer are measured too.
    net = checkpointed()
    controller = OffloadController(probe=ScriptedProbe([0.95]))
    controller.attach(net)
    for seq in (64, 96):
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
        net(input_ids=ids, labels=ids).loss.backward()
        controller.end_step()
    state = controller.state_dict()
    assert state["policy"]["samples"] and state["memory"]["fraction"] == 0.95 and state["level"] > 0
    assert controller.stats.total_bytes > 0
    return state


@pytest.mark.parametrize(
    "change, build, expected",
    [
        ("layers", dict(layers=2), "layers 4 -> 2"),
        ("hidden", dict(hidden=128), "hidden 64 -> 128"),
        ("dtype", dict(dtype=torch.bfloat16), "dtype float32 -> bfloat16"),
        ("recompute", dict(recompute="auto"), "recompute always -> auto"),
    ],
)
def test_a_state_restored_into_another_model_drops_its_measurements(caplog, change, build, expected):
    state = measured_state()
    build = dict(build)
    dtype = build.pop("dtype", None)
    recompute = build.pop("recompute", "always")
    net = checkpointed(**build)
    if dtype is not None:
        net.to(dtype)
    controller = OffloadController(Settings(recompute=recompute), probe=None)
    controller.attach(net)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        controller.load_state_dict(state)
    lines = [r.getMessage() for r in caplog.records if "another model" in r.getMessage()]
    assert len(lines) == 1 and expected in lines[0]
    # The run's counters stay; what was measured on the other model is gone.
    assert controller.step == 2 and controller.stats.total_bytes == state["total_bytes"]
    assert controller.memory_fraction is None and controller.policy.state_dict()["samples"] == []
    assert controller.sizes.token_bytes == build.get("hidden", 64) * (2 if dtype else 4)  # from the config
    assert controller.identity["layers"] == len(controller.switch.layers)


def test_a_state_restored_before_attach_is_checked_at_attach(caplog):
    state = measured_state()
    controller = OffloadController(probe=None)
    controller.load_state_dict(state)
    assert controller.memory_fraction == 0.95
    with caplog.at_level(logging.INFO, logger=LOGGER):
        controller.attach(checkpointed(hidden=128))
    assert sum("another model" in r.getMessage() for r in caplog.records) == 1
    assert controller.step == 2 and controller.memory_fraction is None and controller.sizes.token_bytes == 128 * 4


def test_a_state_restored_into_the_same_model_keeps_everything(caplog):
    state = measured_state()
    controller = OffloadController(probe=None)
    controller.attach(checkpointed())
    with caplog.at_level(logging.INFO, logger=LOGGER):
        controller.load_state_dict(state)
    assert not [r for r in caplog.records if "another model" in r.getMessage()]
    assert controller.state_dict()["policy"] == state["policy"] and controller.memory_fraction == 0.95
    assert controller.level == state["level"]


def test_resuming_with_another_recompute_setting_drops_the_measurements(tmp_path, caplog):
    lengths = [64, 96, 64, 96]
    first = AutoOffloadCallback(probe=ScriptedProbe([0.3]))
    trainer_for(tmp_path, first, lengths[:2], save_strategy="steps", save_steps=2).train()
    assert first.controller.state_dict()["policy"]["samples"]
    second = AutoOffloadCallback(recompute="auto", probe=ScriptedProbe([0.3]))
    trainer = trainer_for(tmp_path, second, lengths)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    lines = [r.getMessage() for r in caplog.records if "another model" in r.getMessage()]
    assert len(lines) == 1 and "recompute always -> auto" in lines[0]
    records = read_history(history_path(tmp_path))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["kept"] == [0]  # no reading of this setting yet: nothing kept at step 3
    assert second.controller.identity["recompute"] == "auto"


# ---- one controller per model, and a failed train() ----------------------------------------------------


class FailingTrainer(InOrderTrainer):
    """compute_loss raises on the ``fail_at``-th call."""

    fail_at: int | None = None
    calls = 0

    def compute_loss(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        return super().compute_loss(*args, **kwargs)


def hooks_of(net):
    """The controllers whose pre-forward hooks are on ``net``, one per hook."""

    def forward_hooks(function, depth=3):  # through the shield's wrapper: the ForwardHooks whose method it runs
        function = inspect.unwrap(function)
        owner = getattr(function, "__self__", None)
        if isinstance(owner, ForwardHooks):
            return owner
        cells = [c.cell_contents for c in getattr(function, "__closure__", None) or ()]
        found = [c for c in cells if isinstance(c, ForwardHooks)]
        found += [f for c in cells if depth and callable(c) and (f := forward_hooks(c, depth - 1)) is not None]
        return found[0] if found else None

    found = [forward_hooks(h) for h in net._forward_pre_hooks.values()]
    return [hooks._enter.__self__ for hooks in found if hooks is not None]


def checkpoint_functions(net):
    return [m._gradient_checkpointing_func for m in net.modules() if getattr(m, "gradient_checkpointing", False)]


@pytest.mark.parametrize("through", ["callback", "attach"])
def test_a_failed_train_leaves_one_controller_for_the_next_run(tmp_path, through):
    net = model()
    lengths = [64, 96, 128]
    args = training_args(tmp_path, 3)
    trainer = FailingTrainer(model=net, args=args, train_dataset=dataset(lengths))
    trainer.fail_at = 2
    if through == "attach":
        failed = attach(trainer, mode="on", probe=None)
    else:
        failed = AutoOffloadCallback(mode="on", probe=None)
        trainer.add_callback(failed)
    with pytest.raises(RuntimeError, match="injected"):
        trainer.train()
    if through == "attach":  # attach(trainer) cleans up at once
        assert hooks_of(net) == [] and failed.controller.switch is None

    second = AutoOffloadCallback(mode="on", probe=None)
    moved = []
    trainer = InOrderTrainer(model=net, args=args, train_dataset=dataset(lengths), callbacks=[second])

    class Bytes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            moved.append(second.controller.last_step_bytes)
            assert hooks_of(net) == [second.controller]

    trainer.add_callback(Bytes())
    trainer.train()
    assert moved == [expected_bytes(s) for s in lengths]
    assert failed.controller.switch is None and failed.controller.record.reinstalls == 0
    assert second.controller.record.reinstalls == 0
    assert hooks_of(net) == []  # detached at the end of training
    assert all(ours(f) is not None for f in checkpoint_functions(net))


def test_a_failure_cleaning_up_a_failed_train_warns_and_the_users_error_goes_on(tmp_path, monkeypatch):
    """Our clean-up after ``train()`` raised must not replace the user's error with ours, nor stop halfway: the
    history write fails here, and the hooks still come off the model."""
    net = model()
    trainer = FailingTrainer(model=net, args=training_args(tmp_path, 3), train_dataset=dataset([64, 96, 128]))
    trainer.fail_at = 2
    failed = attach(trainer, mode="on", probe=None)

    write = failed._write_history

    def broken() -> None:  # the writes during training go through; the clean-up's fails
        if failed._training:
            return write()
        raise OSError("disk full")

    monkeypatch.setattr(failed, "_write_history", broken)
    cleaning_up = "cleaning up after train.. raised .OSError: disk full"
    with pytest.warns(AutoOffloadWarning, match=cleaning_up), pytest.raises(RuntimeError, match="injected"):
        trainer.train()
    assert hooks_of(net) == [] and failed.controller.switch is None


def test_a_failed_train_under_a_mock_over_train_is_cleaned_up(tmp_path):
    """``trainer.train`` patched with a ``MagicMock`` that calls the real one before ``attach``: a mock answers every
    attribute and must not be taken for autooffload's own clean-up wrapper, which detaches when train() raises."""
    import unittest.mock

    net = model()
    trainer = FailingTrainer(model=net, args=training_args(tmp_path, 3), train_dataset=dataset([64, 96, 128]))
    trainer.fail_at = 2
    with unittest.mock.patch.object(trainer, "train", side_effect=trainer.train):
        failed = attach(trainer, mode="on", probe=None)
        with pytest.raises(RuntimeError, match="injected"):
            trainer.train()
    assert hooks_of(net) == [] and failed.controller.switch is None


def test_attaching_a_second_controller_retires_the_first():
    net = checkpointed()
    originals = checkpoint_functions(net)
    first = OffloadController(Settings(mode="on"), probe=None)
    first.attach(net)
    second = OffloadController(Settings(mode="on"), probe=None)
    second.attach(net)
    assert hooks_of(net) == [second] and first.switch is None
    ids = torch.randint(0, 256, (1, 64))
    net(input_ids=ids, labels=ids).loss.backward()
    second.end_step()
    assert second.last_step_bytes == expected_bytes(64) and second.record.reinstalls == 0 and first.step == 0
    second.detach(restore=True)
    assert checkpoint_functions(net) == originals and hooks_of(net) == []


# ---- nothing outlives the trainer and the model --------------------------------------------------------


def test_the_callback_holds_neither_the_model_nor_the_optimizer_after_training(tmp_path):
    callback = AutoOffloadCallback(mode="on", probe=None)
    trainer = trainer_for(tmp_path, callback, [64, 96])
    trainer.train()
    refs = {
        "model": weakref.ref(trainer.model),
        "trainer": weakref.ref(trainer),
        "optimizer": weakref.ref(trainer.optimizer),
        "parameter": weakref.ref(next(trainer.model.parameters())),
    }
    del trainer
    gc.collect()
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert alive == [] and callback.controller.memory.optimizer is None


# ---- the controller's arguments ----------------------------------------------------------------------


def test_the_controller_takes_the_callbacks_keyword_arguments(monkeypatch):
    assert OffloadController(mode="on", probe=None).settings.mode == "on"
    controller = OffloadController(Settings(min_steps=5), seq_high=300, seq_low=200, policy="hysteresis")
    settings = controller.settings
    assert (settings.min_steps, settings.seq_high, settings.policy) == (5, 300, "hysteresis")
    assert type(controller.policy).__name__ == "HysteresisPolicy" and controller.policy.seq_high == 300
    monkeypatch.setenv("AUTOOFFLOAD_MIN_STEPS", "7")
    assert OffloadController(mode="off").settings.min_steps == 7  # the environment, then the arguments
    with pytest.raises(SettingsError, match="argument mode='sometimes'"):
        OffloadController(mode="sometimes")
