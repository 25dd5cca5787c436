"""Predictive, partial offload through the real Trainer, with a probe that reports memory from the arithmetic.

The tiny Qwen3 has 4 checkpointed layers of hidden 64 in fp32: one layer's saved input is 256 bytes per token.
The probe says a step peaks at 1 MiB + tokens x (4 x 256 + 512) bytes, less 256 x tokens per offloaded layer
(the peak at the end of the forward, where every offloaded input is gone), on a device of
2,048,000 bytes with memory_high 0.8: 1,638,400 bytes. A 512-token micro-batch then needs 1,835,008 bytes,
196,608 over: 1.5 layers of 131,072, so exactly 2 layers must offload.
"""

from __future__ import annotations

import math

import pytest
from conftest import HIDDEN, LAYERS, expected_bytes, model, train

from autooffload import AutoOffloadCallback, AutoOffloadWarning, MemoryReading, OffloadController, Settings
from autooffload.decide.predictive import compile_levels

PER_TOKEN = HIDDEN * 4
STATIC, WORK, TOTAL, HIGH = 2**20, 2 * PER_TOKEN, 2_048_000, 0.8


def arithmetic_peak(tokens: int, level: int) -> int:
    return STATIC + tokens * (LAYERS * PER_TOKEN + WORK) - min(level, LAYERS) * PER_TOKEN * tokens


class ArithmeticProbe:
    """The peak of the last step's micro-batches by ``arithmetic_peak``, from the levels the controller applied."""

    def __init__(self) -> None:
        self.micro_batches: list[tuple[int, int]] = []
        self.decisions: list[tuple[int, int]] = []

    def watch(self, controller: OffloadController) -> None:
        decide = controller.before_forward

        def before_forward(seq_len: int, tokens: int, *lengths) -> int:
            level = decide(seq_len, tokens, *lengths)
            self.micro_batches.append((tokens, level))
            self.decisions.append((seq_len, level))
            return level

        controller.before_forward = before_forward

    def read(self) -> MemoryReading:
        peak = max(arithmetic_peak(tokens, level) for tokens, level in self.micro_batches)
        self.micro_batches.clear()
        return MemoryReading(peak, TOTAL)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_long_micro_batch_gets_the_predicted_layers_in_its_own_forward(tmp_path, accumulation):
    lengths = [64, 320, 96, 64, 320, 96, 64, 512, 64, 96]
    probe = ArithmeticProbe()
    callback = AutoOffloadCallback(memory_high=HIGH, memory_low=0.5, probe=probe)
    probe.watch(callback.controller)
    moved = []

    class Record(type(callback).__mro__[1]):  # a plain TrainerCallback
        def on_step_end(self, args, state, control, **kwargs):
            moved.append(callback.controller.last_step_bytes)

    train(
        tmp_path,
        lengths,
        callbacks=[callback, Record()],
        steps=len(lengths) // accumulation,
        gradient_accumulation_steps=accumulation,
        optim="sgd",  # the probe's constant holds the optimizer state; plain SGD has none still to come
    )
    excess = arithmetic_peak(512, 0) - HIGH * TOTAL
    predicted = math.ceil(excess / (PER_TOKEN * 512))
    assert predicted == 2
    # The first 320 is far beyond the one length seen (with accumulation 2 no reading exists yet): the model's
    # seed (logits, a layer's working set) plans it conservatively, or nothing does. Once seen, lengths are
    # exact, and 512 lies within the span of those seen: the fitted slope plans exactly the layers the
    # arithmetic needs, in its own forward.
    first_long = probe.decisions[1]
    assert first_long == (320, LAYERS if accumulation == 1 else 0)
    assert probe.decisions[2:] == [(seq, predicted if seq == 512 else 0) for seq in lengths[2:]]
    long_step = lengths.index(512) // accumulation
    assert moved[long_step] == expected_bytes(512, layers=predicted)
    assert sum(moved) == moved[long_step] + moved[1 // accumulation]
    assert callback.controller.sizes.token_bytes == PER_TOKEN


def test_the_controller_passes_the_compile_levels_and_the_bytes_per_layer():
    seen = []

    class Spy:
        def decide(self, observation):
            seen.append(observation)
            return 1

    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    controller = OffloadController(Settings(compile_max_switches=3), probe=None, policy=Spy())
    controller.attach(net, compiled=True)
    assert controller.before_forward(100, 200) == 1
    assert seen[0].levels == compile_levels(LAYERS, 3) == (0, 2, 3, 4)
    assert seen[0].bytes_per_layer == 200 * PER_TOKEN and seen[0].memory_bytes is None
    controller.detach()


def test_a_saved_state_of_another_policy_warns_and_starts_afresh():
    saved = OffloadController(Settings(policy="hysteresis"), probe=None).state_dict()
    controller = OffloadController(Settings(), probe=None)
    with pytest.warns(AutoOffloadWarning, match="does not fit PredictivePolicy"):
        controller.load_state_dict(saved)
    assert controller.policy.samples == [] and controller.step == 0
