"""Keeping layers, as a user sees it (issue 54, item 4): keep never plans a step past memory_high on a profile read
wrong (segments one layer off, the optimizer's segment taken for a layer's, a longer micro-batch given more room),
and a keep function that outlives its switch recomputes. Profiles of several shapes (the peak in the forward, in the
last layer's backward, two forwards alive together, an input without gradient), through the planner where a count
is at stake; a real tiny Qwen3 where the marks and the switch are."""

from __future__ import annotations

import warnings

import pytest
from conftest import LAYERS
from test_keep_model import RecordingDevice, planner, real_peak
from test_ladder import checkpointed, ids, qwen3

from autooffload import OffloadController, ScriptedProbe, Settings
from autooffload.decide.activations import length_bucket
from autooffload.decide.growth import BELOW, FORWARD, LAYER, Profile, read_profile


def labels(key, layers: int = LAYERS, below: bool = True) -> list[tuple]:
    """One forward's marks in the order a step makes them: its start, the backward reaching layers 3, 2, 1, 0, and
    (where its input needs a gradient) the backward leaving layer 0."""
    marks = [(FORWARD, key), *((LAYER, key, j) for j in reversed(range(layers)))]
    return [*marks, (BELOW, key)] if below else marks


def measured(plan, key, reading, segments) -> None:
    """One measured step of one forward (``key``) keeping nothing, at 100 tokens, read in ``segments``."""
    plan.forward(100, 100, 0, 5000.0, key=key, measured=True)
    plan.backward()
    plan.end_step(reading, segments=[(None, 0.0), *segments])


def test_a_peak_in_the_last_layers_backward_keeps_only_what_fits_below_memory_high():
    """A profile of another shape than the suite's other tests: the step peaks as the backward reaches the last layer
    (a wide last layer), 2000 above the forward's end. Keeping layers 2 and 3 adds 1000 there (layer 2 is still
    alive while layer 3's backward runs); three add 2000. With 1000 of room, keep plans two layers. Fails if a
    LAYER mark is read one layer off (autooffload/decide/growth.py:135, ``label[2]`` made ``label[2] - 1``): layer
    2 looks freed in layer 3's backward and three layers are planned, 1000 past the limit."""
    plan = planner()  # 4 layers, 1000 bytes each kept at 100 tokens
    key = object()
    measured(plan, key, 5000.0, list(zip(labels(key), [3000.0, 5000.0, 4200.0, 4000.0, 3900.0, 8000.0], strict=True)))
    assert plan.count(5000.0, 100, 100, 6000.0, 0) == 2
    assert [plan.growth([(k, 100, 100)]) for k in range(1, LAYERS + 1)] == [0.0, 1000.0, 2000.0, 3000.0]
    profile = plan.profiles.get((length_bucket(100), 1))
    assert profile.alive == ((4,), (3,), (2,), (1,), (0,))
    assert profile.headroom == (2000.0, 0.0, 800.0, 1000.0, 1100.0)


def test_a_forward_whose_input_needs_no_gradient_leaves_the_optimizers_segment_out():
    """No BELOW mark (the embedding's output needs no gradient: a frozen embedding, a PEFT model): the step's last
    segment runs from layer 0's backward through the optimizer's step, which holds far more (9000) than any layer
    segment and which keep does not change. Counted as a layer segment, it would be the profile's peak and give
    every segment thousands of headroom: keep would plan every layer. Left out, the peak is layer 1's backward
    (4800) and two layers fit in 1000 of room. Fails if the group's last segment is kept without a BELOW mark
    (autooffload/decide/growth.py:146, ``rows.pop()`` dropped)."""
    plan = planner()
    key = object()
    segments = list(zip(labels(key, below=False), [3000.0, 4000.0, 4500.0, 4800.0, 9000.0], strict=True))
    measured(plan, key, 9000.0, segments)
    assert plan.count(4800.0, 100, 100, 5800.0, 0) == 2
    assert plan.growth([(LAYERS, 100, 100)]) == 2200.0
    profile = plan.profiles.get((length_bucket(100), 1))
    assert profile.alive == ((4,), (3,), (2,), (1,))
    assert profile.headroom == (1800.0, 800.0, 300.0, 0.0)


