"""The stream engine's protocol, checked against a recording stand-in for streams and events, and its
gradients, checked bit for bit against plain checkpointing on a tiny Qwen3."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from conftest import HIDDEN, LAYERS, model
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from autooffload import AutoOffloadWarning, OffloadController, OffloadStats, Settings
from autooffload.apply.host_memory import HostMemory
from autooffload.apply.stream_engine import StreamEngine
from autooffload.apply.streams import HostPool
from autooffload.apply.switch import CheckpointSwitch
from autooffload.observe.targets import find_targets

BATCH, SEQ = 2, 32


class Recorder:
    """Streams are names, events are numbers; every call is logged in order, and so are the deaths of the
    storages that were copied to the host (polled at every call, so a death is logged before the next call)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.stream = "compute"
        self.event_stream: dict[int, str] = {}
        self.host: set[int] = set()
        self._watched: dict[int, StorageWeakRef] = {}

    def allocate(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.host.add(buffer.data_ptr())
        return buffer

    def _poll(self) -> None:
        for ptr, ref in list(self._watched.items()):
            if ref.expired():
                del self._watched[ptr]
                self.log.append(("freed", ptr))

    def mark(self, *entry) -> None:
        self._poll()
        self.log.append(entry)

    def current(self, device):
        self._poll()
        return self.stream

    def copy_stream(self, device):
        return "copy"

    def record(self, stream) -> int:
        self._poll()
        event = len(self.event_stream)
        self.event_stream[event] = stream
        self.log.append(("record", stream, event))
        return event

    def wait(self, stream, event) -> None:
        self._poll()
        self.log.append(("wait", stream, event))

    @contextlib.contextmanager
    def using(self, stream):
        previous, self.stream = self.stream, stream
        try:
            yield
        finally:
            self.stream = previous

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        self._poll()
        d2h = destination.untyped_storage().data_ptr() in self.host
        if d2h:
            self._watched[source.data_ptr()] = StorageWeakRef(source.untyped_storage())
        self.log.append(("copy", self.stream, "d2h" if d2h else "h2d", destination.data_ptr(), source.data_ptr()))
        destination.copy_(source)

    def empty(self, nbytes: int, device) -> torch.Tensor:
        self._poll()
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.log.append(("alloc", self.stream, tensor.data_ptr()))
        return tensor

    # ---- reading the log ---------------------------------------------------------------------------------

    def index(self, entry: tuple, start: int = 0) -> int:
        return next(i for i in range(start, len(self.log)) if self.log[i] == entry)

    def copies(self, kind: str) -> list[int]:
        return [i for i, e in enumerate(self.log) if e[0] == "copy" and e[2] == kind]

    def waited_after(self, stream: str, recorded_on: str, lo: int, hi: int) -> bool:
        """Did ``stream`` wait, before ``hi``, on an event recorded on ``recorded_on`` after ``lo``?"""
        for i in range(lo, hi):
            entry = self.log[i]
            if (
                entry[:2] == ("wait", stream)
                and self.event_stream[entry[2]] == recorded_on
                and self.index(("record", recorded_on, entry[2])) > lo
            ):
                return True
        return False

    def done_event(self, copy_index: int) -> tuple[int, int]:
        """The event recorded on the copy stream right after a copy: (its index in the log, the event)."""
        i = next(i for i in range(copy_index + 1, len(self.log)) if self.log[i][:2] == ("record", "copy"))
        return i, self.log[i][2]


def recording_engine(stats: OffloadStats | None = None, **host_args) -> tuple[StreamEngine, Recorder]:
    recorder = Recorder()
    host_args.setdefault("memory", lambda: (1 << 40, 1 << 41))
    pool = HostPool(HostMemory(pin=False, allocate=recorder.allocate, **host_args))
    return StreamEngine(stats or OffloadStats(), streams=recorder, pool=pool), recorder


def enable_checkpointing(net: torch.nn.Module) -> torch.nn.Module:
    enable = getattr(net, "activation_checkpointing_enable", None) or net.gradient_checkpointing_enable
    enable()
    net.train()
    return net


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def train_steps(net: torch.nn.Module, steps: int, on_step=None) -> tuple[list[float], list[list[torch.Tensor]]]:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(steps):
        ids = batch(step)
        loss = net(input_ids=ids, labels=ids).loss
        if on_step is not None:
            on_step("backward")
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in net.parameters()])
        optimizer.step()
        optimizer.zero_grad()
        if on_step is not None:
            on_step("step")
    return losses, grads


@pytest.fixture(scope="module")
def plain_run():
    return train_steps(enable_checkpointing(model()), 3)


def assert_identical(run, reference) -> None:
    assert run[0] == reference[0]
    for grads, expected in zip(run[1], reference[1], strict=True):
        assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))


