"""Never break training: a failure inside autooffload's attach, decision or bookkeeping gives one warning and
plain checkpointing for the rest of the run, with results identical to plain checkpointing, through the real
Trainer. The failures are injected where autooffload's own code runs (its lower functions made to raise); a
config that raises on a read is the real-world case and must not even get that far."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import LAYERS, expected_bytes, train

import autooffload.decide.planner as planner_module
import autooffload.observe.layout as layout_module
from autooffload import AutoOffloadCallback, AutoOffloadWarning
from autooffload.history import HistoryRecorder

LENGTHS = [64, 64, 64]


def boom(*args, **kwargs):
    raise RuntimeError("injected failure")


INJECTIONS = {
    "attach": (layout_module, "checkpointed_modules"),
    "the pre-forward hook": (planner_module, "host_cap"),
    "end_step": (HistoryRecorder, "end_step"),
}


@pytest.mark.parametrize("where", list(INJECTIONS))
def test_a_failure_inside_autooffload_leaves_the_run_on_plain_checkpointing(tmp_path, monkeypatch, where):
    _, reference = train(tmp_path / "plain", LENGTHS, offload=None)
    owner, name = INJECTIONS[where]
    monkeypatch.setattr(owner, name, boom)
    callback = AutoOffloadCallback(mode="on", probe=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, net = train(tmp_path / "broken", LENGTHS, callbacks=[callback])
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert len(ours) == 1 and f"internal error in {where} (RuntimeError: injected failure)" in ours[0], ours
    assert trainer.state.global_step == len(LENGTHS)
    for (key, a), (_, b) in zip(net.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(a, b), key
    # The step that failed in end_step had offloaded; nothing moves after the failure.
    moved = expected_bytes(64) if where == "end_step" else 0
    assert callback.controller.stats.total_bytes == moved
    # Nothing is left attached; the run is over, so a next train() or attach tries again.
    assert not callback.controller.failed and callback.controller.switch is None


class PerLayerRead(Exception):
    """Stands for transformers' ``AmbiguousGlobalPerLayerAttributeError`` (not an ``AttributeError``)."""


def test_a_config_attribute_that_raises_is_read_as_absent(tmp_path):
    """Gemma-4's per-layer configs refuse a global read of ``head_dim``; the controller reads around it and
    controls the model as any other (the first call gives the width where the config cannot)."""

    def per_layer_model(*args, **kwargs):
        net = original(*args, **kwargs)

        class PerLayerConfig(type(net.config)):
            @property
            def head_dim(self):
                raise PerLayerRead("'head_dim' is a per-layer attribute and may vary across layers")

        net.config.__class__ = PerLayerConfig
        return net

    import conftest

    original = conftest.model
    conftest.model = per_layer_model
    try:
        callback = AutoOffloadCallback(mode="on", probe=None)
        with warnings.catch_warnings():
            warnings.simplefilter("error", AutoOffloadWarning)
            train(tmp_path, LENGTHS, callbacks=[callback])
    finally:
        conftest.model = original
    assert callback.controller.stats.total_bytes == len(LENGTHS) * expected_bytes(64, layers=LAYERS)


def test_an_out_of_memory_error_is_not_taken_for_an_internal_error(tmp_path):
    """A device OOM raised inside an entry point must reach the caller (the rescue catches it), not end control."""
    import torch

    from autooffload import OffloadController
    from autooffload.guard import guarded

    class Owner:
        controller = OffloadController(probe=None)

        @guarded("a test entry")
        def entry(self):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(torch.OutOfMemoryError):
        Owner().entry()
    assert not Owner.controller.failed


@pytest.mark.parametrize("where", ["on_train_end", "finish"])
def test_a_failure_as_the_run_ends_ends_the_give_up_with_it(tmp_path, where):
    """A failure in the end of training's own entry points ends the run it gives up: the next ``train()`` of the
    same trainer offloads again (it ran the whole of it on plain checkpointing before)."""
    from autooffload.guard import ENTRY_POINTS

    point = ENTRY_POINTS[where]
    original = point.method
    callback = AutoOffloadCallback(mode="on", probe=None)
    point.method = boom
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer, _ = train(tmp_path, LENGTHS, callbacks=[callback])
    finally:
        point.method = original
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert len(ours) == 1 and f"internal error in {where}" in ours[0], ours
    assert not callback.controller.failed
    moved = callback.controller.stats.total_bytes
    assert moved == expected_bytes(64) * len(LENGTHS)
    trainer.train()
    assert callback.controller.stats.total_bytes == expected_bytes(64) * len(LENGTHS)
    assert trainer.state.global_step == len(LENGTHS)


def _toggle(net: torch.nn.Module, kwargs: dict) -> None:
    """What TRL's generation does around ``generate`` (``unwrap_model_for_generation``): checkpointing off, then on
    again with the training arguments' kwargs, ``offload`` key included: transformers installs new functions."""
    net.gradient_checkpointing_disable()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@pytest.mark.parametrize("reentrant", [True, False])
def test_plain_checkpointing_stays_after_a_trainer_reinstalls_its_functions(monkeypatch, reentrant):
    """After giving up, a trainer that turns checkpointing off and on again mid-run (TRL's GRPO around generation)
    puts back functions with the ``offload`` key, which torch's reentrant checkpoint refuses (ValueError) and the
    non-reentrant one hands to the layer as a keyword: the run must stay on plain checkpointing all the same."""
    from autooffload import OffloadController, Settings
    from autooffload.demo import tiny_qwen3

    net = tiny_qwen3(2, 32, 256, seed=0).train()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    controller = OffloadController(Settings(mode="on"), probe=None)
    assert controller.attach(net, optimizer=optimizer)
    monkeypatch.setattr(HistoryRecorder, "end_step", boom)
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    seen: list[dict] = []
    net.model.layers[0].register_forward_pre_hook(lambda m, a, k: seen.append(dict(k)), with_kwargs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for toggle in (False, True):
            if toggle:
                _toggle(net, {"offload": "auto", "use_reentrant": reentrant})
            net(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            controller.end_step()
    assert controller.failed
    assert "offload" not in seen[-1]  # plain checkpointing again, not transformers' function with its offload key


def test_a_train_that_gave_up_and_raised_leaves_the_next_train_offloading(tmp_path, monkeypatch):
    """With the callback alone (no ``attach(trainer)`` wrapping ``train``), a ``train()`` that gave up and then
    raised calls no ``on_train_end``: the next ``train()`` must neither crash (Trainer reinstalls transformers'
    functions with the ``offload`` key, which fail on a CPU-only build) nor run without autooffload."""
    from conftest import InOrderTrainer, dataset, model, training_args
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        armed = True

        def on_step_end(self, args, state, control, **kwargs):
            if self.armed and state.global_step == 2:
                raise KeyboardInterrupt

    callback, interrupt = AutoOffloadCallback(mode="on", probe=None), Interrupt()
    trainer = InOrderTrainer(
        model=model(), args=training_args(tmp_path, 3), train_dataset=dataset([64] * 3), callbacks=[callback, interrupt]
    )
    monkeypatch.setattr(HistoryRecorder, "end_step", boom)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        assert callback.controller.failed
        monkeypatch.undo()
        interrupt.armed = False
        trainer.train()
    assert trainer.state.global_step == 3
    assert callback.controller.stats.total_bytes == 3 * expected_bytes(64)