def test_two_forwards_profile_the_earlier_forwards_layers_alive_through_the_later_backward():
    """A group of two forwards (two micro-batches before one backward): the later forward's backward runs first, the
    earlier forward's layers all alive through it; the group's segments end when both left their layer 0, and the
    optimizer's after it are left out."""
    a, b = object(), object()
    marks = [(FORWARD, a), (FORWARD, b), *labels(b)[1:], *labels(a)[1:]]
    peaks = [2000.0, 4000.0, 5000.0, 4600.0, 4400.0, 4200.0, 4100.0, 3000.0, 2800.0, 2600.0, 2400.0, 2200.0]
    segments = [(None, 0.0), *zip(marks, peaks, strict=True), (None, 9000.0)]
    profile = read_profile(segments, [a, b], LAYERS, [[0.0] * LAYERS] * 2, 100)
    assert profile.alive == (
        (4, 0), (4, 4), (4, 3), (4, 2), (4, 1), (4, 0), (4, 0), (3, 0), (2, 0), (1, 0), (0, 0)
    )  # fmt: skip
    assert profile.headroom[:3] == (3000.0, 1000.0, 0.0)
    # The earlier forward's last layer, kept, is alive at the group's peak (layer 3's backward of the later one):
    # it adds its whole 1000; the later forward's last layer kept adds nothing there (its recompute's place).
    assert profile.growth([[0.0, 0.0, 0.0, 1000.0], [0.0] * LAYERS], 100) == 1000.0
    assert profile.growth([[0.0] * LAYERS, [0.0, 0.0, 0.0, 1000.0]], 100) == 0.0


@pytest.mark.parametrize("method", ["growth", "growths"])
def test_a_micro_batch_longer_than_its_profile_gets_no_more_headroom_than_the_profile_read(method):
    """A profile read at 100 tokens, used for a micro-batch of 150 in the same bucket: the headroom a segment had at
    100 tokens is not scaled up to 150 (what the longer micro-batch's other tensors take there grows too); a
    shorter one's shrinks in proportion. Fails if the scale is not capped at 1 (autooffload/decide/growth.py:59 for
    ``growth``, :75 for ``growths``: ``min(1.0, tokens / self.tokens)`` made ``tokens / self.tokens``), which plans
    keep 500 past the limit here."""
    profile = Profile(100, (1000.0, 0.0), ((4,), (0,)))
    costs = [500.0] * LAYERS

    def growth(tokens: int) -> float:
        if method == "growth":
            return profile.growth([costs], tokens)
        return profile.growths([], costs, LAYERS, 0.0, tokens)[-1]

    assert growth(100) == 1000.0
    assert growth(150) == 1000.0  # not 2000 - 1500
    assert growth(50) == 1500.0


class Marking(RecordingDevice):
    """A SimulatedDevice that also keeps the marks the keep model makes in the step it measures."""

    def __new__(cls, total):
        device = RecordingDevice(total)
        device.labels = []
        mark = device.mark

        def recording(label):
            device.labels.append(label)
            mark(label)

        device.mark = recording
        return device


def test_the_marks_of_a_real_step_name_each_layer_as_the_backward_reaches_it():
    """The keep model's measured step on a real tiny Qwen3: its marks say where the forward began, where the
    backward reached layers 3, 2, 1 and 0 (in that order) and where it left layer 0; the profile read from them has
    layer ``j``'s segment with the layers below ``j`` alive; and what the profile predicts keeping adds is at least
    what the real step's peak grows by. Fails if a layer's mark names the layer below (autooffload/apply/keep.py:82,
    ``self.position`` made ``self.position - 1``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = checkpointed(qwen3(dropout=0.0))
        seq = 128
        device = Marking(2**34)
        controller = OffloadController(Settings(recompute="auto"), probe=device)
        controller.attach(net)
        x = ids(seq)
        net(input_ids=x, labels=x).loss.backward()
        net.zero_grad()
        controller.end_step()
        controller.detach(restore=True)
    key = device.labels[0][1]
    assert device.labels == labels(key), device.labels
    keep = controller.planner.keep
    profile = keep.profiles.get((length_bucket(seq), 1))
    assert profile.alive == ((4,), (3,), (2,), (1,), (0,))
    assert keep.growth([(LAYERS, seq, seq)]) >= real_peak(net, seq, LAYERS) - real_peak(net, seq, 0)


def test_a_keep_function_a_foreign_wrapper_still_calls_after_detach_recomputes():
    """A wrapper that is not autooffload's (a framework's, a test's mock) may hold the keep function it found and call
    it after autooffload detached: then the layer runs plain checkpointing (its forward runs again in the backward),
    not kept, holding its activations on a device autooffload no longer plans for. Fails if a retired keep
    function keeps (autooffload/apply/keep.py:52, ``if plain is not None and state.retired:`` made ``if False:``)."""
    net = checkpointed(qwen3(dropout=0.0))
    controller = OffloadController(Settings(recompute="auto", host_memory="1GiB"), probe=ScriptedProbe([0.01]))
    x = ids(48)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        controller.attach(net)
        for _ in range(2):
            net(input_ids=x, labels=x).loss.backward()
            net.zero_grad()
            controller.end_step()
        assert controller.switch.kept == LAYERS  # ample room: every layer kept
        layers = net.model.layers
        held = [layer._gradient_checkpointing_func for layer in layers]
        controller.detach()
    for layer, function in zip(layers, held, strict=True):
        layer._gradient_checkpointing_func = lambda f, *args, _held=function, **kwargs: _held(f, *args, **kwargs)
    calls = []
    handles = [layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in layers]
    try:
        net(input_ids=x, labels=x).loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    assert len(calls) == 2 * LAYERS  # each layer's forward, then its recompute in the backward
