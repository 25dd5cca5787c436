"""Host memory: one manager for both engines, exact sizes, a budget for the node, real release, and pinning
that fails. The pinning calls (``cudaHostRegister``/``Unregister``) are the hardware surface: tests inject
recording stand-ins, so on a CPU the manager pins (records) and the engines copy into its buffers."""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import warnings

import pytest
import torch
from conftest import HIDDEN, LAYERS, expected_bytes, model, random_ids, train
from transformers import TrainerCallback

from autooffload import AutoOffloadCallback, AutoOffloadWarning, OffloadController, Settings, SettingsError
from autooffload.apply import host_memory, pinning
from autooffload.apply.host_budget import node_budget, ranks_per_node
from autooffload.apply.host_memory import PAGE, RELEASE_AFTER_STEPS, HostMemory, page_round
from autooffload.apply.offload import OffloadStats, SyncEngine
from autooffload.history import read_history

CPU = torch.device("cpu")
PLENTY = (1 << 40, 1 << 41)


class Pinning:
    """Records what is pinned and unpinned; ``fail_at``: the call (1-based) from which pinning fails."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.calls = 0
        self.pinned: set[int] = set()
        self.unpinned: list[int] = []
        self.drains = 0
        self.drained: list[torch.device] = []

    def register(self, buffer: torch.Tensor) -> None:
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("cudaHostRegister failed with cudaError 2")
        self.pinned.add(buffer.data_ptr())

    def unregister(self, buffer: torch.Tensor) -> None:
        self.pinned.remove(buffer.data_ptr())
        self.unpinned.append(buffer.data_ptr())

    def drain(self, device: torch.device) -> None:
        self.drains += 1
        self.drained.append(device)

    def host(self, budget_bytes: int | None = None, **kwargs) -> HostMemory:
        kwargs.setdefault("memory", lambda: PLENTY)
        return HostMemory(
            budget_bytes, pin=True, register=self.register, unregister=self.unregister, drain=self.drain, **kwargs
        )


# ---- the manager --------------------------------------------------------------------------------------


def test_buffers_are_the_size_asked_rounded_to_a_page_not_a_power_of_two():
    host = Pinning().host()
    sizes = [host.take(n, CPU).nbytes for n in (3000, 5 * 2**20 + 1, 9 * 2**20)]
    assert sizes == [PAGE, 5 * 2**20 + PAGE, 9 * 2**20]  # torch's pinned allocator: 4 KiB, 8 MiB, 16 MiB
    assert host.held_bytes == host.pinned_bytes == sum(sizes)


def test_a_free_buffer_is_reused_even_when_the_host_reads_short():
    available = [PLENTY[0]]
    host = Pinning().host(memory=lambda: (available[0], PLENTY[1]))
    big = host.take(8192, CPU)
    host.give(big)
    available[0] = 0  # what the pool holds is not free memory, but it is ours to hand out
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host.take(3000, CPU) is big
    assert host.allocations == 1
    with pytest.warns(AutoOffloadWarning, match="host memory is short"):
        assert host.take(3000, CPU) is None  # a new buffer would need free host memory


def test_the_budget_is_never_exceeded_free_buffers_make_room_first():
    pinning = Pinning()
    host = pinning.host(budget_bytes=5 * PAGE)
    small = [host.take(PAGE, CPU) for _ in range(3)]
    for buffer in small[:2]:
        host.give(buffer)
    # 3 pages held; 3 more do not fit: free ones (too small to serve it) are released, as many as needed
    large = host.take(3 * PAGE, CPU)
    assert large is not None and host.held_bytes == 5 * PAGE and pinning.drains == 1
    assert len(pinning.unpinned) == 1
    with pytest.warns(AutoOffloadWarning, match="budget"):
        assert host.take(2 * PAGE, CPU) is None
    assert host.peak_held_bytes <= 5 * PAGE


def test_a_long_micro_batchs_idle_buffers_do_not_starve_the_short_ones_after_it():
    """Budget: two long inputs. After a long micro-batch its two buffers are free; a short one's four inputs must
    all fit (its planner said so), not borrow a long buffer each and be refused the third (issue 31)."""
    pinning = Pinning()
    long, short = 32 * PAGE, 4 * PAGE
    host = pinning.host(budget_bytes=2 * long)
    for buffer in [host.take(long, CPU), host.take(long, CPU)]:
        host.give(buffer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lent = [host.take(short, CPU) for _ in range(4)]
    assert all(b is not None and b.nbytes == short for b in lent)
    assert host.held_bytes <= 2 * long and host.peak_held_bytes <= 2 * long
    for buffer in lent:
        host.give(buffer)
    # The next long micro-batch gets its two buffers back, the short ones' making room.
    assert [host.take(long, CPU).nbytes for _ in range(2)] == [long, long] and host.held_bytes == 2 * long
    # A free buffer twice the request or less is reused; with the host short, any larger one is lent too.
    host = pinning.host(budget_bytes=2 * long)
    buffer = host.take(2 * short, CPU)
    host.give(buffer)
    assert host.take(short, CPU) is buffer
    host.give(buffer)
    host.memory = lambda: (0, PLENTY[1])
    with pytest.warns(AutoOffloadWarning, match="host memory is short"):
        assert host.take(long, CPU) is None
    host.memory = lambda: PLENTY
    big = host.take(long, CPU)
    host.give(big)
    host.memory = lambda: (0, PLENTY[1])
    assert host.take(short // 2, CPU) is buffer and host.take(short, CPU) is big


def test_a_free_buffer_is_lent_only_where_the_rest_of_the_micro_batch_still_fits_beside_it():
    """Budget 64 pages; a free buffer of 27 pages; the micro-batch expects four inputs of 15 pages (60 pages, what
    the controller's cap allows). Lending the 27-page buffer to the first would leave no room for the fourth (the
    soak's 256 KiB budget: one input in a few steps stayed on the device). A free buffer more than twice the request
    serves it only where no new buffer of its size fits under the budget (a small buffer costs little to pin)."""
    host = Pinning().host(budget_bytes=64 * PAGE)
    host.give(host.take(27 * PAGE, CPU))
    host.expect([15 * PAGE - 100] * 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lent = [host.take(15 * PAGE - 100, CPU) for _ in range(4)]
    assert [b.nbytes for b in lent] == [15 * PAGE] * 4 and host.held_bytes == 60 * PAGE
    for buffer in lent:
        host.give(buffer)
    host.expect([2 * PAGE] * 3)  # room for two new 2-page buffers; the third input gets a free 15-page one
    assert [host.take(2 * PAGE, CPU).nbytes for _ in range(3)] == [2 * PAGE, 2 * PAGE, 15 * PAGE]
    assert host.allocations == 7 and host.held_bytes == 64 * PAGE


def test_a_short_forward_leaves_the_free_buffers_of_a_long_one_for_the_long_forward_after_it():
    """Issue 37, item 4.1: mode on, a budget of 576 KiB, a step with a 64-token and a 512-token forward before one
    backward (4 layers, hidden 64, fp32: 16 KiB and 128 KiB per layer input, 576 KiB in all). After an earlier long
    step the short forward took the long one's free 128 KiB buffers for its 16 KiB inputs, and all 524,288 B of the
    long forward's inputs stayed on the device; a fresh manager moved everything. Now both do."""
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    host = Pinning().host(budget_bytes=576 * 1024)
    controller = OffloadController(Settings(mode="on"), probe=None, host=host)
    controller.attach(net)
    short, long = random_ids(64, batch=1), random_ids(512, batch=1)
    net(input_ids=long, labels=long).loss.backward()
    controller.end_step()
    assert controller.last_step_bytes == expected_bytes(512, batch=1) == 4 * 128 * 1024
    (net(input_ids=short, labels=short).loss + net(input_ids=long, labels=long).loss).backward()
    controller.end_step()
    assert controller.last_step_bytes == expected_bytes(64, batch=1) + expected_bytes(512, batch=1) == 576 * 1024
    assert controller.stats.short_bytes == 0 and host.held_bytes == 576 * 1024


def test_free_buffers_are_released_after_steps_unused():
    pinning = Pinning()
    host = pinning.host(release_after=3)
    buffers = [host.take(PAGE, CPU) for _ in range(2)]
    pointers = {b.tensor.data_ptr() for b in buffers}
    for buffer in buffers:
        host.give(buffer)
    host.end_step()
    host.end_step()
    assert host.held_bytes == 2 * PAGE and pinning.unpinned == []
    host.end_step()
    assert host.held_bytes == host.pinned_bytes == 0 and set(pinning.unpinned) == pointers
    assert host.releases == 2 and pinning.drains == 1  # one drain before the batch


def test_a_short_host_releases_the_free_buffers_the_last_step_did_not_use():
    # Pinning is slow, so idle buffers wait long for their size to come back; not while others need the memory.
    pinning = Pinning()
    available = [PLENTY[0]]
    host = pinning.host(memory=lambda: (available[0], PLENTY[1]))
    old, recent = host.take(PAGE, CPU), host.take(2 * PAGE, CPU)
    old_pointer = old.tensor.data_ptr()
    host.give(old)
    host.give(recent)
    host.end_step()
    host.give(host.take(2 * PAGE, CPU))  # the next step uses recent again
    host.end_step()  # plenty free: nothing goes
    assert host.held_bytes == 3 * PAGE and pinning.unpinned == []
    host.give(host.take(2 * PAGE, CPU))
    available[0] = PLENTY[1] // 20  # 5% free, under the 10% kept free
    host.end_step()
    assert host.held_bytes == 2 * PAGE and pinning.unpinned == [old_pointer] and pinning.drains == 1


def test_a_host_short_by_a_little_releases_only_what_it_lacks():
    # Releasing every unused buffer for a page's shortfall would have the next long micro-batch pin them again.
    pinning = Pinning()
    available = [PLENTY[0]]
    host = pinning.host(memory=lambda: (available[0], PLENTY[1]))
    buffers = [host.take(4 * PAGE, CPU) for _ in range(3)]
    pointers = [b.tensor.data_ptr() for b in buffers]
    for buffer in buffers:
        host.give(buffer)
    host.end_step()
    host.give(host.take(4 * PAGE, CPU))  # the next step uses one of them (the smallest fit: the first)
    available[0] = PLENTY[1] // 10 - PAGE  # one page short of the 10% kept free
    host.end_step()
    assert host.held_bytes == 8 * PAGE and len(pinning.unpinned) == 1 and pinning.unpinned[0] in pointers[1:]


def test_default_buffers_are_exact_mappings_that_go_back_to_the_system():
    host = HostMemory(pin=False, memory=lambda: PLENTY, release_after=1)
    buffer = host.take(3 * 2**20 + 5, CPU)
    assert buffer.nbytes == 3 * 2**20 + PAGE and buffer.tensor.data_ptr() % PAGE == 0
    buffer.tensor.fill_(7)
    host.give(buffer)
    host.end_step()
    assert host.held_bytes == 0 and buffer.tensor.numel() == 0


def test_pinning_that_fails_gives_pageable_buffers_with_one_warning():
    pinning = Pinning(fail_at=2)
    host = pinning.host()
    first = host.take(PAGE, CPU)
    with pytest.warns(AutoOffloadWarning, match="pageable") as caught:
        second = host.take(PAGE, CPU)
        third = host.take(PAGE, CPU)
    assert len(caught) == 1 and pinning.calls == 2  # not tried again
    assert (first.pinned, second.pinned, third.pinned) == (True, False, False)
    assert host.held_bytes == 3 * PAGE and host.pinned_bytes == PAGE


def test_a_release_drains_every_device_whose_buffers_go():
    # One process driving two GPUs (device_map="auto"): synchronize() alone waits for the current one only,
    # and a copy still reading a buffer of the other would read pages being unpinned and unmapped.
    pinning = Pinning()
    host = pinning.host(release_after=1)
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    buffers = [host.take(PAGE, device) for device in devices for _ in range(2)]
    for buffer in buffers:
        host.give(buffer)
    host.end_step()
    assert host.held_bytes == 0
    assert pinning.drained == devices  # each once, before its first buffer goes


def test_a_manager_that_goes_unpins_its_buffers():
    # A controller replaced or dropped without detach: the mappings die with it, and a range unmapped while
    # still registered stays pinned (and may refuse a later registration at its address).
    pinning = Pinning()
    host = pinning.host()
    for buffer in [host.take(PAGE, CPU), host.take(2 * PAGE, CPU)]:
        host.give(buffer)
    del host, buffer
    gc.collect()
    assert pinning.pinned == set() and len(pinning.unpinned) == 2


class FailingRuntime:
    """cudart as torch binds it: calls return an error code and leave it as the runtime's last error, which
    torch's next kernel launch check (``cudaGetLastError``) raises."""

    def __init__(self) -> None:
        self.last_error = 0

    def cudaHostRegister(self, pointer, size, flags):
        self.last_error = 2  # cudaErrorMemoryAllocation: a memlock or WSL cap
        return 2

    def cudaHostUnregister(self, pointer):
        self.last_error = 712  # cudaErrorHostMemoryNotRegistered
        return 712


def test_a_failed_pinning_call_leaves_no_cuda_error_behind(monkeypatch):
    runtime = FailingRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)

    def launch_check():  # what torch's next kernel launch does: raise the last error, and clear it
        error, runtime.last_error = runtime.last_error, 0
        if error:
            raise RuntimeError(f"CUDA error {error}")

    monkeypatch.setattr(pinning, "launch_kernel", launch_check, raising=False)
    host = HostMemory(pin=True, memory=lambda: PLENTY)
    with pytest.warns(AutoOffloadWarning, match="pageable"):
        buffer = host.take(PAGE, CPU)
    assert not buffer.pinned
    launch_check()  # the step's next kernel: nothing left to raise
    host_memory.cuda_unregister(buffer.tensor)
    launch_check()


