"""Every checkpointing path: torch's CheckpointWrapper as accelerate's FSDP applies it, and one warning for
each path autooffload cannot steer (OffloadWrapper, DeepSpeed's checkpoint, a DeepSpeed config section)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from conftest import LAYERS, expected_bytes, model

from autooffload import AutoOffloadWarning, OffloadController, Settings
from autooffload.observe.paths import deepspeed_config_warning

wrapping = pytest.importorskip("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
PREFIX = wrapping._CHECKPOINT_PREFIX


def fsdp2_style(net: torch.nn.Module) -> None:
    """accelerate's ``fsdp2_apply_ac``: every decoder layer in ``checkpoint_wrapper(layer, preserve_rng_state=False)``.
    (``fully_shard`` comes after it and changes nothing here; tests/test_distributed.py runs it sharded.)"""
    for index, layer in enumerate(net.model.layers):
        net.model.layers[index] = wrapping.checkpoint_wrapper(layer, preserve_rng_state=False)


def fsdp1_style(net: torch.nn.Module) -> None:
    """accelerate's FSDP1 path: ``apply_activation_checkpointing`` with the non-reentrant implementation."""
    layer_type = type(net.model.layers[0])
    wrapper = functools.partial(wrapping.checkpoint_wrapper, checkpoint_impl=wrapping.CheckpointImpl.NO_REENTRANT)
    wrapping.apply_activation_checkpointing(
        net, checkpoint_wrapper_fn=wrapper, check_fn=lambda module: isinstance(module, layer_type)
    )


def train_steps(net: torch.nn.Module, controller: OffloadController | None, lengths: list[int]) -> list[int]:
    """Forward and backward per length (no optimizer: gradients accumulate); bytes moved per step."""
    moved = []
    for seq in lengths:
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
        net(input_ids=ids, labels=ids).loss.backward()
        if controller is not None:
            controller.end_step()
            moved.append(controller.last_step_bytes)
    return moved


@pytest.mark.parametrize("wrap", [fsdp2_style, fsdp1_style], ids=["fsdp2", "fsdp1"])
def test_checkpoint_wrapper_is_switched_and_gradients_equal_plain(wrap):
    net = model()
    wrap(net)
    assert not net.is_gradient_checkpointing  # transformers' own checkpointing is off: only the wrappers run
    net.train()
    originals = [layer.checkpoint_fn for layer in net.model.layers]
    controller = OffloadController(Settings(seq_high=200, seq_low=100, min_steps=0), probe=None)
    assert controller.attach(net)
    assert [target.attribute for target in controller.switch.targets] == ["checkpoint_fn"] * LAYERS
    assert not {id(layer.checkpoint_fn) for layer in net.model.layers} & {id(original) for original in originals}

    lengths = [64, 256, 64]
    assert train_steps(net, controller, lengths) == [0, expected_bytes(256), 0]
    plain = model()
    plain.train()
    train_steps(plain, None, lengths)
    reference = dict(plain.named_parameters())
    for name, parameter in net.named_parameters():
        assert torch.equal(parameter.grad, reference[name.replace(PREFIX, "")].grad), name

    controller.detach(restore=True)
    assert [layer.checkpoint_fn for layer in net.model.layers] == originals


def test_offload_wrapper_gets_one_warning():
    net = model()
    for index, layer in enumerate(net.model.layers):
        wrapped = wrapping.checkpoint_wrapper(layer, preserve_rng_state=False)
        net.model.layers[index] = wrapping.offload_wrapper(wrapped)  # activation_checkpointing_offload=True
    controller = OffloadController(Settings(), probe=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert controller.attach(net)
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert len(ours) == 1
    assert "OffloadWrapper" in ours[0] and "activation_checkpointing_offload=False" in ours[0]
    assert "model.layers.0, model.layers.1, model.layers.2 and 1 more" in ours[0]


def test_deepspeed_checkpoint_function_gets_one_warning_naming_it():
    def checkpoint(function, *args):  # what deepspeed.checkpointing.checkpoint looks like to autooffload
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    checkpoint.__module__ = "deepspeed.runtime.activation_checkpointing.checkpointing"
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in net.modules():
        if getattr(module, "gradient_checkpointing", False):
            module._gradient_checkpointing_func = checkpoint
    controller = OffloadController(Settings(mode="on"), probe=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not controller.attach(net)
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert len(ours) == 1  # checkpointing is on: no "enable checkpointing first" after it
    assert "DeepSpeed's activation checkpointing (deepspeed.runtime.activation_checkpointing" in ours[0]
    assert f"leaves {LAYERS + 1} module(s) as they are" in ours[0]


@pytest.mark.parametrize(
    ("config", "warned"),
    [
        (None, False),
        ({"zero_optimization": {"stage": 3}}, False),
        ({"activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False}}, False),
        ({"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}, True),
    ],
)
def test_deepspeed_config_section_warning(config, warned):
    message = deepspeed_config_warning(config)
    assert (message is not None) == warned
    if warned:
        assert "(cpu_checkpointing, partition_activations) is not applied" in message
