"""torch.compile: a switch takes effect in a compiled model, and recompilations stay within the budget.

Trainer's ``torch_compile`` with the ``aot_eager`` backend: dynamo's guards, graph breaks and recompiles are
exactly those of inductor, without inductor's code generation (minutes on a 2-core CPU). Under compile the ladder
keeps, recomputes and offloads as it does eagerly: losses and gradients equal the compiled plain run's bit for bit,
the bytes moved equal the arithmetic, each form compiles once, and the keep model is measured on the compiled
layers.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from conftest import LAYERS, compiles_whole, expected_bytes, layer_frames, model, random_ids, train

from autooffload import AutoOffloadCallback, AutoOffloadWarning, OffloadController, ScriptedProbe, Settings
from autooffload.apply.compile_guard import compiled_graphs
from autooffload.apply.switch import RESUME_AFTER

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


def planned_by_hand(
    settings: Settings, net: torch.nn.Module | None = None
) -> tuple[torch.nn.Module, OffloadController]:
    """A tiny Qwen3 (or ``net``) with transformers' checkpointing and a controller attached as under compile, whose
    own decision is stubbed out: the test installs each plan itself (``controller.switch.apply``)."""
    torch_dynamo.reset()
    net = model().train() if net is None else net
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    controller = OffloadController(settings, probe=None)
    assert controller.attach(net, compiled=True)
    controller.before_forward = lambda *call: 0
    return net, controller


def test_switch_takes_effect_in_a_compiled_model_within_the_budget(tmp_path):
    whole = compiles_whole()
    controller, moved = compiled_run(tmp_path, budget=4)
    assert controller.planner.compiled
    assert moved == [expected_bytes(64) if on else 0 for on in ON]
    assert controller.record.switches == 6
    # Each variant compiles once; switching back and forth afterwards hits dynamo's cache. Where the layers already
    # run as frames of their own, a switch compiles nothing and is not charged.
    if whole:
        assert 1 <= controller.planner.budget.spent <= 2
    else:
        assert controller.planner.budget.spent == 0
    assert not controller.planner.latched


def test_spent_budget_latches_offload_on(tmp_path):
    if not compiles_whole():
        pytest.skip("this transformers breaks the graph in every checkpointed layer: no switch compiles anything")
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
    # Measured on the compiled layers (the first micro-batch, every layer recomputing under its counter).
    samples = controller.planner.keep.samples
    assert set(samples) == {(layer, 64, 64) for layer in range(LAYERS)} and all(v > 0 for v in samples.values())
    assert [h["autooffload/kept"] for h in trainer.state.log_history if "loss" in h] == [0.0, 1.0, 1.0, 1.0]


# ---- the rungs under compile ------------------------------------------------------------------------------


PLANS = [(0, 0, False), (0, 2, True), (0, 2, False), (1, 0, False), (1, 2, False), (0, 4, False), (0, 0, False)]


def test_keep_recompute_and_offload_under_compile_match_compiled_plain_and_compile_once():
    """Every form of the ladder on a compiled model (offload 1, keep 2, measured or not) gives the loss and the
    gradients of the compiled model with transformers' own checkpointing, bit for bit; the offloaded inputs are the
    arithmetic; a third pass over the same plans compiles nothing; and after an offloading or measuring
    micro-batch, the model runs as one graph again once ``RESUME_AFTER`` plans in a row had neither."""
    whole = compiles_whole()
    reference = model().train()
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net, controller = planned_by_hand(Settings(mode="off", recompute="auto"), copy.deepcopy(reference))
    compiled_reference = torch.compile(reference, backend="aot_eager")
    compiled = torch.compile(net, backend="aot_eager")
    graphs = []
    for _ in range(3):
        before = compiled_graphs()
        for level, keep, measure in PLANS:
            controller.switch.apply(level, keep, measure)
            for run in (compiled_reference, compiled):
                loss = run(input_ids=random_ids(80), labels=random_ids(80)).loss
                loss.backward()
                run.loss = loss.detach()
            assert torch.equal(compiled_reference.loss, compiled.loss), (level, keep, measure)
            for (name, a), b in zip(net.named_parameters(), reference.parameters(), strict=True):
                assert torch.equal(a.grad, b.grad), (level, keep, measure, name)
            reference.zero_grad(set_to_none=True)
            net.zero_grad(set_to_none=True)
            assert controller.stats.next_step() == expected_bytes(80, batch=2, layers=level)
        graphs.append(compiled_graphs() - before)
    # Each form compiled once, then dynamo's cache. (The second pass may still compile: the first pass began with
    # the layers' loop compiled whole, the second with dynamo having given it up, after the measuring plan.)
    assert graphs[0] > 0 and graphs[2] == 0

    def step():
        compiled(input_ids=random_ids(80), labels=random_ids(80)).loss.backward()

    controller.switch.apply(1, 0)
    assert layer_frames(step) == LAYERS  # an offloading layer: the layers run as frames of their own
    for _ in range(RESUME_AFTER - 1):
        controller.switch.apply(0, 0)
        assert layer_frames(step) == LAYERS  # dynamo has not had the frames back yet
    controller.switch.apply(0, 0)
    # RESUME_AFTER plans without eager frames: one graph again, where transformers' checkpointing compiles whole
    assert layer_frames(step) == (0 if whole else LAYERS)
    net.zero_grad(set_to_none=True)


def test_under_compile_a_recomputing_layer_is_traced_whole_and_offload_still_counts_its_calls():
    """The recompute form counts no calls under compile (no graph break); the offload form does, so that the
    bytes moved are still held to the arithmetic and the sizes learn from a layer input's real bytes."""
    net, controller = planned_by_hand(Settings(mode="off"))
    compiled = torch.compile(net, backend="aot_eager")
    controller.switch.apply(2, 0)
    compiled(input_ids=random_ids(48), labels=random_ids(48)).loss.backward()
    offloading = controller.switch.offloading
    counts = controller.switch.forward.take_counts()
    assert [counts[p] for p in range(LAYERS) if p in offloading] == [1, 1]
    assert [counts[p] for p in range(LAYERS) if p not in offloading] == [0, 0]
    assert controller.stats.next_step() == expected_bytes(48, batch=2, layers=2)