@pytest.mark.parametrize(
    ("env", "ranks"),
    [
        ({"LOCAL_WORLD_SIZE": "8"}, 8),
        ({"LOCAL_SIZE": "4"}, 4),  # the deepspeed launcher sets only this one
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2),
        ({"LOCAL_WORLD_SIZE": "x", "LOCAL_SIZE": "3"}, 3),
        ({}, 1),
    ],
)
def test_ranks_per_node_from_every_launcher(monkeypatch, env, ranks):
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ranks_per_node() == ranks


# ---- the setting -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "budget"), [("0.25", 2**30), ("512MiB", 2**29), ("64GiB", 64 * 2**30), ("2GB", 2 * 10**9)]
)
def test_host_memory_setting(raw, budget):
    setting = Settings.from_env({"AUTOOFFLOAD_HOST_MEMORY": raw}).host_memory
    assert node_budget(setting, memory=lambda: (3 * 2**30, 4 * 2**30)) == budget


def test_host_memory_default_is_half_of_what_is_available():
    assert Settings().host_memory == "auto"
    assert node_budget("auto", memory=lambda: (3 * 2**30, 4 * 2**30)) == 3 * 2**29


@pytest.mark.parametrize("raw", ["0", "1.5", "lots", "64XB", "-1GiB", "12B"])
def test_bad_host_memory_fails_at_construction(raw):
    with pytest.raises(SettingsError, match=r"AUTOOFFLOAD_HOST_MEMORY=.* is not allowed: expected 'auto', a fraction"):
        Settings.from_env({"AUTOOFFLOAD_HOST_MEMORY": raw})


