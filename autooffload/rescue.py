"""Rescue: when a step runs out of device memory, rerun it once with every layer offloaded.

A prediction can be wrong (a length never seen, fragmentation, another process on the GPU). Rather than lose
the run, catch ``torch.OutOfMemoryError``, free what the failed attempt held, offload all layers until the
step ends, and run the step's micro-batches again from the start. If the rerun fails too, the original
error is raised (with a note), so nothing is hidden and a step is retried at most once.

No gradient is counted twice: an error in the backward can strike after some parameters have already
accumulated this micro-batch's gradient, and nothing tells which. So the rerun starts from cleared gradients
(``zero_grad(set_to_none=True)``) and replays every micro-batch of the step that had run, with the random
number state of the step's start restored: the gradients it produces are the ones a run without the error
produces (bit for bit where the kernels are deterministic, as on a CPU). The losses already returned for
the earlier micro-batches stand; only the failed one's loss comes from the rerun.

What is freed: the failed attempt's activations and graph are held by the frames of the error's traceback,
not only in their locals but in the cells of closures those frames run (``nn.Module`` calls its hooks
through one that holds the call's arguments), so clearing the frames is not enough: the traceback itself
is dropped, kept as text in case the error is raised after all; then ``gc`` and the CUDA cache.

Not rescued (the error is raised as it is): an error outside the forward and backward (the optimizer
step); runs with more than one process, where the other ranks wait in a collective for this one; mode
``off``, which forbids offload; ``AUTOOFFLOAD_RESCUE=0``. And, with one warning when :func:`attach` runs
(:func:`rescue_refusal`), Trainers where a rerun is not safe:

- DeepSpeed: Trainer's model is the engine, whose ``zero_grad`` takes no ``set_to_none``, whose backward
  (through accelerate) steps the optimizer on the last micro-batch, and whose ZeRO-1/2 keeps accumulated
  gradients outside ``param.grad``: clearing them and replaying cannot be done from outside.
- FSDP (accelerate's plugin, or a model wrapped in ``FullyShardedDataParallel`` / ``fully_shard``): the
  step's reduce-scatters are collectives, and sharded gradients live outside what ``zero_grad`` can
  check from one rank.
- A Trainer subclass that overrides ``_prepare_inputs`` (TRL's GRPO, RLOO, distillation). Trainer calls
  ``_prepare_inputs`` inside ``training_step`` (4.52 and 5.23); the rescue replays ``training_step`` with the
  same ``inputs`` objects, which gives the same micro-batch with Trainer's own ``_prepare_inputs`` (it only
  moves tensors to the device). GRPO's returns an entry of a buffer indexed by a call counter that its
  ``training_step`` advances, and may regenerate completions: a replay would train on other micro-batches.

Two ways in:

- Trainer (a callback cannot catch an exception): ``autooffload.attach(trainer)`` adds the callback and wraps
  ``trainer.training_step`` on the instance (:func:`with_rescue`).
- A custom loop: put a whole step's forwards and backwards in a function and run it through
  :meth:`Rescue.run`; gradients must be clear when the step starts (the usual ``zero_grad`` after
  ``optimizer.step``), and the function must be able to run twice (iterate over a list, not a consumed
  iterator)::

      rescue = Rescue(controller, model)
      for batches in loader:
          rescue.run(lambda: [(model(**b).loss / len(batches)).backward() for b in batches])
          optimizer.step()
          optimizer.zero_grad()
          controller.end_step()
"""

from __future__ import annotations

import functools
import gc
import re
import traceback
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .controller import OffloadController
from .guard import in_step, passes_on

STEP_START = in_step("the rescue's step start")

Result = TypeVar("Result")
MAX_LINKS = 8  # wrappers followed down to one of autooffload's
_RESCUING: weakref.WeakSet[Any] = weakref.WeakSet()  # the training steps with_rescue made
_CLEANING_UP: weakref.WeakSet[Any] = weakref.WeakSet()  # the trains clean_up_when_train_raises made


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


