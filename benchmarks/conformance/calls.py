"""What the sweep measures on its own: every grad-enabled call of torch's checkpoint (:class:`CheckpointCalls`),
through the entry points the installed torch really calls (:func:`checkpoint_entry_points`). Imports nothing of the
sweep's."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any


def _storage(tensor: Any) -> int:
    try:
        return tensor.untyped_storage().data_ptr() or id(tensor)
    except Exception:  # no storage of its own (a tensor subclass)
        return id(tensor)


def _view(tensor: Any) -> bool:
    """A floating-point activation that requires grad (a view of a layer input's storage that the layer receives)."""
    return tensor.is_floating_point() and tensor.requires_grad


def _own(tensor: Any) -> bool:
    """An activation with a storage of its own: floating-point, requiring grad, the whole of its storage."""
    try:
        whole = (
            tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        )
    except Exception:
        return False
    return tensor.is_floating_point() and tensor.requires_grad and whole


def _owner(function: Any) -> Any:
    """The module a checkpointed function belongs to: a bound method's, or the first argument of a partial over a
    plain ``forward`` (Dory's layers); None where neither."""
    import functools

    import torch

    while isinstance(function, functools.partial):
        if function.args and isinstance(function.args[0], torch.nn.Module):
            return function.args[0]
        function = function.func
    return getattr(function, "__self__", None)


def _owner_name(function: Any) -> str:
    """The module class a checkpointed function belongs to, for the report."""
    owner = _owner(function)
    return type(owner).__name__ if owner is not None else getattr(function, "__qualname__", "?")


# Where torch's checkpoint hands a call to its implementation, newest first. Private names, which move between
# releases (torch 2.14's checkpoint calls ``_checkpoint_without_reentrant_generator_impl``; 2.13's the generator
# without the suffix): each is tried with a probe call, and only the ones that see it are wrapped.
NON_REENTRANT = ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")


def _wrap_generator(original: Any, record: Any, scope: Any = None) -> Any:
    """A wrapper of a non-reentrant entry point that records ``(fn, args)``, whatever its signature: ``args`` is
    its parameter of that name (a ``*args`` in 2.13, a tuple in 2.14), bound to the call as the original would."""
    import inspect

    signature = inspect.signature(original)

    def watched(*call_args: Any, **call_kwargs: Any) -> Any:
        bound = signature.bind(*call_args, **call_kwargs)
        function = call_args[0] if call_args else call_kwargs.get("fn")
        record(function, tuple(bound.arguments.get("args", ())))
        generator = original(*call_args, **call_kwargs)
        if scope is None:
            return generator

        def inside() -> Any:  # the checkpointed forward runs between the generator's first and last step
            with scope():
                yield from generator

        return inside()

    return watched


def _wrap_function_class(original: Any, record: Any, scope: Any = None) -> Any:
    """A stand-in for ``CheckpointFunction`` (the reentrant path) whose ``apply(fn, preserve, *args)`` records."""

    class WatchedFunction:
        @staticmethod
        def apply(fn: Any, preserve: Any, *args: Any) -> Any:
            record(fn, args)
            with scope() if scope is not None else contextlib.nullcontext():
                return original.apply(fn, preserve, *args)

    return WatchedFunction


_ENTRY_POINTS: list[tuple[str, Any]] | None = None


def checkpoint_entry_points() -> list[tuple[str, Any]]:
    """(name in ``torch.utils.checkpoint``, wrapper factory) of the entry points this torch's ``checkpoint`` really
    calls, one for each path (non-reentrant, reentrant), found once per process by a probe call through each
    candidate. Raises ``RuntimeError`` where a path reaches none of them: the sweep cannot count on this torch."""
    global _ENTRY_POINTS
    if _ENTRY_POINTS is not None:
        return _ENTRY_POINTS
    import torch
    import torch.utils.checkpoint as cp

    def sees(name: str, make: Any, reentrant: bool) -> bool:
        seen: list[Any] = []
        original = getattr(cp, name, None)
        if original is None:
            return False
        setattr(cp, name, make(original, lambda fn, args: seen.append(args)))
        try:
            probe = torch.ones(2, requires_grad=True)
            with torch.enable_grad():
                cp.checkpoint(torch.sin, probe, use_reentrant=reentrant).sum().backward()
        except Exception:  # a candidate whose signature this wrapper does not bind
            return False
        finally:
            setattr(cp, name, original)
        return any(any(a is probe for a in args) for args in seen)

    found = []
    candidates = [(name, _wrap_generator, False) for name in NON_REENTRANT]
    candidates.append(("CheckpointFunction", _wrap_function_class, True))
    for reentrant in (False, True):
        path = [(name, make) for name, make, kind in candidates if kind == reentrant and sees(name, make, reentrant)]
        if not path:
            names = ", ".join(name for name, _, kind in candidates if kind == reentrant)
            raise RuntimeError(
                f"torch {torch.__version__}: torch.utils.checkpoint.checkpoint(use_reentrant={reentrant}) reaches none "
                f"of {names}; the sweep cannot count checkpointed calls on it (add this torch's entry point to "
                "benchmarks/conformance/calls.py)"
            )
        found.append(path[0])
    _ENTRY_POINTS = found
    return found


class CheckpointCalls:
    """Records every grad-enabled call of torch's checkpoint: the bytes of what belongs to that layer alone (its
    input, the first positional tensor, each tensor once per step; and every other positional tensor that is an
    activation, floating-point and requiring grad, whose storage no other call receives: ZAYA's router states,
    Pegasus-X's global tokens; not an encoder's states every decoder layer receives, T5's position bias, masks, or
    slices of one tensor that holds every layer's) and the module class it checkpoints. Wraps the two entry points
    ``torch.utils.checkpoint.checkpoint`` dispatches to, so any caller (transformers, autooffload, a container's
    loop) is seen, without reading autooffload. What is shared is known at the end: :meth:`finish` counts."""

    def __init__(self, held: bool = False) -> None:
        # ``held``: count what the checkpoints hold through the backward: a call inside another checkpointed call
        # counts nothing (a layer inside an outer non-reentrant checkpoint: the outer one keeps only its own input and
        # recomputes the rest), and a view of the input's storage the call also receives counts as the layer's
        # (LUKE's entity states beside its word states). The testers' source (:mod:`.testers`) uses it.
        self.held = held
        self.depth = 0  # checkpointed calls running now
        self.calls: list[tuple[str, int]] = []
        self.per_module: dict[int, int] = {}  # bytes of every call of one module (a layer called twice: both)
        self.extras = 0  # bytes of second activations of a layer's own, among those of ``calls``
        self._seen: list[weakref.ref] = []
        self._firsts: list[weakref.ref] = []  # every call's input, a tensor once per call that receives it
        self._attributed: list[tuple[Any, int]] = []  # each counted call's input (weakly) and its bytes
        # owner, key, input bytes, the input (weakly), the other tensors: (storage, bytes, an own activation, a view
        # of the input's storage)
        self._recorded: list[tuple[str, int, int, Any, list[tuple[int, int, bool, bool]]]] = []
        self._storages: dict[int, int] = {}  # storage -> calls that receive it
        # Every tensor recorded, held until :meth:`finish`: a storage freed within the step (an input offloaded to
        # the host) may have its address taken by a later tensor, which would then count as the same storage.
        self._held: list[Any] = []

    def record(self, function: Any, args: tuple) -> None:
        import torch

        if not torch.is_grad_enabled():
            return
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self._held.extend(tensors)
        for storage in {_storage(t) for t in tensors}:
            self._storages[storage] = self._storages.get(storage, 0) + 1
        tensor = tensors[0] if tensors else None
        nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
        if tensor is not None:
            self._firsts.append(weakref.ref(tensor))
        if (tensor is not None and any(ref() is tensor for ref in self._seen)) or (self.held and self.depth):
            return
        if tensor is not None:
            self._seen.append(weakref.ref(tensor))
        first = _storage(tensor) if tensor is not None else None
        others = [
            (_storage(t), t.numel() * t.element_size(), _own(t), _storage(t) == first and _view(t))
            for t in tensors[1:]
            if t is not tensor
        ]
        alive = weakref.ref(tensor) if tensor is not None else (lambda: None)
        self._recorded.append((_owner_name(function), id(_owner(function) or function), nbytes, alive, others))

    def finish(self) -> None:
        """Count what was recorded: a second tensor is a layer's own where no other call received its storage."""
        for name, key, nbytes, alive, others in self._recorded:
            own = sum(n for storage, n, whole, _ in others if whole and self._storages[storage] == 1)
            own += sum(n for _, n, _, view in others if view and self.held)
            self.extras += own
            self._attributed.append((alive, nbytes + own))
            self.calls.append((name, nbytes + own))
            self.per_module[key] = self.per_module.get(key, 0) + nbytes + own
        self._recorded, self._storages, self._held = [], {}, []

    @contextlib.contextmanager
    def watching(self):
        """Record every checkpointed call while inside. The entry points are found for the installed torch
        (:func:`checkpoint_entry_points`); a torch whose checkpoint reaches none of them raises here, loudly,
        rather than a sweep that sees no call and judges every row by nothing."""
        import torch.utils.checkpoint as cp

        patched = [(name, getattr(cp, name), make) for name, make in checkpoint_entry_points()]
        for name, original, make in patched:
            setattr(cp, name, make(original, self.record, self._inside))
        try:
            yield self
        finally:
            for name, original, _ in patched:
                setattr(cp, name, original)
            self.finish()

    def left(self, inputs: list[Any]) -> int:
        """The bytes counted for the calls whose input is one of ``inputs`` (the calls of a layer autooffload
        leaves), less those of an input another call received too (a layer inside it, which moves it)."""
        alone = [t for t in inputs if sum(ref() is t for ref in self._firsts) == 1]
        return sum(n for ref, n in self._attributed if any(ref() is t for t in alone))

    @contextlib.contextmanager
    def _inside(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.calls)