# ---- through the Trainer -----------------------------------------------------------------------------------


class Steps(TrainerCallback):
    """After every step: the level, the bytes moved, the bytes held; and the most held at any pack."""

    def __init__(self, callback: AutoOffloadCallback) -> None:
        self.controller = callback.controller
        self.rows: list[tuple[int, int, int]] = []

    def on_step_end(self, args, state, control, **kwargs):
        c = self.controller
        self.rows.append((c.level, c.last_step_bytes, c.host.held_bytes))


def run(tmp_path, lengths, pinning: Pinning, engine: str = "sync", **settings):
    release_after = settings.pop("release_after", RELEASE_AFTER_STEPS)
    callback = AutoOffloadCallback(probe=None, engine=engine, **settings)
    callback.controller.host = pinning.host(release_after=release_after)
    steps = Steps(callback)
    trainer, net = train(tmp_path, lengths, callbacks=[callback, steps])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return callback, steps.rows, losses, net, trainer


@pytest.mark.parametrize(("engine", "mode"), [("sync", "on"), ("stream", "auto")])
def test_a_small_budget_caps_the_level_and_what_is_held(tmp_path, caplog, engine, mode):
    seq = 128
    per_layer = seq * HIDDEN * 4  # fp32, one micro-batch of one sequence: 8 pages
    # Room for two layers' inputs: mode "on" (all layers) and the sequence trigger (all layers) are capped.
    caplog.set_level(logging.INFO, logger="transformers.autooffload")
    callback, rows, _, _, trainer = run(
        tmp_path, [seq] * 3, Pinning(), engine, mode=mode, seq_high=100, seq_low=50, host_memory=f"{2 * per_layer}B"
    )
    host = callback.controller.host
    assert host.budget_bytes == 2 * per_layer
    assert [level for level, *_ in rows] == [2, 2, 2]
    # The sync engine copies both layers' inputs; the stream engine keeps the last offloaded one on the device
    # only when it is the model's last layer, which it is not here: both move two layers' inputs.
    assert [moved for _, moved, _ in rows] == [2 * per_layer] * 3
    assert [held for *_, held in rows] == [2 * per_layer] * 3 and host.peak_held_bytes <= host.budget_bytes
    assert host.held_bytes == 0  # released when training ends
    capped = [r.getMessage() for r in caplog.records if "capped" in r.getMessage()]
    assert len(capped) == 1 and "capped at 2 of the 4 layer(s)" in capped[0]
    logged = [h["autooffload/host_bytes"] for h in trainer.state.log_history if "loss" in h]
    assert logged == [2 * per_layer] * 3


