"""Code of autooffload's that runs inside a training step (a saved tensor's pack and unpack hooks, a layer call's
count and setup, a measured call, the backward counter, a host buffer's return, a container's restart) never lets
an exception out into the step: the step goes on as plain checkpointing would run it (losses and gradients bit for
bit), one warning names the place, and the run gives up at the next entry point. Each place is registered
(``autooffload.guard.IN_STEP``), so every one is failed here without a list of its own."""

from __future__ import annotations

import ast
import errno
import warnings
from pathlib import Path

import pytest
import torch
from conftest import model
from test_layers import remote_model
from test_shielded_places import ELSEWHERE

from autooffload import AutoOffloadWarning, OffloadController, ScriptedProbe, Settings
from autooffload.apply.host_memory import HostMemory
from autooffload.apply.offload import OffloadStats
from autooffload.apply.streams import Streams
from autooffload.guard import IN_STEP

PACKAGE = Path(__file__).resolve().parents[1] / "autooffload"
SEQ, STEPS = 48, 3


def pinned_host(**overrides) -> HostMemory:
    """Host memory that pins with no-op register, unregister and drain, so the engines copy on a CPU."""
    no_op = dict(pin=True, register=lambda t: None, unregister=lambda t: None, drain=lambda d: None)
    return HostMemory(**{**no_op, **overrides})


# The runs that reach every place: offload with each engine, keep (recompute="auto" with room, measured), and a
# container model (a model that calls the checkpoint function for each of its layers).
SCENARIOS = {
    "sync": (model, dict(mode="on", engine="sync"), None),
    "stream": (model, dict(mode="on", engine="stream"), None),
    "keep": (model, dict(recompute="auto"), 0.01),
    "container": (remote_model, dict(mode="on"), None),
}


def train(scenario: str, fail_at: str | None = None, host: HostMemory | None = None, plain: bool = False):
    """``STEPS`` steps of the tiny model of ``scenario`` under it (``plain``: plain checkpointing, no autooffload);
    ``fail_at``: a place that raises at its first call. Returns (losses, gradients per step, the controller, its
    warnings, calls of each place)."""
    build, settings, fraction = SCENARIOS[scenario]
    net = build()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    calls: dict[str, int] = {}

    def counting(where: str):
        def fault() -> None:
            calls[where] = calls.get(where, 0) + 1
            if where == fail_at and calls[where] == 1:
                raise RuntimeError(f"injected at {where}")

        return fault

    controller = None
    for where, place in IN_STEP.items():
        place.fault = counting(where)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", AutoOffloadWarning)
            if not plain:
                probe = ScriptedProbe([fraction]) if fraction is not None else None
                controller = OffloadController(
                    Settings(host_memory="1GiB", **settings), probe=probe, host=host or pinned_host()
                )
                assert controller.attach(net)
            losses, grads = [], []
            ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
            for _ in range(STEPS):
                net.zero_grad()
                loss = net(input_ids=ids, labels=ids).loss
                loss.backward()
                losses.append(loss.item())
                grads.append([p.grad.clone() for p in net.parameters()])
                if controller is not None:
                    controller.end_step()
    finally:
        for place in IN_STEP.values():
            place.fault = None
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    return losses, grads, controller, ours, calls


def same(run: tuple, reference: tuple) -> bool:
    return run[0] == reference[0] and all(
        torch.equal(a, b)
        for step, plain in zip(run[1], reference[1], strict=True)
        for a, b in zip(step, plain, strict=True)
    )


@pytest.fixture(scope="module")
def reached() -> dict[str, str]:
    """The first scenario that reaches each place (fault-free runs), and its plain-checkpointing reference."""
    first: dict[str, str] = {}
    for scenario in SCENARIOS:
        _, _, controller, ours, calls = train(scenario)
        assert ours == [] and not controller.failed, (scenario, ours)
        for where in calls:
            first.setdefault(where, scenario)
    return first


def test_every_place_inside_a_step_is_registered_once():
    """Each ``in_step("where")`` in the package names a distinct place, and each is in the registry."""
    names = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "in_step" and node.args:
                names.append(node.args[0].value)
    assert len(names) == len(set(names)), sorted(names)
    assert set(names) == set(IN_STEP)


