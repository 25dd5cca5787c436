"""Faults injected: an exception at a guarded entry point or a place inside a step (each counted where the fault-free
run called it), a probe that raises or reads garbage, host buffers that cannot be had, an out-of-memory step."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .config import MOMENT, Fault, InjectedFault


def entry_points() -> dict[str, Any]:
    """Every guarded entry point of autooffload, by the ``where`` its warning names."""
    import autooffload.callback
    import autooffload.rescue  # noqa: F401
    from autooffload.guard import ENTRY_POINTS

    return {  # a framework integration's entry points run under that framework: its own tests fail them
        where: point
        for where, point in ENTRY_POINTS.items()
        if point.method.__module__.startswith("autooffload") and ".integrations." not in point.method.__module__
    }


def places() -> dict[str, Any]:
    """Every place of autooffload's code inside a training step (``autooffload.guard.IN_STEP``), by its name."""
    import autooffload.callback  # (imports every module that registers a place: the controller's, the callback's)
    import autooffload.observe.simulated
    import autooffload.rescue  # noqa: F401
    from autooffload.guard import IN_STEP

    return dict(IN_STEP)


@contextlib.contextmanager
def counting_calls() -> Iterator[dict[str, list[str]]]:
    """The window (:class:`Moment`) of every call of every entry point and place, in order (the guard's skip after
    a give-up is not a call)."""
    calls: dict[str, list[str]] = {}
    points, steps = entry_points(), places()
    originals = {where: point.method for where, point in points.items()}

    def note(where: str) -> None:
        calls.setdefault(where, []).append(MOMENT.window())

    def counted(where: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(owner: Any, *args: Any, **kwargs: Any) -> Any:
            note(where)
            return method(owner, *args, **kwargs)

        return call

    for where, point in points.items():
        point.method = counted(where, originals[where])
    for where, place in steps.items():
        place.fault = functools.partial(note, where)
    try:
        yield calls
    finally:
        for where, point in points.items():
            point.method = originals[where]
        for place in steps.values():
            place.fault = None


@contextlib.contextmanager
def injected(fault: Fault) -> Iterator[dict[str, Any]]:
    """Raise :class:`InjectedFault` at the ``fault.at``-th call of the entry point (before or after its body) or of
    the place inside a step; ``state`` says how often it raised and in which window."""
    state: dict[str, Any] = {"calls": 0, "raised": 0, "windows": []}

    def hit() -> bool:
        state["calls"] += 1
        return state["calls"] == fault.at

    def fire(when: str) -> InjectedFault:
        state["raised"] += 1
        state["windows"].append(MOMENT.window())
        return InjectedFault(f"injected {when} call {fault.at}")

    if fault.kind == "step":
        place = places()[fault.name]

        def raising() -> None:
            if hit():
                raise fire("at")

        place.fault = raising
        try:
            yield state
        finally:
            place.fault = None
        return
    point = entry_points()[fault.name]
    original = point.method

    def failing(owner: Any, *args: Any, **kwargs: Any) -> Any:
        now = hit()
        if now and fault.timing == "before":
            raise fire("at")
        result = original(owner, *args, **kwargs)
        if now:
            raise fire("after")
        return result

    point.method = failing
    try:
        yield state
    finally:
        point.method = original


class FaultyProbe:
    """A simulated device whose second reading (and later ones) is ``fault``: an NVML error, None, a fraction
    above 1, NaN; or whose ``reset()`` raises from the second step on."""

    def __init__(self, device: Any, fault: str) -> None:
        self.device, self.fault, self.reads, self.resets = device, fault, 0, 0

    def watch_model(self, model: Any, optimizer: Any = None) -> None:
        self.device.watch_model(model, optimizer)

    def unwatch_model(self) -> None:
        self.device.unwatch_model()

    def reset(self) -> None:
        self.resets += 1
        if self.fault == "reset-raises" and self.resets >= 2:
            raise RuntimeError("the probe's reset failed")
        self.device.reset()

    def read(self) -> Any:
        from autooffload import MemoryReading

        reading = self.device.read()
        self.reads += 1
        if self.reads < 2 or reading is None or self.fault == "reset-raises":
            return reading
        if self.fault == "nvml-error":
            import pynvml

            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if self.fault == "none":
            return None
        if self.fault == "above-1":
            return MemoryReading(reading.total_bytes + reading.used_bytes, reading.total_bytes)
        return MemoryReading(float("nan"), reading.total_bytes)


def faulty_host(fault: str) -> Any:
    """Host memory that pins (a stand-in for ``cudaHostRegister`` on this CPU, so that the engines copy into
    its buffers) and then fails: allocation from the third buffer on, pinning from the second, or host memory
    that runs short in the middle of the second step."""
    from autooffload.apply.host_memory import HostMemory, pageable

    plenty, calls = (1 << 40, 1 << 41), {"allocate": 0, "register": 0, "memory": 0}

    def allocate(nbytes: int) -> torch.Tensor:
        calls["allocate"] += 1
        if fault == "allocate-fails" and calls["allocate"] >= 3:
            raise MemoryError("mmap failed: cannot allocate memory")
        return pageable(nbytes)

    def register(buffer: torch.Tensor) -> None:
        calls["register"] += 1
        if fault == "pin-fails" and calls["register"] >= 2:
            raise RuntimeError("cudaHostRegister failed with cudaError 2")

    def memory() -> tuple[int, int]:
        calls["memory"] += 1
        return (1 << 30, plenty[1]) if fault == "host-runs-out" and calls["memory"] >= 3 else plenty

    return HostMemory(None, pin=True, allocate=allocate, register=register, unregister=lambda b: None,
                      drain=lambda d: None, memory=memory)  # fmt: skip


class OutOfMemoryOnce:
    """A forward pre-hook on the final norm that raises one out-of-memory error, in the second micro-batch of
    the second step, after every checkpointed layer saved its input: what the rescue reruns."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        if module.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 4:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