@pytest.mark.parametrize("again", ["rebuilt", "attached"])
def test_frames_given_up_before_a_rebuild_or_a_new_attach_are_given_back(again):
    """The frames an offloading plan made dynamo give up on are given back after ``RESUME_AFTER`` plans without
    eager frames also where the switch was rebuilt in between (a trainer's disable and enable around a reference
    forward) or the model attached again (a second ``train()``): dynamo's state is the model's, not the switch's."""
    if not compiles_whole():
        pytest.skip("this transformers breaks the graph in every checkpointed layer: there is no whole graph")
    net, controller = planned_by_hand(Settings(mode="off"))
    compiled = torch.compile(net, backend="aot_eager")

    def step():
        compiled(input_ids=random_ids(48), labels=random_ids(48)).loss.backward()

    controller.switch.apply(1, 0)
    assert layer_frames(step) == LAYERS  # dynamo gave up the frame that loops over the layers
    if again == "rebuilt":
        controller.switch = controller.switch.rebuilt(list(controller.layout.targets))
    else:
        controller.detach()
        assert controller.attach(net, compiled=True)
    for _ in range(RESUME_AFTER):
        controller.switch.apply(0, 0)
    assert layer_frames(step) == 0
    net.zero_grad(set_to_none=True)


def test_the_hooks_leave_a_compiled_model_in_one_graph():
    """The controller's hooks on the model's entries (the decoder stack inside the causal LM, for a loss computed
    from it) are traced by dynamo and read one attribute there; only where a call decides (the model's own entry)
    does a hook run eagerly. Before: every entry's hook ran eagerly, a graph break inside the model's forward that
    split it into two graphs, the loss apart from the layers (the peers benchmark, every layer kept: 5% slower than
    the same model compiled without autooffload)."""
    net, controller = planned_by_hand(Settings(recompute="auto"))
    assert controller.hooks.stacks  # the decoder stack is an entry of its own
    controller.switch.apply(0, LAYERS)  # every layer keeps: no checkpoint is left for dynamo to break on
    ids = random_ids(64)
    explained = torch_dynamo.explain(lambda: net(input_ids=ids, labels=ids).loss)()
    controller.detach()
    assert explained.graph_count == 1, explained.break_reasons


