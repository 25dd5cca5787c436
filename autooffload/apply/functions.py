"""Apply: the checkpoint functions a switch installs (:mod:`.switch`), each built on
``torch.utils.checkpoint.checkpoint`` with a module's own checkpoint kwargs.

They are closures, not partials, on purpose: torch.compile guards a called function by its code object, so
swapping between two closures is seen (one recompile per variant, then cached), while a swap between two
``functools.partial`` objects is not guarded at all and would silently keep running the first one.

What they do besides torch's checkpoint (count the call, pick what moves, open the engine's hooks) runs shielded
(:class:`~autooffload.guard.StepFaults`): where it fails, the call runs as plain checkpointing would, and the next
entry point gives up. The layer itself runs outside the shield: its own errors are the step's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ..guard import StepFaults, in_step, nothing, passes_on
from ..observe.ours import register
from ..observe.targets import checkpoint_wrapper_type, replaced, torch_checkpoint_kwargs
from ..observe.wrapped import rewrap, wrapper_chain
from .engines import OffloadEngine
from .forward import ForwardState, LayerCalls
from .offload import OffloadStats, kept_hooks

COUNT = in_step("a layer call's count")
SETUP = in_step("an offloading layer call's setup")


def plain_function(
    kwargs: dict[str, Any], counted: Callable[[tuple], Any] | None = None, faults: StepFaults | None = None
) -> Callable[..., Any]:
    if counted is None:

        def checkpoint_plain(function, *args, **call_kwargs):
            return checkpoint(function, *args, **kwargs, **call_kwargs)

        return passes_on(checkpoint_plain)

    count = torch.compiler.disable((faults or StepFaults()).shield(COUNT, counted, nothing))

    def checkpoint_plain(function, *args, **call_kwargs):
        count(args)
        return checkpoint(function, *args, **kwargs, **call_kwargs)

    return passes_on(checkpoint_plain, COUNT.where)


@torch.compiler.disable
def _packing(stats: OffloadStats, position: int) -> None:
    """The engine's hooks run for layer ``position`` next: an input it cannot move is that layer's."""
    stats.layer = position


def eager_frame(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``'s own frame runs eagerly under torch.compile, what it calls is compiled: without it dynamo
    traces into the function up to the saved-tensor hooks and resumes after them in fragments, and guards on the
    values its counters build (a set of storages), recompiling at every call."""
    return torch.compiler.disable(function, recursive=False)


def dispatch_function(calls: LayerCalls) -> Callable[..., Any]:
    """A container's function: its call i runs layer i's. Unshielded: it reads a slot and counts, nothing more, and
    torch.compile traces it into the model's graph."""

    def checkpoint_layer_call(function, *args, **call_kwargs):
        return calls.next()(function, *args, **call_kwargs)

    return passes_on(checkpoint_layer_call, "the layer's own function")


def offload_function(
    kwargs: dict[str, Any],
    engine: OffloadEngine,
    last: bool,
    forward: ForwardState,
    position: int,
    stats: OffloadStats,
    faults: StepFaults | None = None,
) -> Callable[..., Any]:
    counted = forward.counter(position)

    def setup(args: tuple) -> torch.autograd.graph.saved_tensors_hooks:
        call = counted(args)
        inputs = forward.claim(call.moving)
        if not inputs and not call.deferred:
            return kept_hooks()
        _packing(stats, position)
        return engine.hooks(last, inputs, call.deferred)

    hooks = torch.compiler.disable((faults or StepFaults()).shield(SETUP, setup, lambda args: kept_hooks()))

    # Under saved-tensor hooks even when nothing of the call moves (its input moved already, it passes none
    # positionally, or it is an outer checkpoint's recompute): that recompute runs this call again, where what
    # moves may differ from its forward, and it must see the same saves as its forward did, none. Hooks that keep
    # every tensor as it is then, so that the engine opens no region that would break its prefetch chain; the same
    # where setting the call up failed (plain checkpointing).
    def checkpoint_offload(function, *args, **call_kwargs):
        with hooks(args):
            return checkpoint(function, *args, **kwargs, **call_kwargs)

    return passes_on(checkpoint_offload, SETUP.where)


def install_plain(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, Callable[..., Any]]]:
    """Put plain checkpointing (torch's checkpoint with the kwargs found, without ``offload``) on every
    checkpointed module of ``model`` whose function autooffload knows: the fallback when autooffload gives up
    before its switch exists (:mod:`autooffload.guard`), since transformers' own functions may carry an
    ``offload`` key that fails (before 5.17; on a CPU-only build) or always offloads. Returns what it installed
    (module, attribute, function)."""
    wrapper_type = checkpoint_wrapper_type()
    installed = []
    for module in model.modules():
        attribute = "checkpoint_fn" if wrapper_type is not None and isinstance(module, wrapper_type) else None
        if attribute is None and getattr(module, "gradient_checkpointing", False) is True:
            attribute = "_gradient_checkpointing_func"
        function = getattr(module, attribute, None) if attribute else None
        kwargs = torch_checkpoint_kwargs(function) if function is not None else None
        if kwargs is not None:
            original = replaced(function)
            wrappers = wrapper_chain(original, lambda inner: torch_checkpoint_kwargs(inner) is not None) or ()
            setattr(module, attribute, register(rewrap(wrappers, plain_function(kwargs)), original, kwargs))
            installed.append((module, attribute, getattr(module, attribute)))
    return installed
