"""Observe, without a GPU: a simulated device that counts what a real one would hold during a step.

On a CPU there is no memory reading, so the memory-driven decisions (partial offload ``k of L``, the keep rung)
never happen. :class:`SimulatedDevice` is a :class:`~autooffload.observe.probe.MemoryProbe` that makes them
happen on any machine, for a demo, a test or a dry run: a device of ``total_bytes`` whose memory is torch's CPU
allocator, read at the end of a step as

    parameters + gradients and optimizer state held at the step's start
    + the most the step allocated above that at any moment (``count="peak"``, the default)

The step's peak is the allocator's own (:class:`~autooffload.observe.allocations.AllocationPeak`, from the
step's ``reset()`` to its ``read()``): the forwards' saved activations, and also what a count of saved tensors
misses and a device still has to hold, the backward's recomputed activations, gradients and transient buffers,
the logits and their gradient, the optimizer step's own buffers. Offloaded inputs leave it as they would leave a
GPU: a controller given this probe copies them into host buffers outside torch's allocator
(:attr:`SimulatedDevice.separate_host`). What it still cannot show: a GPU allocator's rounding, caching and
fragmentation, and kernels whose workspaces differ from the CPU's. It is a model of the device, not a
measurement of one: figures from it say "simulated".

``count="saved"`` is the earlier model, kept for comparison: parameters + gradients (all trainable parameters) +
the optimizer state at the step's start + the largest of the step's forwards' activations saved for backward,
counted at the end of the forward by saved-tensor hooks around the model (each storage once, parameters and
buffers not at all; an input autooffload moved to host memory is packed by its own hooks inside these, so it
is not counted). It leaves out the backward's transients, which on the ladder's models are most of the peak.

Optimizer state that exists when the step begins is counted as held; state an optimizer creates in the step
(torch's Adam, at its first ``step()``) is in the step's peak (``peak``) or foreseen by the controller
(``saved``), as a real device's peak would show it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from ..guard import StepFaults, in_step, nothing
from ..settings import parse_host_memory
from ..warn import WarnOnce
from .allocations import AllocationPeak
from .probe import MemoryReading
from .saved import SavedBytesCounter, parameter_storages

COUNT = in_step("the simulated device's count")

COUNTS = ("peak", "saved")


def _size(value: int | str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        try:
            kind, number = parse_host_memory(value)
        except ValueError:
            kind, number = "", 0
        if kind == "bytes":
            return int(number)
    raise ValueError(f"SimulatedDevice size {value!r}: expected a positive number of bytes or a size such as '64MiB'")


class SimulatedDevice:
    """A device of ``total_bytes`` (an int, or a size such as ``"24MiB"``) that counts what a step would hold.

    ``count``: ``"peak"`` (default) the step's peak on torch's CPU allocator, backward included; ``"saved"``: the
    activations saved at the end of the forward (module docs). ``watch_model(model, optimizer)`` starts counting
    (the controller calls it at attach, for a probe that has it); ``reset()`` starts a step; ``read()`` returns
    the step's :class:`MemoryReading`, None before any training forward. ``last`` holds the parts of the last
    reading, in bytes: ``parameters``, ``gradients`` and ``optimizer`` (held at the step's start), and ``step``
    (the peak above them) or ``activations`` (the saved count).
    """

    #: A controller given this probe copies offloaded inputs out of torch's CPU allocator (``peak`` counts it):
    #: on a CPU the device and the host would otherwise be one memory, and offload would free nothing.
    separate_host = True

    def __init__(self, total_bytes: int | str, count: str = "peak") -> None:
        if count not in COUNTS:
            raise ValueError(f"SimulatedDevice count {count!r}: expected one of {', '.join(COUNTS)}")
        self.total_bytes = _size(total_bytes)
        self.count = count
        self.last: dict[str, int] = {}
        self._model: torch.nn.Module | None = None
        self._optimizer: Callable[[], Any] = lambda: None
        self._handles: list[Any] = []
        self._counters: list[SavedBytesCounter | None] = []
        self._excluded: set = set()
        self._held: dict[str, int] = {}
        self._activations: int | None = None
        self._trained = False  # a training forward ran in this step
        self._peak: int | None = None  # the step's peak above what it held at its start, once read
        self._split = (0, 0)  # before a peek: the step's peak so far and what it held then, above its start
        self._read = False  # the step was read: the next forward without reset() starts another
        self._window = AllocationPeak()
        self._early_segments: list[tuple[Any, int]] | None = None  # the segments before a peek
        self.warn = WarnOnce()
        self.faults = StepFaults()  # where its hooks' failures are noted: the run's, once it watches a model

    def watch_model(self, model: torch.nn.Module, optimizer: Any = None) -> None:
        """Count ``model``'s forwards from now on. ``optimizer``: the run's optimizer, or a function that
        returns it (it may exist only later, as under Trainer), whose state is counted at each step's start."""
        self.unwatch_model()
        self._model = model
        self._optimizer = optimizer if _is_getter(optimizer) else lambda: optimizer
        self._handles = []  # each handle as its hook goes on: a failure between the two leaves none unwatched
        self._handles.append(model.register_forward_pre_hook(self.faults.shield(COUNT, self._enter, nothing)))
        exit = self.faults.shield(COUNT, self._exit, nothing)
        self._handles.append(model.register_forward_hook(exit, always_call=True))

    def unwatch_model(self) -> None:
        """Stop counting and let go of the model and the optimizer (the controller calls it at detach): a probe
        kept for the next run must not keep them alive."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        while self._counters:
            counter = self._counters.pop()
            if counter is not None:
                counter.__exit__()
        self._window.close()
        self._model, self._optimizer = None, lambda: None

    def reset(self) -> None:
        """A step begins: what it holds now is counted as held, and its peak starts from here. Garbage is collected
        first: a block from an earlier step freed by the collector inside this one would lower its count."""
        self._window.close()
        self._window.segments = self._early_segments = None
        if self.count == "peak":
            gc.collect()
        self._activations, self._trained, self._peak, self._read, self._split = None, False, None, False, (0, 0)
        self._held = self._held_now()
        if self.count == "peak":
            self._open()

    def _held_now(self) -> dict[str, int]:
        model = self._model
        parameters = list(model.parameters()) if model is not None else []
        return dict(
            parameters=sum(p.numel() * p.element_size() for p in parameters),
            gradients=sum(p.grad.numel() * p.grad.element_size() for p in parameters if p.grad is not None),
            optimizer=_state_bytes(self._optimizer()),
        )

    def _open(self) -> None:
        if not self._window.start():
            self.warn(
                "simulated-peak",
                "SimulatedDevice cannot count a step's peak while another profiler runs in this thread; such steps "
                "count what the forward saved (count='saved'), which leaves out the backward's transients",
            )

    def peek(self) -> MemoryReading | None:
        """The step's reading so far, its peak still counting (``count="peak"``; None otherwise): the allocator's
        window is closed and a new one opened, the step's peak carried across."""
        if self._model is None or not self._trained or not self._window.active:
            return None
        self._peak = self._carried(self._window.stop())
        self._split = (self._peak, self._split[1] + (self._window.last_end or 0))
        self._early_segments = self._window.segments
        if self._window.start():
            self._peak = None
        return MemoryReading(min(sum(self._held.values()) + self._split[0], self.total_bytes), self.total_bytes)

    def _carried(self, peak: int | None) -> int:
        """A window's peak as the step's: above what the step held at its start, across any peek."""
        return max(self._split[0], self._split[1] + (peak or 0))

    def mark(self, label: Any) -> None:
        """Start a segment of the step's count here (:class:`~autooffload.observe.allocations.AllocationPeak`)."""
        self._window.mark(label)

    def segments(self) -> list[tuple[Any, int]] | None:
        """The last read step's segments (label, peak above its start), where it was marked."""
        return self._window.segments if self._window.segments is not None else self._early_segments

    def read(self) -> MemoryReading | None:
        if self._model is None:
            return None
        if self._window.active:
            self._peak = self._carried(self._window.stop())
        self._read = True
        if not self._trained:
            return None
        if self._peak is not None:
            self.last = dict(self._held, step=self._peak)
        else:  # count="saved", or no window could be opened
            trainable = sum(p.numel() * p.element_size() for p in self._model.parameters() if p.requires_grad)
            held = self._held or self._held_now()
            self.last = dict(held, gradients=trainable, activations=self._activations or 0)
        return MemoryReading(min(sum(self.last.values()), self.total_bytes), self.total_bytes)

    @torch.compiler.disable
    def _enter(self, module: torch.nn.Module, args: tuple) -> None:
        if not self._counters and (self._read or not self._held):
            self.reset()  # a forward without reset() first: the step starts here
        counter = None
        if not self._window.active:  # the saved count: asked for, or the fallback
            if not any(self._counters):
                self._excluded = parameter_storages([module])
            counter = SavedBytesCounter(self._excluded)
            counter.__enter__()
        self._counters.append(counter)

    @torch.compiler.disable
    def _exit(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not self._counters:
            return
        counter = self._counters.pop()
        if counter is not None:
            counter.__exit__()
        if torch.is_grad_enabled() and module.training:
            self._trained = True
            if counter is not None:
                self._activations = max(self._activations or 0, counter.bytes)


def _is_getter(optimizer: Any) -> bool:
    return callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer)


def _state_bytes(optimizer: Any) -> int:
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # accelerate's AcceleratedOptimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        return 0
    return sum(
        t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)
    )
