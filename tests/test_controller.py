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
