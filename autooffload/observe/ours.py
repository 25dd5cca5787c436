"""Observe: the checkpoint functions autooffload made, known by identity.

Whatever sits in a module's checkpoint attribute is read again whenever it changes (a trainer's reinstall, a
test's patch, a framework's wrapper), and one question decides what happens next: is this function one of
autooffload's own? Nothing the object says of itself can answer it. A ``unittest.mock.MagicMock`` answers every
attribute (transformers' own ``check_training_gradient_checkpointing`` patches the checkpoint function with one
that calls autooffload's), and ``functools.wraps`` copies a function's ``__dict__`` onto its wrapper. So every
function autooffload installs is registered here when it is made, and a function is autooffload's only if it is
that very object: the registry holds it weakly, by ``id``, and checks the identity of what it finds.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class Ours:
    """What autooffload knew of the module it made a function for: ``original``, the function found there before
    (what a restore puts back, a framework's wrapper included), and ``kwargs``, torch's checkpoint kwargs of that
    module (``use_reentrant``, ...), which every function made for it passes on."""

    original: Callable[..., Any]
    kwargs: dict[str, Any]


_MADE: dict[int, tuple[weakref.ref, Ours]] = {}


def register(function: F, original: Callable[..., Any], kwargs: dict[str, Any]) -> F:
    """Record ``function`` as autooffload's, made for a module whose function was ``original`` with ``kwargs``."""
    key = id(function)

    def forget(ref: weakref.ref) -> None:
        entry = _MADE.get(key)
        if entry is not None and entry[0] is ref:  # not a newer function that took the same id
            del _MADE[key]

    _MADE[key] = (weakref.ref(function, forget), Ours(original, kwargs))
    return function


def ours(function: Any) -> Ours | None:
    """The record of ``function`` if autooffload made it (this very object), else None."""
    entry = _MADE.get(id(function))
    if entry is None or entry[0]() is not function:
        return None
    return entry[1]
