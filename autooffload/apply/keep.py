"""Apply, part 3: the keep rung, a checkpointed layer run without checkpointing, and the count of what it keeps.

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

The backward counter tells the keep planner when a backward ran, so that it knows how many forwards were
alive together (chosen and rejected as two calls before one backward, accumulation by hand): a hook on one
trainable parameter that fires once its gradient is accumulated, once per backward that reaches it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch


def _outer_hooks() -> tuple[Callable, Callable] | None:
    """The saved-tensor hooks in force around this call (torch >= 2.5 exposes them), or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        return top(False)
    except Exception:  # a signature this torch does not have
        return None


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    for value in values:
        if torch.is_tensor(value):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from _tensors(value)
        elif isinstance(value, dict):
            yield from _tensors(value.values())
        elif isinstance(value, functools.partial):
            yield from _tensors((value.args, value.keywords))


def _storage_key(tensor: torch.Tensor) -> tuple[torch.device, int] | None:
    try:
        return tensor.device, tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (sparse, some subclasses)
        return None


class SavedBytesCounter(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of distinct storages saved for backward inside the block, less ``excluded`` ones;
    every tensor is passed through to the hooks around the block (or kept as it is).

    ``hold``: keep the counted tensors alive until the block ends. Where the hooks around do not keep what
    they are given (a checkpoint's), a freed tensor's address can come back for a later one, which would then
    look counted already."""

    def __init__(self, excluded: set[tuple[torch.device, int]], hold: bool = False) -> None:
        self.bytes = 0
        self.held: list[torch.Tensor] = []
        seen = set(excluded)
        outer = _outer_hooks()
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(tensor: torch.Tensor) -> Any:
            key = _storage_key(tensor)
            if key is not None and key not in seen:
                seen.add(key)
                self.bytes += tensor.untyped_storage().nbytes()
                if hold:
                    self.held.append(tensor)
            return outer_pack(tensor) if outer_pack is not None else tensor

        def unpack(packed: Any) -> torch.Tensor:
            return outer_unpack(packed) if outer_unpack is not None else packed

        super().__init__(pack, unpack)

    def __enter__(self) -> SavedBytesCounter:
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.held = []


def keep_function() -> Callable[..., Any]:
    """The keep rung: the layer runs once, without checkpointing."""

    def checkpoint_keep(function, *args, **call_kwargs):
        return function(*args, **call_kwargs)

    return checkpoint_keep


def measuring_keep_function(
    excluded: Callable[[], set[tuple[torch.device, int]]], report: Callable[[int, int], None]
) -> Callable[..., Any]:
    """The keep rung that also counts what the layer saved beyond ``excluded()`` (parameters, buffers) and its
    inputs, and calls ``report(bytes, autocast dtype bytes or 0)`` once the layer's forward has run."""

    def checkpoint_keep_measured(function, *args, **call_kwargs):
        tensors = list(_tensors((function, args, call_kwargs)))
        inputs = {key for key in map(_storage_key, tensors) if key is not None}
        counter = SavedBytesCounter(excluded() | inputs)
        with counter:
            output = function(*args, **call_kwargs)
        report(counter.bytes, autocast_bytes(tensors[0].device.type if tensors else "cpu"))
        return output

    return checkpoint_keep_measured


def measuring_plain_function(
    plain: Callable[..., Any], excluded: Callable[[], set[tuple[torch.device, int]]], report: Callable[[int, int], None]
) -> Callable[..., Any]:
    """Plain checkpointing (``plain``) that also counts what the layer would keep without it, and reports it as
    the measuring keep function does: inside the checkpoint, the layer's first forward with gradients on (the
    forward itself; under reentrant checkpointing, the recompute) runs under a counter that hands every tensor
    on to the checkpoint's own hooks, so what is kept and the gradients are plain checkpointing's. A layer's
    cost is then known before it is ever kept."""

    def checkpoint_plain_measured(function, *args, **call_kwargs):
        tensors = list(_tensors((function, args, call_kwargs)))
        inputs = {key for key in map(_storage_key, tensors) if key is not None}
        done = []

        def counted(*inner_args, **inner_kwargs):
            if done or not torch.is_grad_enabled():
                return function(*inner_args, **inner_kwargs)
            done.append(True)
            counter = SavedBytesCounter(excluded() | inputs, hold=True)
            with counter:
                output = function(*inner_args, **inner_kwargs)
            report(counter.bytes, autocast_bytes(tensors[0].device.type if tensors else "cpu"))
            return output

        return plain(counted, *args, **call_kwargs)

    return checkpoint_plain_measured


def autocast_bytes(device_type: str) -> int:
    """The bytes of the autocast dtype in force for ``device_type``; 0 when autocast is off."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return 0
        return torch.get_autocast_dtype(device_type).itemsize
    except (RuntimeError, TypeError, AttributeError):  # a device type autocast does not know
        return 0


def matrix_weights(module: torch.nn.Module, calls: int = 1) -> int:
    """Elements of the module's floating-point parameters of two or more dimensions (what autocast casts for
    its matmuls), per call when a container module runs ``calls`` layers."""
    count = sum(p.numel() for p in module.parameters() if p.is_floating_point() and p.dim() >= 2)
    return count // max(calls, 1)


def count_backwards(model: torch.nn.Module, on_backward: Callable[[], None]) -> Any:
    """Call ``on_backward()`` once per backward that reaches the model's last trainable parameter (a hook fired
    after its gradient is accumulated); returns the hook's handle, or None when nothing is trainable."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        return None
    try:
        return trainable[-1].register_post_accumulate_grad_hook(lambda parameter: on_backward())
    except (RuntimeError, AttributeError):  # a parameter kind without the hook
        return None


def parameter_storages(modules: Iterable[torch.nn.Module]) -> set[tuple[torch.device, int]]:
    """Storages of the modules' parameters and buffers: saved by a layer's operations, alive anyway."""
    keys = set()
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            key = _storage_key(tensor)
            if key is not None:
                keys.add(key)
    return keys