def switch_with(net: torch.nn.Module, engine: StreamEngine) -> CheckpointSwitch:
    targets, _ = find_targets(net)
    switch = CheckpointSwitch(targets, engine.stats, engine)
    switch.apply(len(switch.layers))
    return switch


def layer_bytes() -> int:
    return BATCH * SEQ * HIDDEN * 4


# ---- a tiny Qwen3, through the controller and through the recorder ------------------------------------


def test_stream_engine_trains_bit_identical_to_plain_checkpointing(plain_run):
    net = enable_checkpointing(model())
    controller = OffloadController(Settings(mode="on", engine="stream"), probe=None)
    controller.attach(net)
    moved = []

    def on_step(what):
        if what == "step":
            controller.end_step()
            moved.append(controller.last_step_bytes)

    run = train_steps(net, 3, on_step)
    assert type(controller.switch.engine).__name__ == "StreamEngine"
    assert_identical(run, plain_run)
    assert moved == [(LAYERS - 1) * layer_bytes()] * 3  # the last layer's input stays on the device


def test_engine_setting_selects_the_engine(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_ENGINE", "stream")
    controller = OffloadController(probe=None)
    controller.attach(enable_checkpointing(model()))
    assert isinstance(controller.switch.engine, StreamEngine)
    controller = OffloadController(Settings(), probe=None)
    controller.attach(enable_checkpointing(model()))
    assert type(controller.switch.engine).__name__ == "SyncEngine"


@pytest.fixture(scope="module")
def recorded(plain_run):
    """Three training steps of a tiny Qwen3 under the recording engine, with markers: ("produced", i, ptr) where
    layer i's input was produced, ("input", i, ptr) where layer i starts in the forward, ("recompute", i, ptr)
    where its recompute starts in the backward. Returns the run, the engine, the recorder and per step the log
    indices (forward starts, backward starts, step ends)."""
    net = enable_checkpointing(model())
    engine, recorder = recording_engine()
    switch_with(net, engine)
    inner = net.model
    phase = {"backward": False}

    def produced(index):
        def hook(module, args, out):
            if not phase["backward"]:
                recorder.mark("produced", index, (out[0] if isinstance(out, tuple) else out).data_ptr())

        return hook

    def starts(index):
        def hook(module, args):
            recorder.mark("recompute" if phase["backward"] else "input", index, args[0].data_ptr())

        return hook

    inner.embed_tokens.register_forward_hook(produced(0))
    for index, layer in enumerate(inner.layers):
        layer.register_forward_hook(produced(index + 1))
        layer.input_layernorm.register_forward_pre_hook(starts(index))  # runs in the forward and the recompute
    steps: list[list[int]] = []

    def on_step(what):
        phase["backward"] = what == "backward"
        recorder.mark(what)
        if what == "backward":
            steps.append([steps[-1][2] if steps else 0, len(recorder.log)])
        else:
            steps[-1].append(len(recorder.log))

    run = train_steps(net, 3, on_step)
    return run, engine, recorder, steps


def test_recorded_run_is_bit_identical_and_moves_all_but_the_last_layer(recorded, plain_run):
    run, engine, recorder, _ = recorded
    assert_identical(run, plain_run)
    assert engine.stats.total_bytes == 3 * (LAYERS - 1) * layer_bytes()
    assert len(recorder.copies("d2h")) == len(recorder.copies("h2d")) == 3 * (LAYERS - 1)


def test_every_device_to_host_copy_is_ordered_after_the_work_that_produced_its_tensor(recorded):
    _, _, recorder, _ = recorded
    for c in recorder.copies("d2h"):
        _, stream, _, _, source = recorder.log[c]
        assert stream == "copy"
        produced = max(i for i in range(c) if recorder.log[i][0] == "produced" and recorder.log[i][2] == source)
        assert recorder.waited_after("copy", "compute", produced, c), f"copy at {c} not ordered after {produced}"


def test_every_device_tensor_outlives_its_copy_and_is_freed_in_the_forward(recorded):
    _, _, recorder, steps = recorded
    for forward, backward, _ in steps:
        copies = [c for c in recorder.copies("d2h") if forward <= c < backward]
        assert len(copies) == LAYERS - 1
        for c in copies:
            done_at, done = recorder.done_event(c)
            waited = recorder.index(("wait", "compute", done), done_at)
            freed = recorder.index(("freed", recorder.log[c][4]), c)
            assert waited < freed < backward


def test_every_unpack_waits_on_its_host_to_device_event(recorded):
    _, _, recorder, steps = recorded
    for _, backward, end in steps:
        for m in range(backward, end):
            kind, layer, ptr = (recorder.log[m] + (None, None))[:3]
            if kind != "recompute":
                continue
            h2d = [c for c in recorder.copies("h2d") if backward <= c < m and recorder.log[c][3] == ptr]
            if layer == LAYERS - 1:
                assert h2d == []  # the last layer's input never left the device
                continue
            c = h2d[-1]
            allocated = max(i for i in range(c) if recorder.log[i][0] == "alloc" and recorder.log[i][2] == ptr)
            assert recorder.log[allocated][1] == "compute"
            assert recorder.waited_after("copy", "compute", allocated, c)
            done_at, done = recorder.done_event(c)
            assert recorder.index(("wait", "compute", done), done_at) < m


def test_prefetch_of_the_layer_before_starts_when_a_layer_recompute_starts(recorded):
    _, _, recorder, steps = recorded
    for forward, backward, end in steps:
        host = {}  # host buffer -> the layer whose input went there, which was produced last at that address
        for c in (c for c in recorder.copies("d2h") if forward <= c < backward):
            _, _, _, buffer, source = recorder.log[c]
            host[buffer] = next(e[1] for e in reversed(recorder.log[:c]) if e[0] == "produced" and e[2] == source)
        fetched = {host[recorder.log[c][4]]: c for c in recorder.copies("h2d") if backward <= c < end}
        recompute = {e[1]: i for i, e in enumerate(recorder.log[backward:end], backward) if e[0] == "recompute"}
        assert sorted(fetched) == list(range(LAYERS - 1))
        for layer, c in fetched.items():
            assert recompute.get(layer + 2, backward) < c < recompute[layer + 1]


def test_pinned_pool_is_reused_across_steps(recorded):
    _, engine, recorder, steps = recorded
    assert engine.pool.allocations == LAYERS - 1
    used = [{recorder.log[c][3] for c in recorder.copies("d2h") if forward <= c < end} for forward, _, end in steps]
    assert used[0] == used[1] == used[2] and len(used[0]) == LAYERS - 1


def test_partial_offload_lets_go_of_the_last_offloaded_input_when_the_backward_begins(plain_run):
    net = enable_checkpointing(model())
    engine, recorder = recording_engine()
    switch_with(net, engine).apply(2)
    run = train_steps(net, 3, on_step=recorder.mark)
    assert_identical(run, plain_run)
    for backward in (i for i, e in enumerate(recorder.log) if e == ("backward",)):
        copies = [c for c in recorder.copies("d2h") if c < backward][-2:]
        first_h2d = next(c for c in recorder.copies("h2d") if c > backward)
        for c in copies:
            done_at, done = recorder.done_event(c)
            waited = recorder.index(("wait", "compute", done), done_at)
            assert waited < recorder.index(("freed", recorder.log[c][4]), c) < first_h2d


# ---- the pieces, one at a time ------------------------------------------------------------------------


def run_region(engine: StreamEngine, function, *args):
    with engine.hooks(last=False):
        out = checkpoint(function, *args, use_reentrant=False)
    out.sum().backward()
    return out


def test_size_threshold():
    engine, recorder = recording_engine()
    small = torch.randn(255, requires_grad=True) * 1  # 1020 bytes
    run_region(engine, lambda x: x.sin(), small)
    assert recorder.copies("d2h") == []
    large = torch.randn(256, requires_grad=True) * 1  # 1024 bytes
    run_region(engine, lambda x: x.sin(), large)
    assert len(recorder.copies("d2h")) == 1
    assert engine.stats.total_bytes == 1024


def test_parameters_and_buffers_are_never_offloaded_and_a_leaf_input_that_requires_grad_is():
    module = torch.nn.Linear(64, 64)
    module.register_buffer("scale", torch.full((64, 64), 2.0))
    module.frozen = torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)
    engine, recorder = recording_engine()
    engine = StreamEngine(engine.stats, streams=recorder, pool=engine.pool, modules=[module])
    activation = torch.randn(64, 64, requires_grad=True) * 1
    weight_view = module.weight.t()  # a plain Tensor over a parameter's storage
    run_region(engine, lambda w, f, b, x: (x @ w @ f * b).sin(), weight_view, module.frozen, module.scale, activation)
    assert [recorder.log[c][4] for c in recorder.copies("d2h")] == [activation.data_ptr()]
    assert module.weight.grad is not None
    # What enable_input_require_grads() makes of a frozen embedding's output: a leaf that requires grad,
    # held by nothing but the autograd graph.
    leaf = torch.randn(64, 64).requires_grad_(True)
    run_region(engine, lambda w, x: (x @ w).sin(), module.weight, leaf)
    assert [recorder.log[c][4] for c in recorder.copies("d2h")][1:] == [leaf.data_ptr()]
    assert leaf.grad is not None


