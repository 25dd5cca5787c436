"""Apply: the keep rung, a checkpointed layer run without checkpointing, and the count of what it keeps.

The keep function sits where the checkpoint function was and calls the layer directly:
``function(*args, **kwargs)``, where ``function`` is what the checkpointed module hands its checkpoint
function (transformers: the layer's forward with its keyword arguments bound; a container model:
``layer.__call__``; torch's ``CheckpointWrapper``: the wrapped module, FSDP2's included). The layer runs once,
under whatever saved-tensor hooks are around it, and its random number use is the forward's own, which is
exactly what checkpointing with ``preserve_rng_state`` replays in its recompute: losses and gradients equal
plain checkpointing's.

The measuring variant does the same under saved-tensor hooks that count what the layer saves for its
backward and pass every tensor through unchanged (to the hooks around it, where there are any): each storage
once, whatever views of it are saved; parameters, buffers and the call's own inputs not at all (they are
alive with or without keep). The count goes to a callback, once per call, with the bytes of the autocast
dtype when the layer ran under autocast (its weights' casts are then part of what it saved). The same count
runs inside plain checkpointing (the measuring plain function), so that a layer's cost is measured before it
is first kept.

Both measuring functions also mark the step for the probe (:class:`Marks`): where the forward reaches the first
layer, where the backward reaches each layer (a hook on the layer's output gradient) and where it leaves the first
one (a hook on its input's gradient). The probe reports the most the device held between two marks: how a step's
peak grows with each kept layer is read off these segments (:mod:`autooffload.decide.growth`).

The backward counter tells the keep planner when a backward ran, so that it knows how many forwards were
alive together (chosen and rejected as two calls before one backward, accumulation by hand): a hook on one
trainable parameter that fires once its gradient is accumulated, once per backward that reaches it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..decide.growth import BELOW, FORWARD, LAYER
from ..guard import StepFaults, in_step, nothing, passes_on
from ..observe.saved import SavedBytesCounter, storage_key, tensors_in

START = in_step("a measured layer call's start")
REPORT = in_step("a measured layer call's report")
BACKWARD = in_step("the backward counter")
MARK = in_step("a measured layer call's marks")
GRADIENT_MARK = in_step("a backward mark")


def keep_function(plain: Callable[..., Any] | None = None, state: Any = None) -> Callable[..., Any]:
    """The keep rung: the layer runs once, without checkpointing. Once the switch that made it is retired (``state``,
    its :class:`~.forward.ForwardState`), a wrapper that is not autooffload's may still call it: then ``plain``
    checkpointing, with the layer's own kwargs."""

    def checkpoint_keep(function, *args, **call_kwargs):
        if plain is not None and state.retired:
            return plain(function, *args, **call_kwargs)
        return function(*args, **call_kwargs)

    return passes_on(checkpoint_keep)


Report = Callable[[int, int], None]


class Marks:
    """The marks one measuring layer call makes: ``mark(label)`` with ``(FORWARD, key)`` as the forward reaches the
    first layer (``position`` 0) and ``(BELOW, key)`` once the backward leaves it, ``(LAYER, key, position)`` as the
    backward reaches the layer; ``key`` names the call's micro-batch. A hook holds only ``mark`` and the label.
    Never traced by dynamo (under torch.compile the measuring function's own frame runs eagerly, and what it calls
    would be compiled: a graph of its own for nothing)."""

    def __init__(
        self, mark: Callable[[tuple], None] | None, key: object, position: int, faults: StepFaults | None = None
    ) -> None:
        self.mark, self.key, self.position = mark, key, position
        self.faults = faults or StepFaults()

    @torch.compiler.disable
    def enter(self, args: tuple) -> None:
        if self.mark is None or self.position != 0:
            return
        self.mark((FORWARD, self.key))
        _on_gradient(args, self.mark, (BELOW, self.key), self.faults)

    @torch.compiler.disable
    def leave(self, output: Any) -> None:
        if self.mark is not None:
            _on_gradient((output,), self.mark, (LAYER, self.key, self.position), self.faults)


def _on_gradient(values: Any, mark: Callable[[tuple], None], label: tuple, faults: StepFaults) -> None:
    """``mark(label)`` when the gradient of the first tensor in ``values`` that needs one is computed (shielded: a
    mark missed leaves the gradient as it is)."""
    tensor = next((t for t in tensors_in(values) if t.requires_grad), None)
    if tensor is not None:
        tensor.register_hook(faults.shield(GRADIENT_MARK, lambda gradient: mark(label), nothing))


def _no_marks() -> Marks:
    return Marks(None, None, 0)


def _marking(marks: Callable[[], Marks], faults: StepFaults) -> tuple[Callable[..., Marks], Callable[..., None]]:
    """The shielded ends of a measured call's marks: ``begin(args)`` returns its :class:`Marks` (none where making
    them failed), ``end(marks, output)``."""

    def begin(args: tuple) -> Marks:
        mark = marks()
        mark.enter(args)
        return mark

    def end(mark: Marks, output: Any) -> None:
        mark.leave(output)

    return (
        torch.compiler.disable(faults.shield(MARK, begin, lambda args: _no_marks())),
        torch.compiler.disable(faults.shield(MARK, end, nothing)),
    )


class _Measure(NamedTuple):
    """A measured call: where its count goes, the storages it does not count, the device its tensors are on."""

    report: Report
    excluded: set[tuple[torch.device, int]]
    device: str


