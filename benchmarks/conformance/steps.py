"""One training step of a model, plain, with autooffload ``mode="on"`` or at a fixed partial level
(:func:`train_step`), and the comparison of two steps (:func:`_same`)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
import warnings
from typing import Any

from .calls import CheckpointCalls


class FixedLevel:
    """A policy that asks for ``level`` layers on every micro-batch: the sweep's partial level."""

    def __init__(self, level: int) -> None:
        self.level = level

    def decide(self, observation: Any) -> int:
        return self.level


@dataclasses.dataclass
class StepResult:
    loss: Any = None
    grads: dict[str, Any] = dataclasses.field(default_factory=dict)
    calls: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    per_module: dict[int, int] = dataclasses.field(default_factory=dict)
    extras: int = 0  # of the bytes of ``calls``, second activations of a layer's own
    layers: int | None = None
    moved: int | None = None
    arithmetic: float | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    logs: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    first_guess: int | None = None  # the first decision's bytes for every planned layer (the config's widths)
    predicted: int | None = None  # the same, decided again for the same batch once the layer calls were seen
    moved_again: int | None = None
    offloaded: list[Any] = dataclasses.field(default_factory=list)  # the modules the partial level offloaded


def _predicted(controller: Any) -> int | None:
    """What the running micro-batch's decision sized the planned layers that ran at, before the forward ran them
    (a layer that LayerDrop skipped in this forward is left out: no decision can know it in advance)."""
    sizes, switch = controller.sizes.planned_layer_bytes, controller.switch
    if sizes is None or switch is None:
        return None
    return sum(size for size, calls in zip(sizes, switch.forward.counts, strict=True) if calls)


def _slot_module(slot: Any) -> Any:
    """The module a planned layer position runs: the target itself, or a container's block ``index``."""
    target = slot.target
    if target.kind != "container":
        return target.module
    prefix = target.name + "." if target.name else ""
    try:
        return target.module.get_submodule(target.stack[len(prefix) :])[slot.index]
    except Exception:  # a container laid out otherwise
        return None


class _Logs(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def train_step(model: Any, batch: dict[str, Any], mode: str, level: int | None = None) -> StepResult:
    """One forward and backward from ``model``'s weights: ``mode`` plain (no autooffload), on, or partial."""
    import numpy
    import torch

    from autooffload import OffloadController, Settings
    from autooffload.apply.host_memory import HostMemory
    from autooffload.warn import AutoOffloadWarning

    result = StepResult()
    handler = _Logs()
    logger = logging.getLogger("transformers.autooffload")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    controller = None
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mode != "plain":
                host = HostMemory(pin=True, register=lambda t: None, unregister=lambda t: None, drain=lambda d: None)
                settings = Settings(mode="on" if mode == "on" else "auto", engine="sync", host_memory="1GiB")
                policy = FixedLevel(level or 0) if mode == "partial" else None
                controller = OffloadController(settings, probe=None, policy=policy, host=host)
                controller.attach(model)
                result.layers = len(controller.switch.layers) if controller.switch is not None else 0
            model.train()
            recorder = CheckpointCalls()
            torch.manual_seed(0)
            random.seed(0)
            numpy.random.seed(0)  # BigBird's random attention blocks draw from numpy
            with recorder.watching():  # the forward's calls: a recompute's nested calls in the backward are not
                output = model(**batch)  # new layers (Zamba's hybrid layers checkpoint their Mamba layer inside)
                loss = output.loss if getattr(output, "loss", None) is not None else output[0].float().mean()
            loss.backward()
            result.loss = loss.detach().clone()
            result.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            if controller is not None:
                switch = controller.switch
                result.arithmetic = controller.planned_bytes()  # what the layer calls reported they took
                result.first_guess = _predicted(controller)
                if switch is not None:
                    result.offloaded = [_slot_module(switch.layers[p]) for p in switch.order[: switch.offloaded]]
                controller.end_step()
                record = controller.history[-1] if controller.history else None
                result.moved = record.bytes_moved if record is not None else controller.last_step_bytes
                if mode == "on":  # the same batch again: what the decision predicts now, before the forward
                    torch.manual_seed(0)
                    output = model(**batch)
                    (output.loss if getattr(output, "loss", None) is not None else output[0].float().mean()).backward()
                    result.predicted = _predicted(controller)
                    controller.end_step()
                    result.moved_again = controller.history[-1].bytes_moved if controller.history else None
                controller.detach()
        result.calls, result.per_module, result.extras = recorder.calls, recorder.per_module, recorder.extras
        result.warnings = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
        result.logs = [f"{r.levelname}: {r.getMessage()}" for r in handler.records]
        result.warnings += [r.getMessage() for r in handler.records if r.levelno >= logging.WARNING]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        result.seconds = time.perf_counter() - start
    return result


def _same(a: StepResult, b: StepResult) -> str | None:
    import torch

    if not torch.equal(a.loss, b.loss):
        return f"loss {a.loss.item()!r} != {b.loss.item()!r}"
    if set(a.grads) != set(b.grads):
        return f"gradients of different parameters ({len(a.grads)} vs {len(b.grads)})"
    differ = [n for n in a.grads if not torch.equal(a.grads[n], b.grads[n])]
    return f"{len(differ)} gradient(s) differ, e.g. {differ[0]}" if differ else None


def _subset_sums(sizes: list[int], k: int) -> set[int] | None:
    if len(sizes) > 18:
        return None
    return {sum(c) for c in itertools.combinations(sizes, k)}
