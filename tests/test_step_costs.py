"""What a step cost beside its compute, per step in the history: Python's garbage collections, host buffers asked
for, mapped, pinned and released, the probe's time and the host's waits for the device (autooffload.observe.costs).
A real tiny Qwen3 trains under the controller; pinning and draining are the recording stand-ins of
tests/test_host_memory.py (there is no pinned memory without a GPU)."""

from __future__ import annotations

import gc
import json

import torch
from conftest import VOCAB, model
from test_host_memory import Pinning

from autooffload import OffloadController, Settings, SimulatedDevice
from autooffload.observe.costs import FIELDS, StepCosts


def train(controller: OffloadController, net: torch.nn.Module, lengths: list[int], collect_at: int | None = None):
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for step, seq in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(step))
        loss = net(input_ids=ids, labels=ids).loss
        if step == collect_at:
            gc.collect()  # a collection inside the step, between its forward and its backward
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        controller.end_step()


def test_every_step_records_its_collections_host_buffers_probe_time_and_waits(tmp_path):
    net = model()
    net.gradient_checkpointing_enable({"use_reentrant": False})
    pinning = Pinning()
    host = pinning.host(release_after=3)
    controller = OffloadController(Settings(mode="on"), probe=SimulatedDevice(2**34), host=host)
    controller.attach(net)
    # Step 0 maps and pins the four layers' buffers; steps 1-2 reuse them; step 3 is longer (four new ones); the
    # short ones go unused, and three steps after their last use (after step 4) they are released, the device
    # drained once first.
    train(controller, net, [64, 64, 64, 128, 128], collect_at=2)
    controller.write_history(tmp_path / "history.jsonl")
    records = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    controller.detach()
    host.release_all()
    assert all(set(FIELDS) <= set(record) for record in records)
    column = {name: [record[name] for record in records] for name in FIELDS}
    assert column["host_takes"] == [4, 4, 4, 4, 4]
    assert column["host_allocations"] == column["host_registrations"] == [4, 0, 0, 4, 0]
    assert column["host_releases"] == [0, 0, 0, 0, 4] and column["syncs"] == [0, 0, 0, 0, 1]
    assert column["gc_collections"][2] >= 1 and column["gc_seconds"][2] > 0
    assert all(seconds > 0 for seconds in column["probe_seconds"])  # the simulated device is read every step
    assert controller.last_step_costs == {name: records[-1][name] for name in FIELDS}


def test_the_collection_callback_goes_with_the_controller():
    net = model()
    net.gradient_checkpointing_enable({"use_reentrant": False})
    controller = OffloadController(Settings(mode="on"), probe=None)
    callbacks = len(gc.callbacks)
    controller.attach(net)
    controller.attach(net)  # a second attach does not add a second callback
    assert len(gc.callbacks) == callbacks + 1
    controller.detach()
    assert len(gc.callbacks) == callbacks


def test_a_step_counts_only_what_happened_since_the_last_one():
    class Host:
        takes = allocations = registrations = releases = syncs = 0
        pin_seconds = 0.0

    host, costs = Host(), StepCosts()
    costs.start(host, 0.5)
    host.takes, host.pin_seconds = 3, 0.25
    first = costs.take(host, 0.75)
    host.takes = 5
    second = costs.take(host, 0.75)
    costs.stop()
    assert (first["host_takes"], first["pin_seconds"], first["probe_seconds"]) == (3, 0.25, 0.25)
    assert (second["host_takes"], second["pin_seconds"], second["probe_seconds"]) == (2, 0.0, 0.0)


def test_a_new_run_on_the_same_controller_records_the_probe_time_of_its_own_steps():
    # A custom loop that trains again from scratch calls reset() (OffloadController.reset's docs); the probe's time
    # is then still counted from the last step, not from the start of the first run (which made it negative).
    net = model()
    net.gradient_checkpointing_enable({"use_reentrant": False})
    controller = OffloadController(Settings(mode="on"), probe=SimulatedDevice(2**34))
    controller.attach(net)
    train(controller, net, [64, 64, 64])
    controller.reset()
    train(controller, net, [64])
    controller.detach()
    assert controller.last_step_costs["probe_seconds"] > 0
