"""Apply, part 2: find the checkpointed modules and swap their checkpoint function.

Two kinds of module run torch's checkpoint on their own forward:

- transformers' checkpointed modules: ``gradient_checkpointing`` is true and ``_gradient_checkpointing_func``
  holds the function (a ``functools.partial`` over ``torch.utils.checkpoint.checkpoint``, or over the
  native-offload wrapper in transformers >= 5.17). Every call reads the attribute, so a swap takes effect
  at the next layer forward.
- torch's ``CheckpointWrapper`` (accelerate's FSDP ``activation_checkpointing``): ``checkpoint_fn``.

Each module gets two functions built on ``torch.utils.checkpoint.checkpoint`` with its own checkpoint
kwargs, less the keys that are not torch's (``offload``, ``every_n_layers``): a plain one and one that runs
under the saved-tensor hooks of the offload engine (``sync``: :class:`~autooffload.apply.offload.HostOffloadHooks`;
``stream``: :mod:`~autooffload.apply.stream_engine`). They are closures, not partials, on purpose:
torch.compile guards a called function by its code object, so swapping between two closures is seen
(one recompile per variant, then cached), while a swap between two ``functools.partial`` objects is not
guarded at all and would silently keep running the first one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils.checkpoint import checkpoint

from .keep import keep_function, measuring_keep_function, parameter_storages
from .offload import OffloadStats, SyncEngine

NOT_TORCH_KEYS = ("offload", "every_n_layers")


@dataclasses.dataclass
class CheckpointTarget:
    """One module whose checkpoint function autooffload controls."""

    name: str
    module: torch.nn.Module
    attribute: str
    original: Callable[..., Any]
    kwargs: dict[str, Any]
    is_layer: bool = True


def _checkpoint_wrapper_type() -> type | None:
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # torch built without distributed
        return None
    return CheckpointWrapper


def _torch_checkpoint_kwargs(function: Callable[..., Any]) -> dict[str, Any] | None:
    """The checkpoint kwargs behind ``function``, or None if it is not a checkpoint autooffload knows."""
    if getattr(function, "_autooffload_kwargs", None) is not None:
        return dict(function._autooffload_kwargs)
    if not isinstance(function, functools.partial):
        return None
    inner = function.func
    known = inner is checkpoint or (
        getattr(inner, "__module__", "").startswith("transformers") and "checkpoint" in inner.__name__
    )
    if not known:
        return None
    kwargs = {k: v for k, v in function.keywords.items() if k not in NOT_TORCH_KEYS}
    # Stripping ``offload`` can leave no ``use_reentrant``; use what this transformers release would have
    # chosen had the user not written ``offload`` (False from 5.0, True before), not torch's warning default.
    kwargs.setdefault("use_reentrant", _transformers_major() < 5)
    return kwargs


@functools.cache
def _transformers_major() -> int:
    try:
        from importlib.metadata import version

        return int(version("transformers").split(".")[0])
    except Exception:  # not installed: CheckpointWrapper-only use
        return 5


def find_targets(
    model: torch.nn.Module,
) -> tuple[list[CheckpointTarget], list[tuple[str, Callable[..., Any]]]]:
    """Checkpointed modules of ``model`` in module order, and (name, function) of those it cannot control."""
    wrapper_type = _checkpoint_wrapper_type()
    found: list[CheckpointTarget] = []
    unknown: list[tuple[str, Callable[..., Any]]] = []
    for name, module in model.named_modules():
        if wrapper_type is not None and isinstance(module, wrapper_type):
            attribute = "checkpoint_fn"
        elif getattr(module, "gradient_checkpointing", False) is True and hasattr(
            module, "_gradient_checkpointing_func"
        ):
            attribute = "_gradient_checkpointing_func"
        else:
            continue
        function = getattr(module, attribute)
        original = getattr(function, "_autooffload_original", function)
        kwargs = _torch_checkpoint_kwargs(function)
        if kwargs is None:
            unknown.append((name or type(module).__name__, function))
            continue
        found.append(CheckpointTarget(name, module, attribute, original, kwargs))
    for target in found:
        prefix = target.name + "." if target.name else ""
        target.is_layer = not any(other.name.startswith(prefix) for other in found if other is not target)
    return found, unknown


def _plain_function(kwargs: dict[str, Any]) -> Callable[..., Any]:
    def checkpoint_plain(function, *args, **call_kwargs):
        return checkpoint(function, *args, **kwargs, **call_kwargs)

    return checkpoint_plain


class OffloadEngine(Protocol):
    """Makes the saved-tensor hooks for one call of a checkpointed layer (``last``: the model's last one)."""

    def hooks(self, last: bool) -> torch.autograd.graph.saved_tensors_hooks: ...


def make_engine(name: str, stats: OffloadStats, modules: list[torch.nn.Module]) -> OffloadEngine:
    if name == "sync":
        return SyncEngine(stats)
    if name == "stream":
        from .stream_engine import StreamEngine

        return StreamEngine(stats, modules=modules)
    raise ValueError(f"unknown offload engine {name!r}")


def _offload_function(kwargs: dict[str, Any], engine: OffloadEngine, last: bool) -> Callable[..., Any]:
    def checkpoint_offload(function, *args, **call_kwargs):
        with engine.hooks(last):
            return checkpoint(function, *args, **kwargs, **call_kwargs)

    return checkpoint_offload


class CheckpointSwitch:
    """Holds, for every target, the plain, the offloading and the keep function, and installs one of them.

    ``apply(k, keep)`` makes the first ``k`` layers (in module order: their inputs are saved earliest and live
    longest) offload, the last ``keep`` layers run without checkpointing (:mod:`~autooffload.apply.keep`)
    and the others recompute; container targets (a model that holds checkpointed layers) offload whenever
    any layer does. ``engine``: ``"sync"``, ``"stream"`` or an :class:`OffloadEngine`. With ``measure``, the
    first kept layer counts what it saved and hands the bytes to ``on_measured``.
    """

    def __init__(
        self, targets: list[CheckpointTarget], stats: OffloadStats, engine: str | OffloadEngine = "sync"
    ) -> None:
        self.targets = targets
        self.layers = [t for t in targets if t.is_layer]
        modules = [t.module for t in targets]
        self.engine = make_engine(engine, stats, modules) if isinstance(engine, str) else engine
        self._functions = {}
        for target in targets:
            last = bool(self.layers) and target is self.layers[-1]
            plain, offload = _plain_function(target.kwargs), _offload_function(target.kwargs, self.engine, last)
            keep = keep_function()
            measured = measuring_keep_function(functools.partial(parameter_storages, [target.module]), self._measured)
            for function in (plain, offload, keep, measured):
                function._autooffload_original = target.original
                function._autooffload_kwargs = target.kwargs
            self._functions[id(target)] = (plain, offload, keep, measured)
        self.on_measured: Callable[[int], None] | None = None
        self.offloaded = -1
        self.kept = 0
        self.measuring = False
        self.apply(0)

    def apply(self, k: int, keep: int = 0, measure: bool = False) -> None:
        k = max(0, min(k, len(self.layers)))
        keep = max(0, min(keep, len(self.layers) - k))
        measure = measure and keep > 0
        if (k, keep, measure) == (self.offloaded, self.kept, self.measuring):
            return
        first_kept = len(self.layers) - keep
        for index, target in enumerate(self.layers):
            if index >= first_kept:
                self._install_keep(target, measure and index == first_kept)
            else:
                self._install(target, offload=index < k)
        for target in self.targets:
            if not target.is_layer:
                self._install(target, offload=k > 0)
        self.offloaded, self.kept, self.measuring = k, keep, measure

    def _install(self, target: CheckpointTarget, offload: bool) -> None:
        setattr(target.module, target.attribute, self._functions[id(target)][int(offload)])

    def _install_keep(self, target: CheckpointTarget, measure: bool) -> None:
        setattr(target.module, target.attribute, self._functions[id(target)][3 if measure else 2])

    def _measured(self, nbytes: int) -> None:
        if self.on_measured is not None:
            self.on_measured(nbytes)

    def restore(self) -> None:
        """Put back the functions found at construction."""
        for target in self.targets:
            setattr(target.module, target.attribute, target.original)
        self.offloaded, self.kept, self.measuring = -1, 0, False
