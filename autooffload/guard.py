"""Never break training: the one place where a failure inside autooffload becomes a warning.

autooffload runs inside someone's training loop, and nothing it does is worth that run: not a config it cannot
read, not a bookkeeping bug, not a model it has never seen. Its entry points, the few places where training
code calls into it (``attach``, the pre-forward hook, ``begin_step``/``end_step``, the Trainer callback's
events, a save and a load of its state), are decorated with :func:`guarded`. An exception escaping one of them
gives one :class:`~autooffload.warn.AutoOffloadWarning` naming where and what, the controller falls back to plain
checkpointing (:meth:`Guarded.give_up`: the hook removed, transformers-equivalent checkpoint functions
installed; under torch.distributed every rank from the same micro-batch on, :mod:`autooffload.fallback`), and
every later entry returns at once until the run ends: plain checkpointing for the rest of the run.

Two kinds of error are the training step's, not autooffload's, and go on as they are: a device out-of-memory
error (the rescue reruns the step) and an accelerator error (a device-side assert or an illegal address from
any kernel, the user's included, that surfaced at a call of autooffload's: the device is unusable, and saying
"autooffload failed" would hide the real error until a step later).

Every entry point is registered in :data:`ENTRY_POINTS` under its ``where``, so that the fault matrix
(``benchmarks/faults.py``) injects a failure into each one, a new entry point included, without a list of its own.

Code of autooffload's that torch calls inside a training step (a saved tensor's pack and unpack hooks, a checkpoint
function's per-call bookkeeping, a backward hook, a host buffer's finalizer) cannot give up where it runs, in the
middle of autograd, and must not raise into the step. Each such place is registered in :data:`IN_STEP` and runs
shielded (:meth:`StepFaults.shield`): where it raises, the step goes on as plain checkpointing would run it (its
``fallback`` keeps the tensor where plain checkpointing keeps it) and the first failure waits in the run's
:class:`StepFaults`; the next entry point gives up with it, before its own body, as if it had failed there (one
warning naming the place; under torch.distributed every rank follows, :mod:`autooffload.fallback`).

Every callable the one or the other returns carries its name in :data:`SHIELD` (``__autooffload_shield__``), which
``functools.wraps`` copies onto a wrapper (``torch.compiler.disable``'s): a test collects every callable of
autooffload's that torch, transformers, accelerate or Lightning hold (hooks, saved-tensor hooks, checkpoint
functions, the Trainer's wrapped ``log``, callback methods, optimizer hooks, finalizers) and fails on one without it
(``tests/test_shield_enumeration.py``). One kind is neither: a callable that runs the user's code, whose errors are
the step's, cannot run shielded as a whole (a checkpoint function runs the layer; the rescue's wrapper of Trainer's
``training_step``, the step). Its own work runs in shielded places or entry points, and :func:`passes_on` marks it
with their names.

Everything below the entry points and the shielded places may raise freely; inner ``try``/``except`` is for
failures that have a better fallback than giving up (a probe that stops reading, a user's policy that raises).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")

# The attribute that names, on a callable handed to torch or a trainer, the entry point or in-step place it runs as.
SHIELD = "__autooffload_shield__"


@dataclasses.dataclass(eq=False)
class InStep:
    """A place where autooffload's code runs inside a training step, called by torch: ``where`` it is (the warning
    names it); ``fault``: what a test sets to make it raise there (None: nothing)."""

    where: str
    fault: Callable[[], None] | None = None
    quiet: bool = False  # noted where no run gives up with it (the run is over): its failure says nothing


IN_STEP: dict[str, InStep] = {}


def in_step(where: str, quiet: bool = False) -> InStep:
    """Register the place ``where`` (once, as its module is imported); ``quiet``: see :class:`InStep`."""
    if where in IN_STEP:
        raise ValueError(f"two places inside a step named {where!r}: a warning must say which one failed")
    place = IN_STEP[where] = InStep(where, quiet=quiet)
    return place


class StepFaults:
    """A run's failures inside its training steps (see the module docstring): the first one, until the next entry
    point takes it (:func:`guarded`) and gives up with it."""

    def __init__(self) -> None:
        self.first: tuple[str, Exception] | None = None

    def shield(self, place: InStep, function: Callable[..., R], fallback: Callable[..., R]) -> Callable[..., R]:
        """``function``, run so that an exception of autooffload's (not the step's: :func:`training_error`) is noted
        and answered by ``fallback``, called with the same arguments. Cheap where nothing fails: one call and a
        ``try``. The note drops the traceback, whose frames would hold the step's tensors until the give-up."""

        def shielded(*args: Any) -> R:
            try:
                if place.fault is not None:
                    place.fault()
                return function(*args)
            except Exception as error:
                self.note(place, error)
                return fallback(*args)

        setattr(shielded, SHIELD, place.where)
        return shielded

    def note(self, place: InStep, error: Exception) -> None:
        """``error`` raised at ``place``: kept if it is the first, raised again if it is the step's own."""
        if training_error(error):
            raise error
        if self.first is None:
            self.first = (place.where, error.with_traceback(None))

    def take(self) -> tuple[str, Exception] | None:
        """The failure noted first since the last take (None: none), forgotten here."""
        first, self.first = self.first, None
        return first


