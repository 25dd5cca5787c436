"""The simulated device counts what a device would hold, and the demo shows what autooffload is for on it.

Its default count is the step's peak on torch's CPU allocator, backward included; it is held here, byte for byte,
to what ``torch.profiler`` shows for the same step, on the ladder benchmark's models (a Qwen3 and a hybrid Jamba
stack) in every form a layer takes (recompute, keep, offload)."""

from __future__ import annotations

import gc
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import HIDDEN, LAYERS, VOCAB, model, train

from autooffload import (
    AutoOffloadCallback,
    AutoOffloadWarning,
    MemoryReading,
    OffloadController,
    Settings,
    SimulatedDevice,
)
from autooffload.history import read_history
from autooffload.observe.allocations import AllocationPeak

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import models as ladder_models  # noqa: E402  (the ladder benchmark's models)
from harness.scenarios import SHAPES  # noqa: E402


def _small() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_saved_counts_parameters_gradients_optimizer_state_and_saved_activations():
    net = _small()
    net[0].bias.requires_grad_(False)  # frozen: it has no gradient and no optimizer state
    optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    device = SimulatedDevice("1MiB", count="saved")
    device.watch_model(net, optimizer)
    parameters = (8 * 16 + 16 + 16 * 4 + 4) * 4
    trainable = parameters - 16 * 4
    batch = 3
    # Saved for backward: the first Linear's input (for its weight's gradient) and the ReLU's output (which the
    # second Linear saves too: one storage, counted once); the weights are parameters, not counted.
    activations = batch * 8 * 4 + batch * 16 * 4
    readings = []
    for _ in range(2):
        device.reset()
        net(torch.randn(batch, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        readings.append(device.read())
    # The momentum buffers exist only after the first step(): the second step holds them.
    assert readings[0] == MemoryReading(parameters + trainable + activations, 2**20)
    assert readings[1] == MemoryReading(parameters + trainable + trainable + activations, 2**20)
    assert device.last == dict(parameters=parameters, gradients=trainable, optimizer=trainable, activations=activations)


def test_saved_the_step_holds_its_largest_forward_and_no_grad_forwards_do_not_count():
    net = _small()
    device = SimulatedDevice(10**6, count="saved")
    device.watch_model(net)
    device.reset()
    assert device.read() is None  # no forward yet: nothing to say
    for batch in (5, 2):
        net(torch.randn(batch, 8)).sum().backward()
    with torch.no_grad():
        net(torch.randn(50, 8))
    assert device.read().used_bytes - 2 * (8 * 16 + 16 + 16 * 4 + 4) * 4 == 5 * (8 + 16) * 4
    device.unwatch_model()
    device.reset()
    net(torch.randn(7, 8)).sum().backward()
    assert device.read() is None  # unwatched: nothing counted


def test_offloaded_inputs_leave_the_simulated_device_exactly():
    """Through the controller, every layer offloaded: the saved count is lower by layers x seq x hidden x 4, and
    so is what torch's allocator holds at the end of the forward (the inputs went to host buffers outside it).
    Measured in a process of its own: after the whole suite, the allocator's end-of-forward figure once came out 320
    bytes off in the oldest environment (passing alone in both), so what earlier tests leave behind moves it."""
    import subprocess

    code = "import test_simulated; test_simulated.offloaded_inputs_leave_the_simulated_device_exactly()"
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]


def offloaded_inputs_leave_the_simulated_device_exactly() -> None:
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    seq = 128
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    net(input_ids=ids, labels=ids).loss.backward()  # lazily made tensors (torch's, transformers') made once
    net.zero_grad(set_to_none=True)
    used, held = {}, {}
    for mode in ("off", "on"):
        device = SimulatedDevice("1GiB", count="saved")
        controller = OffloadController(Settings(mode=mode), probe=device)
        controller.attach(net)
        controller.begin_step()
        window = AllocationPeak()
        assert window.start()
        loss = net(input_ids=ids, labels=ids).loss
        window.stop()
        held[mode] = window.last_end
        loss.backward()
        controller.end_step()
        used[mode] = controller.memory.last.bytes
        controller.detach()
        net.zero_grad(set_to_none=True)
    assert used["off"] - used["on"] == LAYERS * seq * HIDDEN * 4
    # The allocator also lets go of one 4-byte scalar per offloading forward (measured, not the inputs').
    assert 0 <= held["off"] - held["on"] - LAYERS * seq * HIDDEN * 4 <= 4


def _profiler_peak(step) -> int:
    """The most torch's CPU allocator held above the start over ``step()``, as torch.profiler records it."""
    from torch._C._profiler import _EventType

    gc.collect()  # as SimulatedDevice.reset() does

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    allocations, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
        nodes.extend(node.children)
    allocations.sort()
    start = allocations[0][2] - allocations[0][1]
    return max(total for _, _, total in allocations) - start


@pytest.mark.parametrize("kind", ["qwen3", "jamba"])
@pytest.mark.parametrize("plan", ["plain", "none", "keep", "offload"])
def test_the_peak_is_the_allocators_own_as_torch_profiler_shows_it(kind, plan):
    """On the ladder benchmark's models: the reading less what the step held at its start is, to the byte, the
    peak torch.profiler records for the same step; with checkpointing it is above the saved count (activations and
    every gradient) by the backward's recompute and transients, without it below (the two are never all alive)."""
    shape = SHAPES["quick"]
    net = ladder_models.build_model(shape, "cpu", kind)
    ladder_models.set_checkpointing(net, plan != "none")
    ids = torch.randint(0, shape.vocab, (1, shape.long), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    readings = {}

    def step():
        net(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for count in ("peak", "saved"):
        device = SimulatedDevice("1GiB", count=count)
        controller = OffloadController(Settings(mode="off"), probe=device)
        if plan == "none":  # nothing to control: the device watches the model alone
            device.watch_model(net, optimizer)
        else:
            controller.attach(net, optimizer=optimizer)
            controller.before_forward = lambda *call: 0  # the test installs the plan itself
            controller.switch.apply(*{"plain": (0, 0), "keep": (0, LAYERS), "offload": (1, 0)}[plan])
        step()  # AdamW's state exists from here on: the next steps hold it from their start
        device.reset()
        step()
        device.read()
        readings[count] = dict(device.last)
        device.unwatch_model()
        profiled = _profiler_peak(step)
        controller.detach()
    peak = readings["peak"]
    parameters = sum(p.numel() * p.element_size() for p in net.parameters())
    assert peak["parameters"] == parameters and peak["gradients"] == 0
    assert 2 * parameters <= peak["optimizer"] <= 2 * parameters + 8 * len(list(net.parameters()))  # + steps
    assert peak["step"] == profiled
    saved = readings["saved"]
    assert peak["step"] >= saved["activations"]  # at least what the forward saved is held at its end
    if plan in ("plain", "offload"):  # checkpointed: the backward's recompute and gradients come on top
        assert peak["step"] > saved["activations"] + saved["gradients"]


@pytest.mark.parametrize("seq", [64, 512])
def test_the_first_sample_counts_the_optimizer_state_once(seq):
    # AdamW makes its state at the first step(), inside step 0's window. At 64 tokens the optimizer step is the
    # peak and step 0's reading holds the state (counting it again made the first sample 42% larger than the same
    # length's later ones); at 512 the backward is, and the state is still to come. Either way the first sample
    # is what the same length reads once the state exists.
    net = model()
    net.gradient_checkpointing_enable({"use_reentrant": False})
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    controller = OffloadController(Settings(), probe=SimulatedDevice(2**34))
    controller.attach(net, optimizer=optimizer)
    for step in range(3):
        ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(step))
        net(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        controller.end_step()
    first, *later = [plain for _, plain, _ in controller.policy.samples]
    assert all(first == pytest.approx(other, rel=1e-3) for other in later), (first, later)
    controller.detach()


def test_under_trainer_too_the_first_sample_counts_the_optimizer_state_once(tmp_path):
    # Trainer steps accelerate's wrapper, which hands the torch optimizer's step() a closure of None: still read.
    callback = AutoOffloadCallback(probe=SimulatedDevice(2**34))
    train(tmp_path, [64, 64, 64], callbacks=[callback])
    first, *later = [plain for _, plain, _ in callback.controller.policy.samples]
    assert later and all(first == pytest.approx(other, rel=1e-3) for other in later), (first, later)


def test_marks_split_the_step_into_segments_whose_most_is_the_peak():
    """The keep model's marks: each segment's most held is what the allocator held between two marks, so their
    largest is the step's peak, and a segment sees what is allocated in it (a block of 1 MB held from one mark to
    the next raises that segment by it, not the one before)."""
    window = AllocationPeak()
    assert window.start()
    window.mark("a")
    block = torch.ones(2**18)  # 1 MiB
    window.mark("b")
    del block
    spike = torch.ones(2**19)  # 2 MiB, freed before the next mark
    del spike
    window.mark("c")
    peak = window.stop()
    labels = [label for label, _ in window.segments]
    most = dict(window.segments)
    assert labels == [None, "a", "b", "c"] and peak == max(most.values()) == most["b"]
    assert most["a"] == most[None] + 2**20 and most["b"] == most["a"] - 2**20 + 2**21 and most["c"] <= most["a"]
    window.start()
    assert window.stop() is not None and window.segments is None  # no mark: no segments


def test_a_profiler_already_running_falls_back_to_the_saved_count_with_one_warning():
    net = _small()
    device = SimulatedDevice(10**6)
    device.watch_model(net)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.warns(
            AutoOffloadWarning, match=r"another profiler runs .* \(see docs/troubleshooting.md#simulated-peak\)"
        ):
            device.reset()
        net(torch.randn(5, 8)).sum().backward()
        reading = device.read()
    assert "activations" in device.last and "step" not in device.last
    assert reading.used_bytes == 2 * (8 * 16 + 16 + 16 * 4 + 4) * 4 + 5 * (8 + 16) * 4
    device.reset()  # the profiler is gone: the peak again
    net(torch.randn(5, 8)).sum().backward()
    device.read()
    assert "step" in device.last


@pytest.mark.parametrize("size", [0, -5, "0.5", "lots", True])
def test_a_size_that_is_not_one_is_refused(size):
    with pytest.raises(ValueError, match="SimulatedDevice size"):
        SimulatedDevice(size)


def test_a_count_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="SimulatedDevice count 'max': expected one of peak, saved"):
        SimulatedDevice("1MiB", count="max")


def test_the_demo_shows_partial_offload_keep_and_simulated_memory(tmp_path, capsys):
    from autooffload.demo import main as demo

    assert demo(["--output-dir", str(tmp_path)]) == 0  # 0: every step's bytes equal the arithmetic
    records = read_history(tmp_path / "autooffload" / "history.jsonl")
    assert all(r["memory_fraction"] is not None for r in records)
    assert any(0 < level < LAYERS for r in records for level in r["offloaded"])  # k of L
    assert any(kept > 0 for r in records for kept in r["kept"])  # keep where there is room
    high = records[0]["memory_high"]
    assert any(r["predicted_peak_bytes"] / r["total_bytes"] > high for r in records if r["predicted_peak_bytes"])
    assert all(r["memory_fraction"] <= high for r in records)  # the plan keeps the simulated device under it
    assert (tmp_path / "autooffload" / "history.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "simulated device" in out and "history.png" in out
    # The README's sample is this run's output, row for row, where the demo runs the device the README names (it is
    # larger on transformers 4.x, and the percentages differ); elsewhere the sample's header is still the demo's.
    from autooffload.demo import DEVICE_BYTES

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    same_device = f"simulated device of {DEVICE_BYTES:,} bytes" in " ".join(readme.split())
    missing = readme_sample_missing(readme, out, header_only=not same_device)
    table = "\n".join(line for line in out.splitlines() if re.match(r"^ *(step|\d+) +\d*", line))
    assert not missing, f"README.md's sample of the demo is not what it printed: {missing}; its rows:\n{table}"


def readme_sample(readme: str) -> list[str]:
    """The README's sample of ``autooffload demo``: its ```text block that starts with the demo's header, by line."""
    blocks = re.findall(r"^```text\n(.*?)^```", readme, flags=re.S | re.M)
    sample = [block.splitlines() for block in blocks if block.startswith("step  seq memory predicted")]
    assert len(sample) == 1, "README.md has no sample of the demo's table (a ```text block starting with its header)"
    return sample[0]


def readme_sample_missing(readme: str, printed: str, header_only: bool = False) -> list[str]:
    """The README sample's lines that the demo did not print, each as a whole line."""
    lines = readme_sample(readme)[: 1 if header_only else None]
    printed_lines = {line.rstrip() for line in printed.splitlines()}
    return [line for line in lines if line.rstrip() not in printed_lines]


def test_a_readme_sample_that_differs_from_the_demo_is_caught():
    """Without the demo's run (the test above holds the README to it): a changed percentage is a missing row."""
    from autooffload.demo import HIDDEN as DEMO_HIDDEN
    from autooffload.demo import LAYERS as DEMO_LAYERS
    from autooffload.demo import report

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    sample = readme_sample(readme)
    assert len(sample) > 2 and sample[0] == report([], DEMO_LAYERS, DEMO_HIDDEN)  # its header is the demo's
    printed = "\n".join(["some log line", *sample, "history: ..."])
    assert readme_sample_missing(readme, printed) == []
    changed = re.sub(r"(\d+)%", lambda m: f"{int(m.group(1)) + 1}%", sample[1], count=1)  # 16% -> 17%
    assert changed != sample[1]
    assert readme_sample_missing(readme, printed.replace(sample[1], changed)) == [sample[1]]
    assert readme_sample_missing(readme, printed.replace(sample[2], ""), header_only=True) == []


def test_a_probe_that_cannot_watch_the_model_is_dropped_with_one_warning():
    class Broken(SimulatedDevice):
        def watch_model(self, model, optimizer=None):
            raise RuntimeError("no")

    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    controller = OffloadController(Settings(), probe=Broken("1GiB"))
    with pytest.warns(AutoOffloadWarning, match=r"watch_model failed .* \(see docs/troubleshooting.md#probe-watch\)"):
        assert controller.attach(net)
    ids = torch.randint(0, VOCAB, (1, 32))
    net(input_ids=ids, labels=ids).loss.backward()
    controller.end_step()
    assert controller.memory.probe is None and controller.memory_fraction is None


def test_the_simulated_device_lets_go_of_the_model_once_training_ends(tmp_path):
    """Before: ``unwatch_model`` removed the hooks but kept the model (and the optimizer getter), so a device kept
    for the next run (the callback holds it) kept the trained model alive after ``del trainer, model``."""
    import gc
    import weakref

    from conftest import train

    from autooffload import AutoOffloadCallback

    device = SimulatedDevice("64MiB")
    callback = AutoOffloadCallback(probe=device)
    trainer, net = train(tmp_path, [64, 64], callbacks=[callback])
    alive = weakref.ref(net)
    del trainer, net
    gc.collect()
    assert alive() is None
    assert device.read() is None  # detached: nothing to read until the next watch_model
