"""Lifecycle: which model a controller controls, and which model and run its state belongs to.

A controller's state outlives the run that made it (the object lives on in the callback, a checkpoint holds
it), so three rules keep one run's state out of another:

- A model has at most one controller. Attaching one retires the controller already on the model (its hook
  removed, the checkpoint functions it found put back): one a ``train()`` that raised left behind, or one of
  an earlier callback. Two controllers on one model would each rebuild the other's functions at every forward.
- Measurements belong to a model. The state carries the :func:`model_identity` of the model they were taken
  on; restoring them into, or attaching the controller to, a model of another identity drops them (one INFO
  line), since a byte count per layer or a peak per token of one model says nothing of another. The run's
  counters (steps, switches, bytes moved) stay.
- A fresh run starts fresh; a resumed one continues. The Trainer callback tells them apart by what Trainer did
  (:func:`resumed`), not by whether a state exists: a state is always there, its own.

Nothing here imports the controller (it imports this module); the controller is passed in, as an :class:`Owner`.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any, Protocol

import torch

logger = logging.getLogger("transformers.autooffload")

# What a state holds that was measured on (or decided from measurements of) one model.
MEASURED = (
    "level",
    "memory",
    "layer_token_bytes",
    "stack_width",
    "pending_bytes",
    "policy",
    "kept_model",
    "longest_read_tokens",
    "reading_kept_bytes",
    "identity",
)


class Owner(Protocol):
    """What this module needs of a controller: that it can hand its model over to another."""

    def retire(self) -> None: ...


_owners: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


def owner(model: torch.nn.Module) -> Owner | None:
    """The controller attached to ``model``, or None."""
    ref = _owners.get(model)
    return ref() if ref is not None else None


def take_over(model: torch.nn.Module, controller: Owner) -> None:
    """Make ``controller`` the model's one controller: the one attached before it (if another) retires."""
    previous = owner(model)
    if previous is not None and previous is not controller:
        previous.retire()
    _owners[model] = weakref.ref(controller)


def let_go(model: torch.nn.Module | None, controller: Owner) -> None:
    """``controller`` detaches from ``model``: the model has no controller any more."""
    if model is not None and owner(model) is controller:
        del _owners[model]


def model_identity(model: torch.nn.Module, *, layers: int, hidden: int | None, recompute: str) -> dict[str, Any]:
    """What the measurements of ``model`` depend on: its class, the layers controlled, the hidden size, the
    parameters' dtype and count, and the ``recompute`` setting (a kept layer's bytes are measured only under
    ``auto``). JSON-serialisable: it goes into the state a checkpoint saves."""
    floating = next((p for p in model.parameters() if p.is_floating_point()), None)
    return {
        "model": type(model).__name__,
        "layers": layers,
        "hidden": hidden,
        "dtype": str(floating.dtype).removeprefix("torch.") if floating is not None else None,
        "parameters": sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters()),
        "recompute": recompute,
    }


def identity_change(measured_on: dict[str, Any] | None, current: dict[str, Any] | None) -> str | None:
    """How ``current`` differs from the identity the measurements were taken on ("layers 4 -> 2, ..."); None
    when they agree, or when either is unknown (a state saved before identities were recorded)."""
    if not measured_on or not current:
        return None
    changes = [
        f"{key} {measured_on.get(key)} -> {current.get(key)}"
        for key in current
        if key in measured_on and measured_on.get(key) != current.get(key)
    ]
    return ", ".join(changes) or None


def without_measurements(state: dict[str, Any]) -> dict[str, Any]:
    """The state less what was measured on its model: the run's counters only."""
    return {key: value for key, value in state.items() if key not in MEASURED}


def measurements_for(state: dict[str, Any], current: dict[str, Any] | None) -> dict[str, Any]:
    """``state`` as it may be restored on a model of identity ``current``: itself, or, when its measurements were
    taken on a model of another identity, a copy without them (and one INFO line that says what changed)."""
    change = identity_change(state.get("identity"), current)
    if change is None:
        return state
    logger.info(
        "autooffload: the state's measurements were taken on another model (%s); they are dropped and taken "
        "again on this one",
        change,
    )
    return without_measurements(state)


def resumed(trainer_state: Any) -> bool:
    """Whether Trainer resumed from a checkpoint, at ``on_train_begin``: it then runs with the checkpoint's
    ``TrainerState``, at the step the checkpoint was saved (1 or more); otherwise with a new one at step 0,
    whose ``stateful_callbacks`` hold the callbacks' own current state, not a checkpoint's."""
    return int(getattr(trainer_state, "global_step", 0) or 0) > 0


def running_trainer(kind: type) -> Any:
    """The ``kind`` (Trainer) whose event is being dispatched: found up the call stack, since callbacks are not given
    it; None outside one."""
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, kind):
            return candidate
        frame = frame.f_back
    return None