def nothing(*args: Any, **kwargs: Any) -> None:
    """The fallback of a place whose work can be left undone (a count, a report, a buffer given back)."""


def shielded_method(
    place: InStep,
    faults: Callable[[Any], StepFaults],
    fallback: Callable[..., Any],
    raises: tuple[type[Exception], ...] = (),
) -> Callable[[F], F]:
    """Decorate a method that Python or torch calls on an object of autooffload's (a finalizer: ``__del__``) to run
    as :meth:`StepFaults.shield` runs a function, its failure noted in ``faults(owner)``, ``fallback(owner, *args,
    **kwargs)`` in its place (a method a trainer calls outside any entry point's reach in the fault matrix too).
    ``raises``: the caller's errors (a setting autooffload cannot use), which propagate as they are."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def shielded(owner: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                if place.fault is not None:
                    place.fault()
                return method(owner, *args, **kwargs)
            except raises:
                raise
            except Exception as error:
                faults(owner).note(place, error)
                return fallback(owner, *args, **kwargs)

        setattr(shielded, SHIELD, place.where)
        return shielded  # type: ignore[return-value]

    return decorate


def passes_on(function: F, *to: str) -> F:
    """Mark ``function`` as one whose own work is to pass a call on: to code that is not autooffload's (a checkpoint
    function runs the user's layer, whose errors are the step's; a wrapper runs the training step) and to the
    entry points or shielded places named in ``to``, where autooffload's own work runs (the module docstring)."""
    setattr(function, SHIELD, "passes on to " + (", ".join(to) if to else "the caller's code"))
    return function


class Guarded(Protocol):
    """What :func:`guarded` needs of the controller: whether it gave up, how to give up, and its failures inside
    steps."""

    failed: bool
    faults: StepFaults

    def give_up(self, where: str, error: BaseException) -> None: ...


@dataclasses.dataclass
class EntryPoint:
    """One guarded entry point: ``where`` it is (the warning names it) and the ``method`` it runs, undecorated.
    The decorated entry calls ``method`` through this record, so a test can replace it to inject a failure."""

    where: str
    method: Callable[..., Any]
    default: Any
    always: bool


ENTRY_POINTS: dict[str, EntryPoint] = {}


def guarded(where: str, default: Any = None, *, always: bool = False) -> Callable[[F], F]:
    """Decorate an entry point of a controller (or of an object with a ``controller``): an ``Exception`` it
    raises becomes ``controller.give_up(where, error)`` and the call returns ``default``, and so does one a shielded
    place inside the step noted since the last entry (given up before this entry's body); once given up, later
    calls return ``default`` without running, except ``always`` entries, which handle a controller that gave
    up themselves (``attach`` and the end of training: a rank that gave up still owes the other ranks the
    collectives they make there)."""

    def decorate(method: F) -> F:
        known = ENTRY_POINTS.get(where)
        if known is not None and known.method.__qualname__ != method.__qualname__:
            raise ValueError(f"two entry points named {where!r}: a warning must say which one failed")
        point = ENTRY_POINTS[where] = EntryPoint(where, method, default, always)

        @functools.wraps(method)
        def entry(owner: Any, *args: Any, **kwargs: Any) -> Any:
            try:  # the give-up with a failure inside the step too: where it fails, this entry gives up with that
                controller: Guarded = getattr(owner, "controller", owner)
                failure = controller.faults.take() if controller.faults.first is not None else None
                if failure is not None and not controller.failed:
                    controller.give_up(*failure)  # a failure inside the step: given up at this entry, before its body
                if controller.failed and not always:
                    return default
                return point.method(owner, *args, **kwargs)
            except Exception as error:
                if training_error(error):
                    raise  # the rescue (autooffload.rescue) reruns an OOM step; a broken device stops the run
                getattr(owner, "controller", owner).give_up(where, error)
                return default

        setattr(entry, SHIELD, where)
        return entry  # type: ignore[return-value]

    return decorate


class ModifiedInPlace(RuntimeError):
    """A tensor a checkpointed layer saved was modified in place before the backward used it: the training step's
    error, which plain checkpointing raises too (autograd checks a saved tensor's version; under saved-tensor hooks
    it does not, so autooffload's hooks check it themselves)."""

    def __init__(self, shape: Any, version: int, expected: int) -> None:
        super().__init__(
            "one of the variables needed for gradient computation has been modified by an inplace operation: a "
            f"tensor of shape {list(shape)} saved for a checkpointed layer is at version {version}; expected version "
            f"{expected} instead (plain checkpointing raises this too)"
        )


def training_error(error: BaseException) -> bool:
    """An error of the training step, not of autooffload, which propagates as it is: a device out-of-memory
    error, an accelerator error (``torch.AcceleratorError``, torch 2.8+; before it, a ``RuntimeError`` whose
    message starts with ``CUDA error``), or a saved tensor modified in place (:class:`ModifiedInPlace`). An
    out-of-memory error is known by its type, which torch gives every failed device allocation, never by its text: a
    plain ``RuntimeError`` saying "CUDA out of memory" is autooffload's (the rescue, which catches the type, could
    not rerun the step; as autooffload's, the step goes on as plain checkpointing's)."""
    import torch

    if isinstance(error, (torch.OutOfMemoryError, ModifiedInPlace)):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and str(error).startswith("CUDA error")
