"""The controller without Trainer: what a custom loop relies on."""

from __future__ import annotations

import pytest
import torch
from conftest import LAYERS, expected_bytes, model

from autooffload import AutoOffloadWarning, OffloadController, Settings


def checkpointed_model():
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    return net


def step(net, controller, seq):
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
    net(input_ids=ids, labels=ids).loss.backward()
    controller.end_step()


def test_custom_loop_with_attach_and_end_step():
    net = checkpointed_model()
    controller = OffloadController(Settings(seq_high=200, seq_low=100, min_steps=0), probe=None)
    assert controller.attach(net)
    for seq in (64, 256, 64):
        step(net, controller, seq)
    assert controller.step == 3 and controller.switches == 2
    assert controller.stats.total_bytes == expected_bytes(256)


def test_detach_leaves_plain_checkpointing_and_no_hook():
    net = checkpointed_model()
    controller = OffloadController(Settings(mode="on"), probe=None)
    controller.attach(net)
    step(net, controller, 64)
    controller.detach()
    step(net, controller, 64)
    assert controller.last_step_bytes == 0
    assert not net._forward_pre_hooks


def test_evaluation_forwards_are_not_micro_batches():
    net = checkpointed_model()
    controller = OffloadController(Settings(seq_high=200, seq_low=100), probe=None)
    controller.attach(net)
    with torch.no_grad():
        net(input_ids=torch.zeros(1, 512, dtype=torch.long))
    assert controller.level == 0 and controller.switches == 0


def test_an_unknown_checkpoint_function_is_left_alone_with_a_warning():
    net = checkpointed_model()

    def custom(function, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)

    net.model.layers[0]._gradient_checkpointing_func = custom
    controller = OffloadController(Settings(mode="on"), probe=None)
    with pytest.warns(AutoOffloadWarning, match=r"checkpoint function of model.layers.0 is not torch"):
        controller.attach(net)
    assert net.model.layers[0]._gradient_checkpointing_func is custom
    step(net, controller, 64)
    assert controller.last_step_bytes == expected_bytes(64, layers=LAYERS - 1)


def test_inputs_embeds_count_as_tokens():
    net = checkpointed_model()
    controller = OffloadController(Settings(seq_high=200, seq_low=100), probe=None)
    controller.attach(net)
    embeds = torch.randn(2, 256, 64, requires_grad=True)
    net(inputs_embeds=embeds).logits.sum().backward()
    controller.end_step()
    assert (controller.last_seq_len, controller.last_tokens) == (256, 512)
    assert controller.last_step_bytes == expected_bytes(256, batch=2)


def test_a_policy_whose_state_methods_raise_cannot_stop_a_save_or_a_resume():
    class Fragile:
        def decide(self, observation):
            return 0

        def state_dict(self):
            raise RuntimeError("boom")

        def load_state_dict(self, state):
            raise AttributeError("gone")

    controller = OffloadController(Settings(), probe=None, policy=Fragile())
    with pytest.warns(AutoOffloadWarning, match=r"state_dict\(\) raised RuntimeError"):
        state = controller.state_dict()
    assert state["policy"] is None
    with pytest.warns(AutoOffloadWarning, match="does not fit Fragile"):
        controller.load_state_dict({**state, "policy": {"any": 1}})


class Fixed:
    """A policy that always asks for the same number of layers."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    def decide(self, observation) -> int:
        return self.layers


def reenable(net, kwargs):
    """What TRL's DPO, GRPO and RLOO trainers do around the reference forward, on every step."""
    net.gradient_checkpointing_disable()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@pytest.mark.parametrize("kwargs", [{"offload": "auto"}, {"use_reentrant": False}])
def test_checkpointing_re_enabled_every_step_runs_as_decided(kwargs):
    net = checkpointed_model()
    controller = OffloadController(Settings(), probe=None, policy=Fixed(2))
    controller.attach(net)
    moved, active = [], []
    for seq in (64, 96, 80, 64):
        step(net, controller, seq)
        moved.append(controller.last_step_bytes)
        active.append(controller.active)
        reenable(net, kwargs)
    assert moved == [expected_bytes(s, layers=2) for s in (64, 96, 80, 64)]
    assert active == [0.5] * 4 and controller.switches == 0
    assert controller.reinstalls == 3  # before the forwards of steps 2, 3 and 4


def test_checkpointing_turned_off_mid_run_reports_level_0_with_one_warning_until_it_is_back():
    net = checkpointed_model()
    controller = OffloadController(Settings(mode="on"), probe=None)
    controller.attach(net)
    rows = []
    with pytest.warns(AutoOffloadWarning, match="checkpointing was turned off") as caught:
        for index, seq in enumerate((64, 96, 80, 72, 64)):
            if index == 1:
                net.gradient_checkpointing_disable()
            if index == 4:
                net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            step(net, controller, seq)
            rows.append((controller.active, controller.last_step_bytes, controller.metrics()["autooffload/active"]))
    assert len([w for w in caught if issubclass(w.category, AutoOffloadWarning)]) == 1
    off = (0.0, 0, 0.0)
    assert rows == [(1.0, expected_bytes(64), 1.0), off, off, off, (1.0, expected_bytes(64), 1.0)]
    assert controller.layer_token_bytes == expected_bytes(1) / LAYERS
