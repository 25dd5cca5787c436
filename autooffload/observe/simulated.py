"""Observe, without a GPU: a simulated device that counts what a real one would hold during a step.

On a CPU there is no memory reading, so the memory-driven decisions (partial offload ``k of L``, the keep rung)
never happen. :class:`SimulatedDevice` is a :class:`~autooffload.observe.probe.MemoryProbe` that makes them
happen on any machine, for a demo, a test or a dry run: a device of ``total_bytes`` whose reading at the end of
a step is

    parameters + gradients (trainable parameters) + optimizer state held at the step's start
    + the largest of the step's forwards: the activations saved for backward, counted at the end of the forward

The activations are counted by saved-tensor hooks around every forward of the watched model, as the
outermost hooks: each storage once, parameters and buffers not at all. A saved input that autooffload moved
to host memory is packed by autooffload's own hooks, inside these, so it is not counted, exactly as it would
not be on the device; a kept layer's activations are, and a checkpointed layer's are not (only its input is).
What it leaves out: the backward's transient buffers, the logits' gradients, an allocator's rounding and
fragmentation. It is a model of the device, not a measurement: figures from it say "simulated".

The optimizer state is counted as held when the step begins, as a real peak of the forward and backward sees
it: torch's Adam creates its state at the first ``step()``, after that peak (the controller foresees it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..settings import parse_host_memory
from .probe import MemoryReading
from .saved import SavedBytesCounter, parameter_storages


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

    ``watch_model(model, optimizer)`` starts counting (the controller calls it at attach, for a probe that has it);
    ``reset()`` starts a step; ``read()`` returns the step's :class:`MemoryReading`, None before any forward.
    ``last`` holds the parts of the last reading (parameters, gradients, optimizer, activations), in bytes.
    """

    def __init__(self, total_bytes: int | str) -> None:
        self.total_bytes = _size(total_bytes)
        self.last: dict[str, int] = {}
        self._model: torch.nn.Module | None = None
        self._optimizer: Callable[[], Any] = lambda: None
        self._handles: list[Any] = []
        self._counters: list[SavedBytesCounter] = []
        self._excluded: set = set()
        self._optimizer_bytes = 0
        self._activations: int | None = None

    def watch_model(self, model: torch.nn.Module, optimizer: Any = None) -> None:
        """Count ``model``'s forwards from now on. ``optimizer``: the run's optimizer, or a function that
        returns it (it may exist only later, as under Trainer), whose state is counted at each step's start."""
        self.unwatch_model()
        self._model = model
        self._optimizer = optimizer if _is_getter(optimizer) else lambda: optimizer
        self._handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._exit, always_call=True),
        ]

    def unwatch_model(self) -> None:
        """Stop counting and let go of the model and the optimizer (the controller calls it at detach): a probe
        kept for the next run must not keep them alive."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        while self._counters:
            self._counters.pop().__exit__()
        self._model, self._optimizer = None, lambda: None

    def reset(self) -> None:
        """A step begins: its activations start from nothing; the optimizer state it holds is what exists now."""
        self._activations = None
        self._optimizer_bytes = _state_bytes(self._optimizer())

    def read(self) -> MemoryReading | None:
        if self._model is None or self._activations is None:
            return None
        parameters = sum(p.numel() * p.element_size() for p in self._model.parameters())
        gradients = sum(p.numel() * p.element_size() for p in self._model.parameters() if p.requires_grad)
        self.last = dict(
            parameters=parameters,
            gradients=gradients,
            optimizer=self._optimizer_bytes,
            activations=self._activations,
        )
        return MemoryReading(min(sum(self.last.values()), self.total_bytes), self.total_bytes)

    @torch.compiler.disable
    def _enter(self, module: torch.nn.Module, args: tuple) -> None:
        if not self._counters:
            self._excluded = parameter_storages([module])
        counter = SavedBytesCounter(self._excluded)
        counter.__enter__()
        self._counters.append(counter)

    @torch.compiler.disable
    def _exit(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not self._counters:
            return
        counter = self._counters.pop()
        counter.__exit__()
        if torch.is_grad_enabled() and module.training:
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