def _measures(
    excluded: Callable[[], set[tuple[torch.device, int]]], reporter: Callable[[], Report], faults: StepFaults
) -> tuple[Callable[..., _Measure | None], Callable[[_Measure, bool], SavedBytesCounter | None], Callable[..., None]]:
    """The shielded steps of a measured call (where one fails, the call runs unmeasured, :mod:`autooffload.guard`):
    ``start(function, args, kwargs)``, in the forward; ``counter(measure, hold)``, where the layer runs (the
    saved-tensor hooks around it then are those the counter hands every tensor on to); ``end(measure, counter)``."""

    def start(function: Any, args: tuple, call_kwargs: dict) -> _Measure:
        report = reporter()
        tensors = list(tensors_in((function, args, call_kwargs)))
        inputs = {key for key in map(storage_key, tensors) if key is not None}
        return _Measure(report, excluded() | inputs, tensors[0].device.type if tensors else "cpu")

    def counter(measure: _Measure, hold: bool) -> SavedBytesCounter:
        return SavedBytesCounter(measure.excluded, hold=hold, faults=faults)

    def end(measure: _Measure, counter: SavedBytesCounter) -> None:
        measure.report(counter.bytes, autocast_bytes(measure.device))

    return (
        torch.compiler.disable(faults.shield(START, start, nothing)),
        torch.compiler.disable(faults.shield(START, counter, nothing)),
        torch.compiler.disable(faults.shield(REPORT, end, nothing)),
    )


def measuring_keep_function(
    excluded: Callable[[], set[tuple[torch.device, int]]],
    reporter: Callable[[], Report],
    plain: Callable[..., Any] | None = None,
    state: Any = None,
    faults: StepFaults | None = None,
    marks: Callable[[], Marks] = _no_marks,
) -> Callable[..., Any]:
    """The keep rung that also counts what the layer saved beyond ``excluded()`` (parameters, buffers) and its
    inputs, and calls ``report(bytes, autocast dtype bytes or 0)`` once the layer's forward has run; ``report`` is
    ``reporter()``'s, asked at the call (it files the count under the micro-batch the call belongs to). It marks the
    step with ``marks()``'s :class:`Marks`. Retired, ``plain`` checkpointing, as :func:`keep_function`."""
    faults = faults or StepFaults()
    start, count, end = _measures(excluded, reporter, faults)
    begin_marks, end_marks = _marking(marks, faults)

    def checkpoint_keep_measured(function, *args, **call_kwargs):
        if plain is not None and state.retired:
            return plain(function, *args, **call_kwargs)
        measure = start(function, args, call_kwargs)
        counter = count(measure, False) if measure is not None else None
        if counter is None:
            return function(*args, **call_kwargs)
        mark = begin_marks(args)
        with counter:
            output = function(*args, **call_kwargs)
        end(measure, counter)
        end_marks(mark, output)
        return output

    return passes_on(checkpoint_keep_measured, START.where, REPORT.where, MARK.where)


def measuring_plain_function(
    plain: Callable[..., Any],
    excluded: Callable[[], set[tuple[torch.device, int]]],
    reporter: Callable[[], Report],
    faults: StepFaults | None = None,
    marks: Callable[[], Marks] = _no_marks,
) -> Callable[..., Any]:
    """Plain checkpointing (``plain``) that also counts what the layer would keep without it, and reports it as
    the measuring keep function does: inside the checkpoint, the layer's first forward with gradients on (the
    forward itself; under reentrant checkpointing, the recompute) runs under a counter that hands every tensor
    on to the checkpoint's own hooks, so what is kept and the gradients are plain checkpointing's. A layer's
    cost is then known before it is ever kept. ``report`` is asked of ``reporter`` at the call, in the forward:
    a reentrant recompute runs in the backward, after later forwards (two forwards before one backward), and its
    count belongs to the forward that called the layer."""
    faults = faults or StepFaults()
    start, count, end = _measures(excluded, reporter, faults)
    begin_marks, end_marks = _marking(marks, faults)

    def checkpoint_plain_measured(function, *args, **call_kwargs):
        measure = start(function, args, call_kwargs)
        if measure is None:
            return plain(function, *args, **call_kwargs)
        mark = begin_marks(args)
        done = []

        def counted(*inner_args, **inner_kwargs):
            if done or not torch.is_grad_enabled():
                return function(*inner_args, **inner_kwargs)
            done.append(True)
            counter = count(measure, True)
            if counter is None:
                return function(*inner_args, **inner_kwargs)
            with counter:
                output = function(*inner_args, **inner_kwargs)
            end(measure, counter)
            return output

        output = plain(counted, *args, **call_kwargs)
        end_marks(mark, output)
        return output

    return passes_on(checkpoint_plain_measured, START.where, REPORT.where, MARK.where)


def autocast_bytes(device_type: str) -> int:
    """The bytes of the autocast dtype in force for ``device_type``; 0 when autocast is off."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return 0
        return torch.get_autocast_dtype(device_type).itemsize
    except (RuntimeError, TypeError, AttributeError):  # a device type autocast does not know
        return 0


def count_backwards(model: torch.nn.Module, on_backward: Callable[[], None], faults: StepFaults | None = None) -> Any:
    """Call ``on_backward()`` once per backward that reaches the model's last trainable parameter (a hook fired
    after its gradient is accumulated, shielded: ``faults``); returns the hook's handle, or None when nothing is
    trainable."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        return None
    counted = (faults or StepFaults()).shield(BACKWARD, lambda parameter: on_backward(), nothing)
    try:
        return trainable[-1].register_post_accumulate_grad_hook(counted)
    except (RuntimeError, AttributeError):  # a parameter kind without the hook
        return None