def test_every_layer_kept_compiles_the_graphs_the_model_compiles_without_autooffload():
    """Where every layer keeps, the compiled step is the partitioner's own: the forward and backward graphs AOTAutograd
    hands the compiler are the ones of the same model compiled with checkpointing off and no autooffload, node for
    node. What compiled ``auto`` costs there beyond that step is its own work per micro-batch, outside the graphs
    (the peers benchmark's (a), docs/compile.md)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def graphs(net: torch.nn.Module, controller: OffloadController | None = None) -> list[str]:
        torch_dynamo.reset()
        codes: list[str] = []

        def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
            codes.append(gm.code)
            return make_boxed_func(gm.forward)

        compiled = torch.compile(net, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
        ids = random_ids(64)
        compiled(input_ids=ids, labels=ids).loss.backward()
        if controller is not None:
            controller.detach()
        return codes

    reference = model().train()
    without = graphs(copy.deepcopy(reference))
    net, controller = planned_by_hand(Settings(recompute="auto"), copy.deepcopy(reference))
    controller.switch.apply(0, LAYERS)
    ours = graphs(net, controller)
    assert len(without) == 2  # one forward graph, one backward graph
    assert ours == without


def test_after_a_measuring_micro_batch_the_model_compiles_whole_again_once_its_frames_are_given_back():
    """recompute="auto" measures the layers at a new length with eager-frame functions (a graph break in the layers'
    loop): dynamo gives that frame up and compiles the frame around it, the causal LM's, with a break at the call.
    That compiled code stays valid for every later plan. Before: when the frames were given back, every layer kept,
    the model still ran as two graphs (the loss apart from the layers), 5% slower than the same model compiled
    without autooffload; the first time they are given back, their compiled code is dropped, and they compile
    whole for the plan in place."""
    import collections

    net, controller = planned_by_hand(Settings(recompute="auto"))
    compiled = torch.compile(net, backend="aot_eager")

    def graphs_run() -> int:
        with torch.profiler.profile() as prof:
            compiled(input_ids=random_ids(64), labels=random_ids(64)).loss.backward()
        net.zero_grad(set_to_none=True)
        return collections.Counter(e.name for e in prof.events())["CompiledFunction"]

    controller.switch.apply(0, LAYERS, measure=True)
    graphs_run()
    for _ in range(RESUME_AFTER + 1):
        controller.switch.apply(0, LAYERS)
        graphs = graphs_run()
    assert controller.switch.frames.recompiled and graphs == 1


def test_a_custom_loop_attaches_to_the_torch_compile_wrapper():
    """``controller.attach(torch.compile(model))`` in a custom loop: the controller attaches to the module the wrapper
    compiled, as Trainer hands it over, and offloads what the arithmetic says. Before: attached to the wrapper, its
    hooks, traced inside the compiled frame, read the wrapper, which dynamo refused at the first forward (an
    AssertionError out of the training step)."""
    torch_dynamo.reset()
    net = model().train()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = torch.compile(net, backend="aot_eager")
    controller = OffloadController(Settings(mode="on"))
    assert controller.attach(compiled) and controller.planner.compiled
    moved = []
    for _ in range(2):
        compiled(input_ids=random_ids(64), labels=random_ids(64)).loss.backward()
        controller.end_step()
        moved.append(controller.last_step_bytes)
    assert moved == [expected_bytes(64, batch=2)] * 2


SKIPPING_SIDE_EFFECTS = """
import torch, torch._dynamo
from conftest import compiles_whole, layer_frames, model, random_ids
from autooffload import OffloadController, Settings

torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
assert compiles_whole()
net, eager = model().train(), model().train()
for each in (net, eager):
    each.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
controller = OffloadController(Settings(mode="off"), probe=None)
compiled = torch.compile(net, backend="aot_eager")
assert controller.attach(compiled)
step = lambda: compiled(input_ids=random_ids(48), labels=random_ids(48)).loss.backward()
step()
net.zero_grad()
assert layer_frames(step) == 0
eager(input_ids=random_ids(48), labels=random_ids(48)).loss.backward()
pairs = zip(net.parameters(), eager.parameters(), strict=True)
assert max(float((a.grad - b.grad).abs().max() / b.grad.abs().max()) for a, b in pairs) < 1e-5
print("whole")
"""


def test_checkpointed_layers_compile_whole_where_dynamo_may_skip_their_side_effects_in_the_recompute():
    """Why compiled checkpointing runs layer by layer on transformers 5.25 (``compiles_whole()`` is False there):
    the attention module is wrapped by ``kernels``' ``use_kernelized_func``, whose forward sets a context variable of
    its own (``_ACTIVE_KERNEL_FUNCS``, a ``CompileableContextVar``), and dynamo refuses a side effect inside the
    checkpoint's higher-order op: a graph break in every layer, transformers' own checkpointing and autooffload's
    recompute alike. ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True`` lets dynamo
    trace it, not replayed in the recompute (the set and its reset leave nothing behind): one graph again, with
    autooffload attached too, and gradients within 1e-5 of eager checkpointing's. What docs/compile.md tells a user who
    compiles on such a transformers. In a process of its own: a frame dynamo gave up on stays given up."""
    import subprocess
    import sys
    from pathlib import Path

    if compiles_whole():
        pytest.skip("this transformers' checkpointed layers compile whole already")
    tests = Path(__file__).parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", SKIPPING_SIDE_EFFECTS], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("whole"), run.stderr[-3000:]
