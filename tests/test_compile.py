"""torch.compile: a switch takes effect in a compiled model, and recompilations stay within the budget.

Trainer's ``torch_compile`` with the ``aot_eager`` backend: dynamo's guards, graph breaks and recompiles are
exactly those of inductor, without inductor's code generation (minutes on a 2-core CPU).
"""

from __future__ import annotations

import os

import pytest
from conftest import expected_bytes, train

from autooffload import AutoOffloadCallback, AutoOffloadWarning, ScriptedProbe

torch_dynamo = pytest.importorskip("torch._dynamo")

# Constant length, so every recompilation comes from a switch and none from a new shape.
LENGTHS = [64] * 8
CURVE = [0.50, 0.95, 0.50, 0.95, 0.50, 0.95, 0.50, 0.50]
ON = [False, False, True, False, True, False, True, False]


@pytest.fixture(autouse=True)
def _forget_compilation():
    # TrainingArguments(torch_compile=True) exports ACCELERATE_DYNAMO_* variables and accelerate keeps a
    # process-wide state; without undoing both, models of later tests in this process would be compiled too.
    environment = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environment)
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
    torch_dynamo.reset()


def compiled_run(tmp_path, budget: int):
    torch_dynamo.reset()
    callback = AutoOffloadCallback(
        min_steps=0, compile_max_switches=budget, probe=ScriptedProbe(CURVE), policy="hysteresis"
    )
    moved = []

    class Record(type(callback).__mro__[1]):  # a plain TrainerCallback
        def on_step_end(self, args, state, control, **kwargs):
            moved.append(callback.controller.last_step_bytes)

    train(tmp_path, LENGTHS, callbacks=[callback, Record()], torch_compile=True, torch_compile_backend="aot_eager")
    return callback.controller, moved


def test_switch_takes_effect_in_a_compiled_model_within_the_budget(tmp_path):
    controller, moved = compiled_run(tmp_path, budget=4)
    assert controller.planner.compiled
    assert moved == [expected_bytes(64) if on else 0 for on in ON]
    assert controller.record.switches == 6
    # Each variant compiles once; switching back and forth afterwards hits dynamo's cache.
    assert 1 <= controller.planner.budget.spent <= 2
    assert not controller.planner.latched


def test_spent_budget_latches_offload_on(tmp_path):
    with pytest.warns(AutoOffloadWarning, match="COMPILE_MAX_SWITCHES=1 is spent; offload stays on"):
        controller, moved = compiled_run(tmp_path, budget=1)
    assert controller.planner.latched and controller.planner.budget.spent == 1
    # Latched after the first switch compiled: every later step offloads, whatever the memory says.
    assert moved[:2] == [0, 0] and all(m == expected_bytes(64) for m in moved[2:])


def test_keep_under_compile_takes_allowed_levels_within_the_budget(tmp_path):
    torch_dynamo.reset()
    callback = AutoOffloadCallback(recompute="auto", compile_max_switches=4, probe=ScriptedProbe([0.01]))
    kept = []

    class Record(type(callback).__mro__[1]):  # a plain TrainerCallback
        def on_step_end(self, args, state, control, **kwargs):
            kept.append(callback.controller.switch.kept)

    trainer, _ = train(
        tmp_path, [64] * 4, callbacks=[callback, Record()], torch_compile=True, torch_compile_backend="aot_eager"
    )
    controller = callback.controller
    assert controller.planner.compiled
    # From the first reading on every layer keeps (ample memory); the plan changed once, from 0 kept to 4.
    assert kept == [0, 4, 4, 4]
    assert controller.planner.budget.spent <= 1 and not controller.planner.latched
    assert controller.planner.keep.samples == {}  # nothing measured under compile: the seed decided
    assert [h["autooffload/kept"] for h in trainer.state.log_history if "loss" in h] == [0.0, 1.0, 1.0, 1.0]