def test_the_budget_is_shared_by_the_ranks_of_the_node(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    seq = 128
    per_layer = seq * HIDDEN * 4
    callback, rows, *_ = run(tmp_path, [seq], Pinning(), mode="on", host_memory=f"{4 * per_layer}B")
    assert callback.controller.host.budget_bytes == per_layer
    assert rows == [(1, per_layer, per_layer)]  # a quarter of the node's budget: one layer's input


@pytest.mark.parametrize("engine", ["sync", "stream"])
def test_pinning_that_fails_mid_step_falls_back_with_one_warning_and_equal_results(tmp_path, engine):
    lengths = [96, 128, 64]
    _, _, reference, reference_net, _ = run(tmp_path / "ref", lengths, Pinning(), engine, mode="on")
    pinning = Pinning(fail_at=3)  # the third layer of the first forward
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, rows, losses, net, _ = run(tmp_path / "fail", lengths, pinning, engine, mode="on")
    ours = [w for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert len(ours) == 1 and "pageable" in str(ours[0].message)
    assert losses == reference
    for (name, a), (_, b) in zip(net.named_parameters(), reference_net.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    moved = [expected_bytes(seq) for seq in lengths]
    if engine == "stream":  # the last layer's input stays on the device
        moved = [m * (LAYERS - 1) // LAYERS for m in moved]
    assert [m for _, m, _ in rows] == moved
    # Two buffers pinned, the third failed and was not tried again; the rest pageable; all released at the end.
    assert pinning.calls == 3 and len(pinning.unpinned) == 2 and pinning.pinned == set()
    assert rows[0][2] == moved[0]  # pinned or not, every buffer is held and counted (exact page multiples here)


def test_the_pool_gives_memory_back_after_offload_has_been_off(tmp_path):
    pinning = Pinning()
    lengths = [256, 256] + [64] * 6
    callback, rows, *_ = run(
        tmp_path, lengths, pinning, policy="hysteresis", seq_high=200, seq_low=100, min_steps=1, release_after=3
    )
    per_layer = page_round(256 * HIDDEN * 4)
    assert [level for level, *_ in rows] == [LAYERS, LAYERS] + [0] * 6
    # Offload off from step 2; the buffers go back three steps after their last use (step 1's backward, which
    # some transformers releases let go of only at step 2), and not before.
    held = [held for *_, held in rows]
    assert held[:3] == [LAYERS * per_layer] * 3 and held[4:] == [0] * 4
    assert len(pinning.unpinned) == LAYERS and pinning.pinned == set()
    assert callback.controller.host.releases == callback.controller.host.allocations == LAYERS


@pytest.mark.parametrize("engine", ["sync", "stream"])
def test_a_long_micro_batch_finds_its_buffers_after_short_ones(tmp_path, engine):
    # On an H200 machine pinning a fresh buffer cost about what a 32k-token step's compute did: one long
    # micro-batch in six must not pin its buffers anew each time (they were released after 4 idle steps).
    pinning = Pinning()
    lengths = [256] + [64] * 5 + [256]
    callback, rows, *_ = run(
        tmp_path, lengths, pinning, engine, policy="hysteresis", seq_high=200, seq_low=100, min_steps=1
    )
    assert [level > 0 for level, *_ in rows] == [True] + [False] * 5 + [True]
    host = callback.controller.host
    assert host.allocations == pinning.calls == rows[0][1] // page_round(256 * HIDDEN * 4)
    assert rows[-1][1] == rows[0][1]  # the same bytes moved, into the same buffers
    assert host.held_bytes == 0  # released when training ends


def test_a_manager_passed_in_keeps_its_buffers_across_detach():
    # The caller's manager (benchmarks interleave modes on one model: attach, one step, detach) serves the next
    # attach from the buffers it pinned; a controller's own manager is released at detach.
    net = model()
    net.gradient_checkpointing_enable()
    ids = random_ids(128, batch=1)

    def step(controller: OffloadController) -> None:
        controller.attach(net)
        net(input_ids=ids, labels=ids).loss.backward()
        controller.end_step()
        controller.detach()

    pinning = Pinning()
    controller = OffloadController(Settings(mode="on", host_memory="1GiB"), probe=None, host=pinning.host())
    step(controller)
    step(controller)
    assert controller.host.held_bytes == pinning.calls * page_round(expected_bytes(128) // LAYERS) > 0
    assert pinning.unpinned == [] and pinning.calls == LAYERS
    controller.host.release_all()
    assert pinning.pinned == set()
    own = OffloadController(Settings(mode="on", host_memory="1GiB"), probe=None)
    own.host = pinning.host()  # the controller's own manager, with recorded pinning (as on a GPU)
    step(own)
    assert own.host.allocations == LAYERS and own.host.held_bytes == 0 and pinning.pinned == set()


def test_the_stream_engine_measures_a_layer_input_from_the_layers_it_moves_and_the_cap_holds(tmp_path):
    # Step 1 (64 tokens) offloads all 4 layers; the stream engine leaves the last one's input on the device. Its
    # bytes per token must still be a layer input's: measured over all 4 layers' tokens, it came out at 3/4, and the
    # cap at step 2 (128 tokens) allowed 3 layers where the budget holds 2 (the third stayed, with a warning).
    per_layer = 128 * HIDDEN * 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback, rows, *_ = run(
            tmp_path, [64, 128], Pinning(), "stream", mode="on", host_memory=f"{5 * per_layer // 2}B"
        )
    assert [w for w in caught if issubclass(w.category, AutoOffloadWarning)] == []
    assert callback.controller.sizes.token_bytes == HIDDEN * 4
    assert [(level, moved) for level, moved, _ in rows] == [(4, 3 * per_layer // 2), (2, 2 * per_layer)]
    assert callback.controller.host.peak_held_bytes <= callback.controller.host.budget_bytes


@pytest.mark.parametrize("engine", ["sync", "stream"])
def test_the_history_and_the_logs_say_what_really_moved_when_host_memory_falls_short(tmp_path, engine):
    """Mode "on", gradient accumulation 2: 64-token then 128-token micro-batches. Host memory runs out two buffers
    after the first micro-batch's (an allocation fails): each 128-token micro-batch moves two layers' inputs (two
    new buffers, then the two it gave back) and keeps the others' on the device. The history said every layer
    offloaded with reason ``mode_on`` (issue 31); it must count what moved, and say why it fell short."""
    moving = LAYERS - 1 if engine == "stream" else LAYERS  # the stream engine keeps the last layer's input
    allocations = []

    def allocate(nbytes: int) -> torch.Tensor:
        allocations.append(nbytes)
        if len(allocations) > moving + 2:
            raise MemoryError("no more host memory")
        return torch.empty(nbytes, dtype=torch.uint8)

    callback = AutoOffloadCallback(probe=None, engine=engine, mode="on")
    callback.controller.host = Pinning().host(allocate=allocate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = train(tmp_path, [64, 128] * 3, [callback], steps=3, gradient_accumulation_steps=2)
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert len(ours) == 1 and "could not be allocated" in ours[0]
    short_layers = moving - 2
    short = short_layers * 128 * HIDDEN * 4
    records = read_history(callback.history_path)
    assert [r["offloaded"] for r in records] == [[LAYERS, LAYERS - short_layers]] * 3
    assert [r["reasons"] for r in records] == [["mode_on", "host_short"]] * 3
    assert [r["short_bytes"] for r in records] == [short] * 3
    assert [r["bytes_moved"] for r in records] == [moving * 64 * HIDDEN * 4 + 2 * 128 * HIDDEN * 4] * 3
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["autooffload/active"] for h in logged] == [(LAYERS - short_layers) / LAYERS] * 3
    assert [h["autooffload/short_bytes"] for h in logged] == [short] * 3
    assert f"{3 * short / 2**20:.1f} MiB stayed on the device" in callback.controller.summary()


# ---- pinning ahead of the forward ----------------------------------------------------------------------------

GPU = torch.device("cuda", 0)  # a key only: the stand-ins pin nothing


class Gated(Pinning):
    """Pinning whose registrations record their thread and wait, each, for the test to let them through."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []
        self.gates: list[threading.Event] = [threading.Event() for _ in range(8)]

    def register(self, buffer: torch.Tensor) -> None:
        index = len(self.threads)
        self.threads.append(threading.get_ident())
        assert self.gates[index].wait(timeout=30)
        super().register(buffer)


def test_the_buffers_a_micro_batch_will_need_are_pinned_ahead_on_threads_and_each_request_waits_for_its_own():
    pinning = Gated()
    host = pinning.host(budget_bytes=10 * PAGE, prepare_threads=1)
    host.set_budget("auto", [GPU])
    pinning.gates[0].set()
    held = host.take(2 * PAGE, GPU)  # an earlier micro-batch's buffer, pinned in its step, free again below
    host.give(held)
    # The next micro-batch asks for 2, 2 and 3 pages: the free buffer serves the first, two are prepared ahead.
    host.expect([2 * PAGE, 2 * PAGE, 3 * PAGE])
    assert host.take(2 * PAGE, GPU) is held
    pinning.gates[1].set()  # the second buffer's registration may finish; the third's may not yet
    second = host.take(2 * PAGE, GPU)
    assert second.pinned and second.nbytes == 2 * PAGE and host._preparing == [3 * PAGE]
    pinning.gates[2].set()
    third = host.take(3 * PAGE, GPU)
    assert third.pinned and host.allocations == 3 and host.held_bytes == 7 * PAGE
    assert threading.get_ident() == pinning.threads[0] and threading.get_ident() not in pinning.threads[1:]
    assert host.registrations == 3


def test_pinning_ahead_stays_within_the_budget_and_what_the_host_has_free():
    pinning = Pinning()
    host = pinning.host(budget_bytes=5 * PAGE, prepare_threads=2)
    host.set_budget("auto", [GPU])
    host.expect([2 * PAGE, 2 * PAGE, 2 * PAGE])  # the third would pass the budget: take() decides for it
    host.release_all()  # waits for those being prepared
    assert host.allocations == 2 and host.held_bytes == 0 and len(pinning.unpinned) == 2
    tight = Pinning().host(memory=lambda: (PLENTY[1] // 10 + 3 * PAGE, PLENTY[1]), prepare_threads=2)
    tight.set_budget("auto", [GPU])
    tight.expect([2 * PAGE, 2 * PAGE])  # 10% of the host stays free: one of them fits beside it
    tight.release_all()
    assert tight.allocations == 1


def test_a_request_larger_than_any_prepared_buffer_stays_within_the_budget_with_them():
    # The controller's first guess of a layer's input was too small: the buffers prepared for it do not fit the
    # request, which makes its own. Those still being pinned land beside it: the budget holds all of them.
    pinning, main = Pinning(), threading.get_ident()
    go = threading.Event()

    def register(buffer: torch.Tensor) -> None:
        if threading.get_ident() != main:  # the preparing threads' registrations wait; the step's own do not
            assert go.wait(timeout=30)
        Pinning.register(pinning, buffer)

    pinning.register = register  # type: ignore[method-assign]
    host = pinning.host(budget_bytes=6 * PAGE, prepare_threads=2)
    host.set_budget("auto", [GPU])
    host.expect([2 * PAGE, 2 * PAGE])
    threading.Timer(0.1, go.set).start()
    host.take(3 * PAGE, GPU)
    host.release_all()  # once those being prepared have landed
    assert host.peak_held_bytes <= 6 * PAGE


def test_a_model_not_on_one_cuda_device_prepares_nothing():
    for devices in ([CPU], [GPU, torch.device("cuda", 1)], []):
        host = Pinning().host(prepare_threads=2)
        host.set_budget("auto", devices)
        host.expect([2 * PAGE])
        assert host.allocations == 0 and not host._preparing


def test_a_registration_that_fails_ahead_leaves_a_pageable_buffer_and_one_warning():
    host = Pinning(fail_at=1).host(prepare_threads=1)
    host.set_budget("auto", [GPU])
    with pytest.warns(AutoOffloadWarning, match="pageable"):
        host.expect([2 * PAGE])
        buffer = host.take(2 * PAGE, GPU)
    assert not buffer.pinned and host.pinning_failed and host.allocations == 1
    host.expect([3 * PAGE])  # after a failure nothing more is prepared: pinning is off for the run
    assert not host._preparing


def test_a_non_contiguous_input_is_moved_to_a_copy_of_its_own_and_counted():
    """A layer input that is a view with strides of its own (a transposed tensor) cannot go into a flat buffer: it
    goes to a pageable copy, and is counted like any other, so bytes moved still equal the arithmetic."""
    weight = torch.randn(6, 5, requires_grad=True)
    source = torch.randn(6, 4, requires_grad=True)
    layer_input = source.t()
    assert not layer_input.is_contiguous()

    def step(engine: SyncEngine | None) -> list[torch.Tensor]:
        weight.grad = source.grad = None
        with engine.hooks(False, layer_input) if engine else contextlib.nullcontext():
            out = (layer_input @ weight).tanh()  # saves the input, the weight and the tanh's output
        out.pow(2).sum().backward()
        return [weight.grad.clone(), source.grad.clone()]

    stats = OffloadStats()
    engine = SyncEngine(stats, HostMemory(copy_cpu=True, memory=lambda: PLENTY))
    assert all(torch.equal(a, b) for a, b in zip(step(engine), step(None), strict=True))
    assert (stats.total_bytes, stats.tensors, stats.short_bytes) == (layer_input.numel() * 4, 1, 0)


def test_buffers_lent_at_a_give_up_are_released_as_the_backward_returns_them(monkeypatch):
    """Issue 49, 1.5: a custom loop gives up inside a forward (a layer's report raising, its earlier layers' inputs in
    host buffers). ``release_all()`` at the give-up freed only the free buffers; those on loan came back in that
    micro-batch's backward and were pooled, held until the run ended. Now they are released as they come back: nothing
    is held after that backward, and the losses are plain checkpointing's."""
    from autooffload import SimulatedDevice
    from autooffload.guard import ENTRY_POINTS

    point = ENTRY_POINTS["a layer call's report"]
    original = point.method

    def report(controller, position, *args, **kwargs):
        if controller.step == 1 and position == LAYERS - 2:
            raise RuntimeError("injected in a report")
        return original(controller, position, *args, **kwargs)

    monkeypatch.setattr(point, "method", report)
    ids = random_ids(64)

    def run(offload: bool):
        net = model()
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        net.train()
        controller = OffloadController(Settings(mode="on"), probe=SimulatedDevice("1GiB")) if offload else None
        if controller is not None:
            assert controller.attach(net)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        losses, host = [], []
        for _ in range(3):
            loss = net(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if controller is not None:
                host.append((controller.host.lent_bytes, controller.host.held_bytes))
                controller.end_step()
        return losses, host, controller

    plain, _, _ = run(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        losses, host, controller = run(True)
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert len(ours) == 1 and "internal error in a layer call's report (RuntimeError: injected" in ours[0]
    assert controller.failed and losses == plain
    assert host[0][1] >= expected_bytes(64, batch=2)  # the first step offloaded every layer
    assert host[1:] == [(0, 0), (0, 0)]