def test_a_storage_shared_by_several_saves_is_offloaded_once_and_comes_back_shared():
    engine, recorder = recording_engine()
    base = torch.randn(32, 32, requires_grad=True)
    x = base * 1
    seen = []

    def function(a, b, c):
        seen.append((a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr(), c.untyped_storage().data_ptr()))
        return (a.sin() * b.t().cos() + c.sum()).sum(0)

    run_region(engine, function, x, x.t(), x[3])
    expected = base.grad.clone()
    base.grad = None
    y = base * 1
    function(y, y.t(), y[3]).sum().backward()
    assert len(recorder.copies("d2h")) == 1 and len(recorder.copies("h2d")) == 1
    assert engine.stats.total_bytes == x.untyped_storage().nbytes()
    assert len(set(seen[-2])) == 1  # the recompute got three views of one restored storage
    assert torch.equal(base.grad, expected)


def test_host_short_keeps_tensors_on_the_device_with_one_warning(plain_run):
    net = enable_checkpointing(model())
    engine, recorder = recording_engine(memory=lambda: (2**30, 64 * 2**30))
    switch_with(net, engine)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = train_steps(net, 3)
    ours = [w for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert len(ours) == 1 and "host memory is short" in str(ours[0].message)
    assert_identical(run, plain_run)
    assert recorder.copies("d2h") == [] and engine.stats.total_bytes == 0


class Fixed:
    def __init__(self, layers: int) -> None:
        self.layers = layers

    def decide(self, observation) -> int:
        return self.layers


def two_forwards_then_two_backwards(net: torch.nn.Module, mark=lambda what: None) -> list[torch.Tensor]:
    """Accumulation by hand, chosen and rejected as two calls: both forwards before either backward."""
    mark("forward A")
    a = net(input_ids=batch(0), labels=batch(0)).loss
    mark("forward B")
    b = net(input_ids=batch(1), labels=batch(1)).loss
    mark("backward B")
    b.backward()
    mark("backward A")
    a.backward()
    mark("end")
    return [p.grad.clone() for p in net.parameters()]


def test_each_forward_is_its_own_prefetch_chain():
    reference = two_forwards_then_two_backwards(enable_checkpointing(model()))
    net = enable_checkpointing(model())
    controller = OffloadController(Settings(engine="stream"), probe=None, policy=Fixed(2))
    controller.attach(net)
    engine, recorder = recording_engine()
    controller.switch.engine.streams, controller.switch.engine.pool = recorder, engine.pool
    grads = two_forwards_then_two_backwards(net, recorder.mark)
    assert all(torch.equal(g, e) for g, e in zip(grads, reference, strict=True))
    at = {entry[0]: i for i, entry in enumerate(recorder.log) if len(entry) == 1}
    held_by_a = {recorder.log[c][3] for c in recorder.copies("d2h") if at["forward A"] < c < at["forward B"]}
    fetched = [(c, recorder.log[c][4]) for c in recorder.copies("h2d")]
    assert len(held_by_a) == 2  # layers 0 and 1 of 4 offload
    assert [c for c, source in fetched if source in held_by_a and c < at["backward A"]] == []
    assert {source for c, source in fetched if c > at["backward A"]} == held_by_a
    assert controller.stats.total_bytes == 2 * 2 * layer_bytes()


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.skipif(not hasattr(torch.distributed, "fsdp"), reason="torch built without distributed")
def test_fsdp2_parameters_without_a_plain_storage_do_not_stop_the_stream_engine(one_rank_group):
    from torch.distributed.fsdp import fully_shard

    reference = train_steps(enable_checkpointing(model()), 2)[0]
    net = enable_checkpointing(model())
    for layer in net.model.layers:
        fully_shard(layer)
    fully_shard(net)  # parameters are DTensors now: no storage a data pointer can be read from
    controller = OffloadController(Settings(mode="on", engine="stream"), probe=None)
    assert controller.attach(net)
    losses = train_steps(net, 2, on_step=lambda what: what == "step" and controller.end_step())[0]
    assert losses == pytest.approx(reference, abs=1e-6)
    assert controller.last_step_bytes == (LAYERS - 1) * layer_bytes()
    controller.detach()


def test_a_parameter_block_freed_after_construction_is_not_skipped_when_an_activation_gets_it():
    memory = bytearray(64 * 64 * 4)  # stands in for a block the caching allocator hands out again

    def block() -> torch.Tensor:
        return torch.frombuffer(memory, dtype=torch.float32).view(64, 64)

    module = torch.nn.Linear(64, 64, bias=False)
    module.weight = torch.nn.Parameter(block())
    engine = StreamEngine(OffloadStats(), modules=[module])
    assert not engine.offloadable(module.weight.detach())
    module.to(torch.float64)  # cast after attach: the parameter lives elsewhere, its old block is free
    activation = block()
    assert activation.untyped_storage().data_ptr() not in {p.untyped_storage().data_ptr() for p in module.parameters()}
    assert engine.offloadable(activation)
    engine.begin_forward()  # the controller calls it before every training forward
    assert not engine.offloadable(module.weight.detach())
