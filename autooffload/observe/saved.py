"""Observe: what a block of autograd work saves for its backward, counted by storage.

Both the keep rung's measurement (:mod:`autooffload.apply.keep`) and
:class:`~autooffload.observe.simulated.SimulatedDevice` count the bytes a forward saves: each storage once, whatever
views of it are saved, parameters and buffers not at all (they are alive anyway). The counting hooks pass every
tensor on to the saved-tensor hooks around them, so whatever runs outside (a checkpoint, an offload engine) sees
exactly what it would have seen without them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..guard import StepFaults, in_step, nothing, passes_on

SAVED_COUNT = in_step("a saved-bytes count")


@torch.compiler.disable
def _outer_hooks() -> tuple[Callable, Callable] | None:
    """The saved-tensor hooks in force around this call (torch >= 2.5 exposes them), or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        return top(False)
    except Exception:  # a signature this torch does not have
        return None


def tensors_in(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    """Every tensor in ``values``, looking into tuples, lists, dicts and the arguments bound in a partial."""
    for value in values:
        if torch.is_tensor(value):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from tensors_in(value)
        elif isinstance(value, dict):
            yield from tensors_in(value.values())
        elif isinstance(value, functools.partial):
            yield from tensors_in((value.args, value.keywords))


def storage_key(tensor: torch.Tensor) -> tuple[torch.device, int] | None:
    """Which storage a tensor views; compared only while both tensors are alive. None for a tensor whose storage
    cannot be read (sparse, a wrapper subclass such as the DTensor parameters of an FSDP2-sharded model)."""
    try:
        return tensor.device, tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (sparse, some subclasses)
        return None


class SavedBytesCounter(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of distinct storages saved for backward inside the block, less ``excluded`` ones;
    every tensor is passed through to the hooks around the block (or kept as it is).

    ``hold``: keep the counted tensors alive until the block ends. Where the hooks around do not keep what
    they are given (a checkpoint's), a freed tensor's address can come back for a later one, which would then
    look counted already.

    The hooks do not refer to the counter: the graph holds them (and through them the hooks around, a checkpoint's
    frame with its call's inputs) until its backward, and a counter they referred to, which refers to them, would
    make a cycle that only Python's cyclic collector frees, steps later, with those inputs still allocated.

    The count runs shielded (``faults``, :mod:`autooffload.guard`): where it fails, the tensor is still handed on."""

    def __init__(
        self, excluded: set[tuple[torch.device, int]], hold: bool = False, faults: StepFaults | None = None
    ) -> None:
        self._count = count = [0]
        self.held: list[torch.Tensor] = []
        held = self.held
        seen = set(excluded)
        outer = _outer_hooks()
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def add(tensor: torch.Tensor) -> None:
            key = storage_key(tensor)
            if key is not None and key not in seen:
                seen.add(key)
                count[0] += tensor.untyped_storage().nbytes()
                if hold:
                    held.append(tensor)

        counted = (faults if faults is not None else StepFaults()).shield(SAVED_COUNT, add, nothing)

        def pack(tensor: torch.Tensor) -> Any:
            counted(tensor)
            return outer_pack(tensor) if outer_pack is not None else tensor

        def unpack(packed: Any) -> torch.Tensor:
            return outer_unpack(packed) if outer_unpack is not None else packed

        # What each does of its own is the count (shielded); the rest is the hooks' around, or torch's.
        super().__init__(passes_on(pack, SAVED_COUNT.where), passes_on(unpack, "the saved-tensor hooks around"))

    def __enter__(self) -> SavedBytesCounter:
        super().__enter__()
        return self

    @property
    def bytes(self) -> int:
        """The bytes counted so far."""
        return self._count[0]

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.held.clear()


def parameter_storages(modules: Iterable[torch.nn.Module]) -> set[tuple[torch.device, int]]:
    """Storages of the modules' parameters and buffers: saved by a layer's operations, alive anyway."""
    keys = set()
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            key = storage_key(tensor)
            if key is not None:
                keys.add(key)
    return keys