_TRIED = re.compile(r"Tried to allocate ([0-9.]+) ?(bytes|B|KiB|MiB|GiB|TiB)")
_UNITS = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def tried_bytes(error: BaseException) -> int | None:
    """The size of the allocation that failed, from the message ("Tried to allocate 2.00 GiB"); None if absent."""
    match = _TRIED.search(str(error))
    return round(float(match.group(1)) * _UNITS[match.group(2)]) if match else None


def _distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _note(error: BaseException, text: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(text)


class Rescue:
    """Runs a step, and once more with every layer offloaded if it ran out of device memory.

    ``controller``: the attached :class:`~autooffload.controller.OffloadController` (or a function returning
    the current one); ``model``: the module whose gradients the step accumulates.
    """

    def __init__(self, controller: OffloadController | Callable[[], OffloadController], model: torch.nn.Module) -> None:
        self._controller = controller
        self.model = model

    @property
    def controller(self) -> OffloadController:
        return self._controller() if callable(self._controller) else self._controller

    def run(self, step: Callable[[], Result]) -> Result:
        """``step()``, rerun once after an out-of-memory error; the original error if the rerun fails too."""
        rng = _rng_state()
        try:
            return step()
        except torch.OutOfMemoryError as error:
            failed = error
        return self.retry(failed, rng, step)

    def retry(self, error: torch.OutOfMemoryError, rng: Any, again: Callable[[], Result]) -> Result:
        """After ``error``: free, offload every layer, restore ``rng`` and return ``again()``; or raise ``error``."""
        controller = self.controller
        if not controller.settings.rescue:
            raise error
        if _distributed():
            _note(error, "autooffload: no rescue with more than one process (the other ranks wait in a collective)")
            raise error
        gave_up = controller.failed
        if not controller.rescue(tried_bytes(error)) and (gave_up or not controller.failed):
            raise error  # nothing to gain; but a rescue that failed itself still reruns, on plain checkpointing
        origin = "".join(traceback.format_tb(error.__traceback__))
        error.__traceback__ = None
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        _set_rng_state(rng)
        try:
            return again()
        except torch.OutOfMemoryError as second:
            _note(error, f"autooffload: the rerun with every layer offloaded ran out of memory too: {second}")
        _note(error, f"autooffload: first raised here (traceback dropped to free the failed step's memory):\n{origin}")
        raise error


_ENGINE_TYPES = ("DeepSpeedEngine", "FullyShardedDataParallel", "FSDPModule")


def rescue_refusal(trainer: Any, model: torch.nn.Module | None = None) -> str | None:
    """Why rerunning a step of ``trainer`` (training ``model``) is not safe, or None when it is."""
    accelerator = getattr(trainer, "accelerator", None)
    kind = str(getattr(getattr(accelerator, "distributed_type", None), "value", "")).upper()
    if getattr(trainer, "is_deepspeed_enabled", False) or kind == "DEEPSPEED":
        return (
            "under DeepSpeed the model is the engine: its backward steps the optimizer on the last micro-batch "
            "and ZeRO keeps accumulated gradients outside param.grad, so a failed step cannot be rerun"
        )
    engines = {
        cls.__name__ for module in (model, getattr(trainer, "model_wrapped", None)) for cls in type(module).__mro__
    }
    if getattr(trainer, "is_fsdp_enabled", False) or kind == "FSDP" or engines & set(_ENGINE_TYPES):
        return "under FSDP or DeepSpeed engines the step's gradients are sharded and reduced in collectives"
    prepare = getattr(type(trainer), "_prepare_inputs", None)
    base = _trainer_prepare_inputs()
    if base is not None and prepare is not None and prepare is not base:
        return (
            f"{type(trainer).__name__} overrides _prepare_inputs (as TRL's GRPO does, with a buffer indexed by a "
            "call counter), so rerunning training_step could train on other micro-batches"
        )
    return None


def _trainer_prepare_inputs() -> Any:
    try:
        from transformers import Trainer
    except ImportError:
        return None
    return Trainer._prepare_inputs


def with_rescue(trainer: Any, controller: OffloadController | Callable[[], OffloadController]) -> None:
    """Wrap ``trainer.training_step`` (one micro-batch) on the instance with the rescue.

    The wrapper remembers the micro-batches of the current optimizer step (Trainer holds them for the whole
    step anyway); after an out-of-memory error in one of them it replays the earlier ones and the failed one.
    Wrapping twice does nothing. Where a model wrapped in a DeepSpeed or FSDP engine turns up only at the
    first call (:func:`rescue_refusal`), the error is raised as it is, with that reason as a note.
    """
    inner = trainer.training_step
    if made_here(inner, _RESCUING):
        return
    earlier: list[tuple[Any, tuple, dict]] = []
    current: dict[str, Any] = {"state": None, "step": None, "rng": None}

    def remember() -> None:
        state = trainer.state  # a new object for every train() call, so a new run never replays an old step
        if current["state"] is not state or current["step"] != state.global_step:
            current.update(state=state, step=state.global_step, rng=_rng_state())
            earlier.clear()

    def forget() -> None:
        """Remembering failed: this step cannot be replayed, and an out-of-memory error in it goes on as it is."""
        current.update(state=None, step=None, rng=None)
        earlier.clear()

    def training_step(model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        owner = controller() if callable(controller) else controller
        owner.faults.shield(STEP_START, remember, forget)()
        try:
            loss = inner(model, inputs, *args, **kwargs)
        except torch.OutOfMemoryError as error:
            failed = error
        else:
            earlier.append((inputs, args, kwargs))
            return loss

        refusal = rescue_refusal(trainer, model) if current["state"] is not None else "this step was not remembered"
        if refusal is not None:
            _note(failed, f"autooffload: no rescue: {refusal}")
            raise failed

        def replay() -> torch.Tensor:
            for batch, batch_args, batch_kwargs in earlier:
                inner(model, batch, *batch_args, **batch_kwargs)
            return inner(model, inputs, *args, **kwargs)

        loss = Rescue(controller, model).retry(failed, current["rng"], replay)
        earlier.append((inputs, args, kwargs))
        return loss

    training_step.__wrapped__ = inner  # type: ignore[attr-defined]
    passes_on(training_step, STEP_START.where, "rescue")
    _RESCUING.add(training_step)
    trainer.training_step = training_step


def clean_up_when_train_raises(trainer: Any, callback: Callable[[], Any]) -> None:
    """Wrap ``trainer.train`` on the instance: Trainer calls no ``on_train_end`` when ``train()`` raises, so the
    wrapper writes the history and detaches the controller (no hook left on the model) before the error goes on.
    No end-of-training collective: the other ranks may not get there. Wrapping twice does nothing."""
    train = trainer.train
    if made_here(train, _CLEANING_UP):
        return

    @functools.wraps(train)
    def train_with_clean_up(*args: Any, **kwargs: Any) -> Any:
        try:
            return train(*args, **kwargs)
        except BaseException:
            callback().abandon()
            raise

    passes_on(train_with_clean_up, "the clean-up after train() raised (each of its parts warns where it fails)")
    _CLEANING_UP.add(train_with_clean_up)
    trainer.train = train_with_clean_up


def rescuing(trainer: Any) -> bool:
    """Does ``trainer.training_step`` run through the rescue (:func:`with_rescue`)?"""
    return made_here(trainer.training_step, _RESCUING)


def made_here(function: Any, made: weakref.WeakSet[Any]) -> bool:
    """Is ``function`` one of ``made`` (autooffload's wrappers of a Trainer's methods), or a wrapper around one
    (``__wrapped__``, link after link)? By identity, never by an attribute: a ``MagicMock`` answers every one."""
    for _ in range(MAX_LINKS):
        if function is None:
            return False
        if function in made:
            return True
        function = getattr(function, "__wrapped__", None)
    return False
