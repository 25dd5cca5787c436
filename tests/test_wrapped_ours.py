"""A wrapper put around one of autooffload's own checkpoint functions: kept and called, its layer's arguments kept.

transformers' own ``check_training_gradient_checkpointing`` (tests/test_modeling_common.py in its source
distribution, 5.25) patches the first checkpointed layer's ``_gradient_checkpointing_func`` with a ``MagicMock``
whose ``side_effect`` calls the function it found there (autooffload's) and counts the layer's forwards. A mock
answers every attribute: only the functions autooffload made are its own (by identity), so the mock is a foreign
function, kept and called, named in one warning; the function of ours it calls runs plain checkpointing with the
layer's own arguments (``use_reentrant=False``), and once the mock is gone the layer is steered again.
"""

from __future__ import annotations

import functools
import unittest.mock
import warnings

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
import transformers
from conftest import expected_bytes, model, offloading, random_ids
from transformers.modeling_layers import GradientCheckpointingLayer

from autooffload.warn import AutoOffloadWarning

SEQ, BATCH = 24, 2


@pytest.fixture
def reentrant_calls(monkeypatch):
    """Every call of torch's reentrant checkpoint (``CheckpointFunction``): none may run where the model was enabled
    with ``use_reentrant=False``."""
    calls = []
    original = torch_checkpoint.CheckpointFunction

    class Recorded:
        @staticmethod
        def apply(function, preserve, *args):
            calls.append(function)
            return original.apply(function, preserve, *args)

    monkeypatch.setattr(torch_checkpoint, "CheckpointFunction", Recorded)
    return calls


def checkpointed():
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    return net


def loss_and_grads(net, ids):
    net.zero_grad()
    loss = net(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in net.parameters()]


def plain_reference(ids):
    return loss_and_grads(checkpointed(), ids)


def test_transformers_own_mock_of_the_checkpoint_function_is_called_and_its_layer_keeps_its_arguments(
    reentrant_calls,
):
    """transformers 5.25's check_training_gradient_checkpointing, reproduced on a tiny Qwen3 in mode ``on``."""
    ids = random_ids(SEQ, BATCH)
    reference = plain_reference(ids)
    net = checkpointed()
    controller = offloading(net)
    layer = next(m for m in net.modules() if isinstance(m, GradientCheckpointingLayer))
    grad_enabled_calls = []
    layer.register_forward_pre_hook(lambda *_: grad_enabled_calls.append(torch.is_grad_enabled()))
    checkpoint_func = layer._gradient_checkpointing_func
    forward_mock = unittest.mock.Mock()

    def checkpoint_with_forward_mock(forward, *args):
        forward_mock.side_effect = forward
        return checkpoint_func(forward_mock, *args)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with unittest.mock.patch.object(
            layer, "_gradient_checkpointing_func", side_effect=checkpoint_with_forward_mock
        ) as checkpoint_mock:
            loss, grads = loss_and_grads(net, ids)
            assert forward_mock.call_count > 1  # the layer's forward, and its recompute
            assert checkpoint_mock.call_count == 1
            if int(transformers.__version__.split(".")[0]) >= 5:  # before, the recompute ran the layer's hooks too
                assert sum(grad_enabled_calls) == checkpoint_mock.call_count
    controller.end_step()
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert len(ours) == 1 and "unittest.mock.MagicMock" in ours[0], ours
    assert reentrant_calls == []  # the layer ran torch's checkpoint with use_reentrant=False, as enabled
    assert torch.equal(loss, reference[0]) and all(map(torch.equal, grads, reference[1]))
    assert controller.last_step_bytes == expected_bytes(SEQ, BATCH, layers=3)  # the mocked layer stayed plain
    # the mock is gone: the function of ours it held is back, and the layer is steered again
    loss_and_grads(net, ids)
    controller.end_step()
    assert controller.last_step_bytes == expected_bytes(SEQ, BATCH)


def _mock(inner, calls):
    return unittest.mock.MagicMock(side_effect=lambda *args, **kwargs: calls.append(1) or inner(*args, **kwargs))


def _plain(inner, calls):
    def plain_wrapper(function, *args, **kwargs):
        calls.append(1)
        return inner(function, *args, **kwargs)

    return plain_wrapper


def _functools_wraps(inner, calls):
    @functools.wraps(inner)
    def wrapped(function, *args, **kwargs):
        calls.append(1)
        return inner(function, *args, **kwargs)

    return wrapped


@pytest.mark.parametrize(
    ("wrap", "steered"), [(_mock, False), (_plain, False), (_functools_wraps, True)], ids=["mock", "plain", "wraps"]
)
def test_a_wrapper_of_any_kind_around_ours_is_kept_and_called(reentrant_calls, wrap, steered):
    """A wrapper made with ``functools.wraps`` over ours is steered as a framework's wrapper of torch's checkpoint
    is (its code runs around whatever autooffload installs, no warning); any other is kept as it is and named in one
    warning, and the function of ours inside it runs plain checkpointing with the layer's own arguments."""
    ids = random_ids(SEQ, BATCH)
    reference = plain_reference(ids)
    net = checkpointed()
    controller = offloading(net)
    layer = net.model.layers[1]
    calls = []
    layer._gradient_checkpointing_func = wrap(layer._gradient_checkpointing_func, calls)
    moved = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            loss, grads = loss_and_grads(net, ids)
            controller.end_step()
            moved.append(controller.last_step_bytes)
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert calls == [1, 1]  # the wrapper ran at both steps
    assert reentrant_calls == []
    assert torch.equal(loss, reference[0]) and all(map(torch.equal, grads, reference[1]))
    if steered:
        assert ours == []
        assert moved == [expected_bytes(SEQ, BATCH)] * 2
    else:
        assert len(ours) == 1 and "model.layers.1" in ours[0], ours
        assert moved == [expected_bytes(SEQ, BATCH, layers=3)] * 2


def test_an_object_that_answers_every_attribute_is_not_taken_for_ours():
    from autooffload.observe.targets import torch_checkpoint_kwargs

    assert torch_checkpoint_kwargs(unittest.mock.MagicMock()) is None
