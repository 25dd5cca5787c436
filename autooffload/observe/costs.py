"""Observe: what an optimizer step cost beside its compute, as far as this process can see it.

A step that takes twice its median in one mode and not in another needs a cause, and a step time alone cannot
name one. Per step, :class:`StepCosts` counts what can stall the host between two kernels, whoever caused it:

- ``gc_collections``, ``gc_seconds``, ``gc_collected``: Python's garbage collections that ran in the step (every
  generation; a full collection of a process that holds torch and transformers takes tens to hundreds of
  milliseconds), from ``gc.callbacks``, and the objects they freed (cyclic garbage: something made reference
  cycles);
- ``host_takes``, ``host_allocations``, ``host_registrations``, ``host_releases``, ``pin_seconds``: host buffers
  asked for, newly mapped, pinned (``cudaHostRegister``: 3.1 GB/s on an H200 machine, inside the step that needs
  the buffer) and the time pinning took, and buffers given back to the system
  (:mod:`autooffload.apply.host_memory`);
- ``probe_seconds``: the time spent reading the memory probe (its reset, a peek, the reading);
- ``syncs``: what made the host wait for the device on autooffload's behalf: a device drained before its host
  buffers were unmapped, and copies between the device and a buffer that could not be pinned.

Counted from the manager's and the monitor's own running totals (a difference per step) and, for the collections,
from a callback registered while a controller is attached. Nothing here allocates per micro-batch.
"""

from __future__ import annotations

import gc
import time
from typing import Any

HOST_COUNTERS = ("takes", "allocations", "registrations", "releases", "pin_seconds", "syncs")
FIELDS = (  # a history record's fields of the same names (autooffload.history)
    "gc_collections",
    "gc_seconds",
    "gc_collected",
    "host_takes",
    "host_allocations",
    "host_registrations",
    "host_releases",
    "pin_seconds",
    "probe_seconds",
    "syncs",
)


class GcWatch:
    """Python's garbage collections while started: how many, their time, the objects they freed (running
    totals). One callback in ``gc.callbacks`` from :meth:`start` to :meth:`stop`."""

    def __init__(self) -> None:
        self.collections = 0
        self.seconds = 0.0
        self.collected = 0
        self._began = 0.0
        self._callback = self._on_gc  # one bound method, so that stop() removes what start() added

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        while self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        self.collections += 1
        self.seconds += time.perf_counter() - self._began
        self.collected += int(info.get("collected", 0))


class StepCosts:
    """The per-step costs of the module docstring: :meth:`take` at each step's end returns the step's."""

    def __init__(self) -> None:
        self.gc = GcWatch()
        self._last: dict[str, float] = {}

    def start(self, host: Any, probe_seconds: float) -> None:
        """A controller attached: count from here (``host``: its host memory manager; ``probe_seconds``: the time
        its probe has taken so far)."""
        self.gc.start()
        self._last = self.totals(host, probe_seconds)

    def stop(self) -> None:
        self.gc.stop()

    def totals(self, host: Any, probe_seconds: float) -> dict[str, float]:
        """The running totals, keyed as :data:`FIELDS`."""
        watch = self.gc
        found = {"gc_collections": watch.collections, "gc_seconds": watch.seconds, "gc_collected": watch.collected}
        for name in HOST_COUNTERS:
            found[name if name in ("pin_seconds", "syncs") else f"host_{name}"] = getattr(host, name, 0)
        found["probe_seconds"] = probe_seconds
        return found

    def take(self, host: Any, probe_seconds: float) -> dict[str, float]:
        """What happened since the last take (the step that ends): counts as ints, seconds rounded to 0.1 ms."""
        now = self.totals(host, probe_seconds)
        last, self._last = self._last, now
        step: dict[str, float] = {}
        for name in FIELDS:
            delta = now[name] - last.get(name, 0)
            step[name] = round(delta, 4) if name.endswith("seconds") else int(delta)
        return step
