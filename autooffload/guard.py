"""Never break training: the one place where a failure inside autooffload becomes a warning.

autooffload runs inside someone's training loop, and nothing it does is worth that run: not a config it cannot
read, not a bookkeeping bug, not a model it has never seen. Its entry points, the few places where training
code calls into it (``attach``, the pre-forward hook, ``begin_step``/``end_step``, the Trainer callback's
events), are decorated with :func:`guarded`. An exception escaping one of them gives one
:class:`~autooffload.warn.AutoOffloadWarning` naming where and what, the controller falls back to plain
checkpointing (:meth:`Guarded.give_up`: the hook removed, transformers-equivalent checkpoint functions
installed), and every later entry returns at once: plain checkpointing for the rest of the run.

Everything below the entry points may raise freely; inner ``try``/``except`` is for failures that have a
better fallback than giving up (a probe that stops reading, a user's policy that raises).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Guarded(Protocol):
    """What :func:`guarded` needs of the controller: whether it gave up, and how to give up."""

    failed: bool

    def give_up(self, where: str, error: BaseException) -> None: ...


def guarded(where: str, default: Any = None, *, retry: bool = False) -> Callable[[F], F]:
    """Decorate an entry point of a controller (or of an object with a ``controller``): an ``Exception`` it
    raises becomes ``controller.give_up(where, error)`` and the call returns ``default``; once given up,
    later calls return ``default`` without running, except ``retry`` entries (``attach``: a new run may try
    again)."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def entry(owner: Any, *args: Any, **kwargs: Any) -> Any:
            controller: Guarded = getattr(owner, "controller", owner)
            if controller.failed and not retry:
                return default
            try:
                return method(owner, *args, **kwargs)
            except Exception as error:
                if _out_of_memory(error):
                    raise  # the rescue (autooffload.rescue) reruns the step; giving up would hide it
                controller.give_up(where, error)
                return default

        return entry  # type: ignore[return-value]

    return decorate


def _out_of_memory(error: BaseException) -> bool:
    """A device out-of-memory error is the training step's, not autooffload's: it propagates as it is."""
    import torch

    return isinstance(error, torch.OutOfMemoryError)