@pytest.mark.parametrize("where", sorted(set(IN_STEP) - set(ELSEWHERE)))  # those: tests/test_shielded_places.py
def test_a_failure_inside_a_step_leaves_the_step_as_plain_checkpointing_and_gives_up(where, reached):
    assert where in reached, f"no scenario reaches {where!r}: add one"
    scenario = reached[where]
    reference = train(scenario, plain=True)
    run = train(scenario, fail_at=where)
    _, _, controller, ours, calls = run
    assert calls[where] >= 1
    assert same(run, reference), where
    assert len(ours) == 1 and f"internal error in {where} (RuntimeError: injected at {where})" in ours[0], ours
    assert controller.failed and controller.switch is None and controller.hooks is None


def test_a_host_reading_that_fails_once_inside_take_no_longer_escapes_the_forward():
    """Issue 37, item 3: a one-off ``OSError(EMFILE)`` from the host reading inside ``HostMemory.take`` (a new
    buffer is being taken, in the sync engine's pack hook) came out of ``model(...)``. Now that input stays on the
    device, the step is plain checkpointing's, one warning, and the run gives up at the next entry point."""
    reads = []

    def memory() -> tuple[int, int]:
        reads.append(True)
        if len(reads) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return 1 << 40, 1 << 41

    reference = train("sync", plain=True)
    run = train("sync", host=pinned_host(memory=memory))
    _, _, controller, ours, _ = run
    assert len(reads) >= 1
    assert same(run, reference)
    (warning,) = ours
    assert "internal error in the sync engine's pack hook (OSError: [Errno 24] Too many open files)" in warning
    assert controller.failed and controller.switch is None


@pytest.mark.parametrize(("scenario", "owner", "name"), [("sync", OffloadStats, "add"), ("stream", Streams, "copy")])
def test_a_pack_failing_after_its_buffer_was_taken_gives_the_buffer_back(monkeypatch, scenario, owner, name):
    """Issue 49, 1.4: a pack that failed after ``HostMemory.take`` (the sync engine counting the bytes, the stream
    engine's copy) kept its tensor on the device, as it should, but its buffer was owned by nothing: lent for the
    rest of the run, beyond ``release_all()``. Now it goes back: nothing is lent once the run gave up, everything
    held is released, and the steps are plain checkpointing's."""
    original, failed = getattr(owner, name), []

    def failing(*args, **kwargs):
        if not failed:
            failed.append(True)
            raise RuntimeError("injected after take")
        return original(*args, **kwargs)

    reference = train(scenario, plain=True)
    monkeypatch.setattr(owner, name, failing)
    host = pinned_host()
    run = train(scenario, host=host)
    _, _, controller, ours, _ = run
    assert failed and same(run, reference)
    (warning,) = ours
    assert f"internal error in the {scenario} engine's pack hook (RuntimeError: injected after take)" in warning
    assert controller.failed and host.lent_bytes == 0
    host.release_all()
    assert host.held_bytes == 0


def test_only_torchs_out_of_memory_error_is_the_steps_a_message_alone_is_autooffloads():
    """Issue 49, 1.6, decided: inside autooffload's code in a step, the error is the step's (and propagates, for the
    rescue to rerun the step) only as ``torch.OutOfMemoryError``, which torch raises for every device allocation that
    fails. A plain ``RuntimeError`` whose message says "CUDA out of memory" is not matched by its text: the rescue
    could not catch it either (it catches the type), so propagating it would end the run; as autooffload's error it
    leaves the step plain checkpointing's, with one warning, and a real shortage then surfaces as torch's own error."""

    def raising(error: Exception):
        def take(nbytes, device):
            raise error

        return take

    reference = train("sync", plain=True)
    host = pinned_host()
    host.take = raising(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    run = train("sync", host=host)
    _, _, controller, ours, _ = run
    assert same(run, reference) and controller.failed
    (warning,) = ours
    assert "internal error in the sync engine's pack hook (RuntimeError: CUDA out of memory." in warning
    host = pinned_host()
    host.take = raising(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(torch.OutOfMemoryError):
        train("sync", host=host)
