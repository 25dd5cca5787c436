"""Checkpoint functions that wrap torch's: autooffload steers them through the wrapper, which keeps its behaviour.

A training framework may put a function of its own in front of torch's checkpoint. LLaMA-Factory's
``get_custom_gradient_checkpointing_func`` is one: made with ``functools.wraps`` over
``partial(torch.utils.checkpoint.checkpoint, use_reentrant=...)``, it runs a layer without trainable parameters
directly (no checkpoint) and marks the first floating-point argument (the hidden states) as requiring grad
before it checkpoints the others.

autooffload runs such a wrapper's own code with the function it wraps replaced by one of its own (plain,
offloading or keep): a new function object with the wrapper's code, globals, defaults and attributes, whose
closure cell that held the wrapped function holds autooffload's instead (and ``__wrapped__`` names it, so that
it is followed as the wrapper was). Nothing the wrapper does around the call changes, and nothing of it is
reimplemented here.

A wrapper qualifies when it is a Python function whose ``__wrapped__`` sits in one of its closure cells (what
``functools.wraps`` over a closure variable gives), link after link, down to a checkpoint that switch.py knows.
Any other function is foreign: paths.py names it, and what it wraps, in one warning.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

MAX_LINKS = 8  # a deeper chain of wrappers is taken as foreign rather than followed


def wrapper_chain(function: Any, is_checkpoint: Callable[[Any], bool]) -> tuple[types.FunctionType, ...] | None:
    """The wrappers between ``function`` and the checkpoint it ends at, outermost first; ``()`` when
    ``function`` is itself a checkpoint (``is_checkpoint``), None when it is neither."""
    chain: list[types.FunctionType] = []
    while not is_checkpoint(function):
        if len(chain) == MAX_LINKS or _link(function) is None:
            return None
        chain.append(function)
        function = function.__wrapped__
    return tuple(chain)


def rewrap(chain: Sequence[types.FunctionType], inner: Callable[..., Any]) -> Callable[..., Any]:
    """The wrappers of ``chain`` (from :func:`wrapper_chain`) around ``inner`` instead of what they wrapped."""
    for wrapper in reversed(chain):
        index = _link(wrapper)
        assert index is not None and wrapper.__closure__ is not None
        cells = list(wrapper.__closure__)
        cells[index] = types.CellType(inner)
        rebuilt = types.FunctionType(
            wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, tuple(cells)
        )
        rebuilt.__kwdefaults__ = wrapper.__kwdefaults__
        rebuilt.__qualname__ = wrapper.__qualname__
        rebuilt.__module__ = wrapper.__module__
        rebuilt.__dict__.update(wrapper.__dict__)
        rebuilt.__wrapped__ = inner  # type: ignore[attr-defined]
        inner = rebuilt
    return inner


def _link(function: Any) -> int | None:
    """The index of the closure cell of ``function`` that holds its ``__wrapped__``; None if there is none."""
    inner = getattr(function, "__wrapped__", None)
    if inner is None or not isinstance(function, types.FunctionType) or not function.__closure__:
        return None
    for index, cell in enumerate(function.__closure__):
        try:
            if cell.cell_contents is inner:
                return index
        except ValueError:  # an empty cell
            continue
    return None


def defined_name(function: Any) -> str | None:
    """``module.qualname`` where a Python function was defined: ``functools.wraps`` overwrites ``__module__`` and
    ``__qualname__`` with the wrapped object's (``functools`` for a partial), the code and globals keep the truth."""
    if not isinstance(function, types.FunctionType):
        return None
    code = function.__code__
    module = function.__globals__.get("__name__", "?")
    return f"{module}.{getattr(code, 'co_qualname', code.co_name)}"
