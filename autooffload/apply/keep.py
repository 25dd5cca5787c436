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
alive with or without keep). The count goes to a callback, once per call.
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
    every tensor is passed through to the hooks around the block (or kept as it is)."""

    def __init__(self, excluded: set[tuple[torch.device, int]]) -> None:
        self.bytes = 0
        seen = set(excluded)
        outer = _outer_hooks()
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(tensor: torch.Tensor) -> Any:
            key = _storage_key(tensor)
            if key is not None and key not in seen:
                seen.add(key)
                self.bytes += tensor.untyped_storage().nbytes()
            return outer_pack(tensor) if outer_pack is not None else tensor

        def unpack(packed: Any) -> torch.Tensor:
            return outer_unpack(packed) if outer_unpack is not None else packed

        super().__init__(pack, unpack)

    def __enter__(self) -> SavedBytesCounter:
        super().__enter__()
        return self


def keep_function() -> Callable[..., Any]:
    """The keep rung: the layer runs once, without checkpointing."""

    def checkpoint_keep(function, *args, **call_kwargs):
        return function(*args, **call_kwargs)

    return checkpoint_keep


def measuring_keep_function(
    excluded: Callable[[], set[tuple[torch.device, int]]], report: Callable[[int], None]
) -> Callable[..., Any]:
    """The keep rung that also counts what the layer saved beyond ``excluded()`` (parameters, buffers) and its
    inputs, and calls ``report(bytes)`` once the layer's forward has run."""

    def checkpoint_keep_measured(function, *args, **call_kwargs):
        inputs = {key for key in map(_storage_key, _tensors((function, args, call_kwargs))) if key is not None}
        counter = SavedBytesCounter(excluded() | inputs)
        with counter:
            output = function(*args, **call_kwargs)
        report(counter.bytes)
        return output

    return checkpoint_keep_measured


def parameter_storages(modules: Iterable[torch.nn.Module]) -> set[tuple[torch.device, int]]:
    """Storages of the modules' parameters and buffers: saved by a layer's operations, alive anyway."""
    keys = set()
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            key = _storage_key(tensor)
            if key is not None:
                keys.add(key)
    return keys
