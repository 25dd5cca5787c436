"""Apply, part 2: find the checkpointed modules and swap their checkpoint function.

Two kinds of module run torch's checkpoint on their own forward:

- transformers' checkpointed modules: ``gradient_checkpointing`` is true and ``_gradient_checkpointing_func``
  holds the function (a ``functools.partial`` over ``torch.utils.checkpoint.checkpoint``, or over the
  native-offload wrapper in transformers >= 5.17). Every call reads the attribute, so a swap takes effect
  at the next layer forward.
- torch's ``CheckpointWrapper`` (accelerate's FSDP ``activation_checkpointing``): ``checkpoint_fn``.

What counts as a layer. A module that checkpoints its own forward (transformers' ``GradientCheckpointingLayer``,
4.52+, or a ``CheckpointWrapper``) is one layer. A module with the flag that holds no checkpointed module
itself is a *container*: its forward calls ``self._gradient_checkpointing_func(layer.__call__, hidden, mask,
...)`` once per layer (many model files on 4.52, remote code on any release), so its calls within one forward
are the layers of its ModuleList, in order; the list's length (or ``config.num_hidden_layers`` where smaller)
is known before the first forward, and an installed dispatcher (:class:`LayerCalls`) runs call i with layer
i's function, counting from 0 again at every forward of the container (a pre-forward hook on it) and of the
attached model. A module with the flag inside a layer (T5's attention modules hold one for their position bias)
or inside a container's blocks is *inner*: not a layer, it keeps plain checkpointing. Layers are grouped in
*stacks* (the ModuleList they share); the stacks that consume the tokens (:mod:`~autooffload.apply.stacks`: the
text stack, or an encoder-decoder's two) are planned, the others (a VLM's vision blocks) keep plain
checkpointing. A layer module that runs several times in one forward (HRM's cycles) runs its function at every
call, and every call under grad is counted (:class:`ForwardState`). Of a
layer call's saved inputs only the layer input moves (its first positional tensor): masks, position ids and
position embeddings that reach the checkpoint as positional arguments stay, and so does an input already
moved in the same forward.

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
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils.checkpoint import checkpoint

from ..warn import WarnOnce
from .host_memory import HostMemory
from .keep import keep_function, measuring_keep_function, measuring_plain_function, parameter_storages
from .offload import OffloadStats, SyncEngine
from .stacks import plan_stacks
from .wrapped import rewrap, wrapper_chain

NOT_TORCH_KEYS = ("offload", "every_n_layers")


@dataclasses.dataclass
class CheckpointTarget:
    """One module whose checkpoint function autooffload controls.

    ``kind``: ``"layer"`` checkpoints its own forward; ``"container"`` calls the function once per layer of
    the ModuleList ``stack`` (``size`` layers); ``"outer"`` holds checkpointed layers and is not expected to
    call it; ``"inner"`` has the flag inside a layer or a container's blocks (T5's attention). ``stack``: the
    ModuleList its layers belong to (for a layer, its parent); ``text``: that stack is planned
    (:func:`~autooffload.apply.stacks.plan_stacks`).
    """

    name: str
    module: torch.nn.Module
    attribute: str
    original: Callable[..., Any]
    kwargs: dict[str, Any]
    kind: str = "layer"
    stack: str = ""
    size: int = 1
    text: bool = True
    wrappers: tuple = ()  # a framework's wrappers around torch's checkpoint (wrapped.py), outermost first

    @property
    def is_layer(self) -> bool:
        return self.kind == "layer"


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
        controllable = _controllable(function, original)
        if controllable is None:
            unknown.append((name or type(module).__name__, function))
            continue
        kwargs, wrappers = controllable
        found.append(CheckpointTarget(name, module, attribute, original, kwargs, wrappers=wrappers))
    for target in found:
        _classify(target, found)
    for target in found:
        _mark_inner(target, found)
    planned = {stack.name for stack in plan_stacks(model, found)[0]}
    for target in found:
        target.text = target.stack in planned and target.kind in ("layer", "container")
    return found, unknown


def _controllable(function: Callable[..., Any], original: Callable[..., Any]) -> tuple[dict[str, Any], tuple] | None:
    """(checkpoint kwargs, wrappers) of an installed function: torch's checkpoint, or a framework's wrappers
    around it (LLaMA-Factory's, see wrapped.py); None for a function autooffload cannot steer."""
    wrappers = wrapper_chain(original, lambda f: _torch_checkpoint_kwargs(f) is not None)
    if wrappers is None:
        return None
    kwargs = _torch_checkpoint_kwargs(function)
    if kwargs is None and wrappers:
        kwargs = _torch_checkpoint_kwargs(wrappers[-1].__wrapped__)
    return None if kwargs is None else (kwargs, wrappers)


def _classify(target: CheckpointTarget, found: list[CheckpointTarget]) -> None:
    """Layer, container or outer, and the stack: from the module's class and the modules it holds. A module
    that checkpoints itself is a layer whatever it holds (T5's block holds attention modules with the flag)."""
    prefix = target.name + "." if target.name else ""
    itself = _checkpoints_itself(target.module)
    if not itself and any(
        other.name.startswith(prefix) and not _inside_blocks(other, target) for other in found if other is not target
    ):
        target.kind, target.stack = "outer", target.name
        return
    layers = None if itself else _repeated_blocks(target.module)
    if layers is None:
        target.kind, target.stack = "layer", target.name.rpartition(".")[0]
        return
    list_name, size = layers
    configured = getattr(getattr(target.module, "config", None), "num_hidden_layers", None)
    if isinstance(configured, int) and not isinstance(configured, bool) and 0 < configured < size:
        size = configured  # e.g. Gemma2 on 4.52 loops over ``self.layers[: config.num_hidden_layers]``
    target.kind, target.stack, target.size = "container", prefix + list_name, size


def _inside_blocks(inner: CheckpointTarget, container: CheckpointTarget) -> bool:
    """Is ``inner`` deeper than an item of the blocks ``container`` would call its function for (T5's attention
    modules inside the blocks of a 4.52 ``T5Stack``)?"""
    blocks = _repeated_blocks(container.module)
    if blocks is None:
        return False
    prefix = (container.name + "." if container.name else "") + blocks[0] + "."
    return inner.name.startswith(prefix) and "." in inner.name[len(prefix) :]


def _mark_inner(target: CheckpointTarget, found: list[CheckpointTarget]) -> None:
    """A target inside a layer or inside a container's blocks is inner: it is run within their checkpoint."""
    for other in found:
        if other is target or other.kind not in ("layer", "container"):
            continue
        prefix = other.name + "." if other.name else ""
        within_layer = other.kind == "layer" and target.name.startswith(prefix)
        if within_layer or (other.kind == "container" and _inside_blocks(target, other)):
            target.kind, target.stack, target.size = "inner", other.stack, 1
            return


def _checkpoints_itself(module: torch.nn.Module) -> bool:
    """transformers' ``GradientCheckpointingLayer`` (4.52+) and torch's ``CheckpointWrapper`` checkpoint their
    own forward; a model or remote-code module with the flag calls the function for its children."""
    wrapper_type = _checkpoint_wrapper_type()
    if wrapper_type is not None and isinstance(module, wrapper_type):
        return True
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)


def _repeated_blocks(module: torch.nn.Module) -> tuple[str, int] | None:
    """(name, length) of the ModuleList of blocks a container's checkpoint calls go to: the shallowest
    ModuleList whose items are all of one class (the decoder layers, not the experts inside one), the longest
    of those; None when the module holds none."""
    best: tuple[int, int, str] | None = None
    for name, child in module.named_modules():
        if not isinstance(child, torch.nn.ModuleList) or len(child) == 0:
            continue
        if len({type(item) for item in child}) != 1:
            continue
        rank = (-name.count("."), len(child), name)
        if best is None or rank[:2] > best[:2]:
            best = rank
    return None if best is None else (best[2], best[1])


def _plain_function(kwargs: dict[str, Any], counted: Callable[[tuple], None] | None = None) -> Callable[..., Any]:
    if counted is None:

        def checkpoint_plain(function, *args, **call_kwargs):
            return checkpoint(function, *args, **kwargs, **call_kwargs)

        return checkpoint_plain

    def checkpoint_plain(function, *args, **call_kwargs):
        counted(args)
        return checkpoint(function, *args, **kwargs, **call_kwargs)

    return checkpoint_plain


class OffloadEngine(Protocol):
    """Makes the saved-tensor hooks for one call of a checkpointed layer.

    ``last``: the text stack's last layer. ``layer_input``: the layer's input (the first positional tensor of
    the call); only its storage moves, so masks, position ids and position embeddings that reach the
    checkpoint as positional arguments stay where they are. ``None``: no such filter.
    """

    def hooks(
        self, last: bool, layer_input: torch.Tensor | None = None
    ) -> torch.autograd.graph.saved_tensors_hooks: ...

    def begin_forward(self) -> None:
        """A top-level training forward begins: its layer calls form one chain, apart from earlier forwards'."""


def make_engine(
    name: str, stats: OffloadStats, modules: list[torch.nn.Module], host: HostMemory | None = None
) -> OffloadEngine:
    if name == "sync":
        return SyncEngine(stats, host)
    if name == "stream":
        from .stream_engine import HostPool, StreamEngine

        return StreamEngine(stats, modules=modules, pool=HostPool(host))
    raise ValueError(f"unknown offload engine {name!r}")


class ForwardState:
    """What the checkpoint functions share within one forward of the attached model: the layer inputs already
    handed to the engine (one is not moved twice), each container's call counter, and how often each planned
    layer was called under grad (``counts``, since the last :meth:`take_counts`). The controller's
    pre-forward hook calls :meth:`new_forward` before every forward, and :meth:`take_counts` at every decision.

    ``on_first_call(position, nbytes)``, when set, hears the bytes of each planned layer's input (its first
    positional tensor, what :meth:`claim` hands to the engine; 0 when the call has none) at its first
    grad-enabled call after a take: the size a layer input really has (a source padded to a block size,
    ProphetNet's n-gram streams, a speech pre-net's frames), which no token count read before the forward
    says exactly."""

    def __init__(self, layers: int = 0) -> None:
        self.moved: list[weakref.ref] = []
        self.calls: list[LayerCalls] = []
        self.counts = [0] * layers
        self.last = [1] * layers
        self.on_first_call: Callable[[int, int], None] | None = None

    def new_forward(self) -> None:
        self.moved.clear()
        for calls in self.calls:
            calls.count = 0

    def take_counts(self) -> list[int]:
        """The calls of each planned layer since the last take (one micro-batch: the controller takes them at
        every decision), and start counting again. ``last`` keeps, per layer, its latest count that was not 0."""
        counts, self.counts = self.counts, [0] * len(self.counts)
        self.last = [count or last for count, last in zip(counts, self.last, strict=True)]
        return counts

    def counter(self, position: int) -> Callable[[tuple], None]:
        """What layer ``position``'s functions call at every call with its arguments: it counts the call when it
        saves inputs, and reports the first such call's layer input to ``on_first_call``."""

        @torch.compiler.disable
        def counted(args: tuple) -> None:
            if not torch.is_grad_enabled():
                return
            if self.counts[position] == 0 and self.on_first_call is not None:
                layer_input = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
                nbytes = 0 if layer_input is None else layer_input.numel() * layer_input.element_size()
                self.on_first_call(position, nbytes)
            self.counts[position] += 1

        return counted

    @torch.compiler.disable
    def claim(self, args: tuple) -> torch.Tensor | None:
        """The layer input of a call (its first positional tensor), or None when there is none or it was already
        handed to the engine in this forward."""
        layer_input = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
        self.moved = [ref for ref in self.moved if ref() is not None]
        if layer_input is None or any(ref() is layer_input for ref in self.moved):
            return None
        self.moved.append(weakref.ref(layer_input))
        return layer_input


class LayerCalls:
    """Per-call dispatch for a container target: its i-th call in a forward is layer i of its stack and runs
    ``functions[i]``; a call beyond the stack's size runs ``beyond``. ``apply`` writes the slots, the installed
    function (:func:`_dispatch_function`) only reads them, so a new kind of call (e.g. one that keeps the
    layer's activations and calls it directly) is a new function in a slot."""

    def __init__(self, target: CheckpointTarget, plain: Callable[..., Any]) -> None:
        self.target = target
        self.functions: list[Callable[..., Any]] = [plain] * target.size
        self.beyond = plain
        self.count = 0

    def next(self) -> Callable[..., Any]:
        index = self.count
        self.count = index + 1
        return self.functions[index] if index < len(self.functions) else self.beyond


def _dispatch_function(calls: LayerCalls) -> Callable[..., Any]:
    def checkpoint_layer_call(function, *args, **call_kwargs):
        return calls.next()(function, *args, **call_kwargs)

    return checkpoint_layer_call


def _offload_function(
    kwargs: dict[str, Any], engine: OffloadEngine, last: bool, forward: ForwardState, position: int
) -> Callable[..., Any]:
    counted = forward.counter(position)

    def checkpoint_offload(function, *args, **call_kwargs):
        counted(args)
        layer_input = forward.claim(args)
        if layer_input is None:
            return checkpoint(function, *args, **kwargs, **call_kwargs)
        with engine.hooks(last, layer_input):
            return checkpoint(function, *args, **kwargs, **call_kwargs)

    return checkpoint_offload


@dataclasses.dataclass(frozen=True)
class LayerSlot:
    """Layer ``index`` of a target: the target itself for a layer, one of a container's calls otherwise."""

    target: CheckpointTarget
    index: int = 0


class CheckpointSwitch:
    """Holds, for every layer of the text stack, the plain, the offloading and the keep function, and installs
    one of them.

    ``apply(k, keep)`` makes the first ``k`` layers of the text stack (in order: their inputs are saved earliest
    and live longest) offload, the last ``keep`` run without checkpointing (:mod:`~autooffload.apply.keep`: a
    container's call runs ``layer.__call__`` directly, a ``CheckpointWrapper`` its wrapped module) and the others
    recompute. With ``measure``, every kept or recomputing layer counts what it keeps (or would keep without
    checkpointing) and hands its position, the bytes and the autocast dtype's bytes (0: off) to
    ``on_measured``. The layers are the text stack's layer targets, or, for a container target, its calls
    in one forward (:class:`LayerCalls`). Other stacks (a VLM's vision blocks) and outer targets keep plain
    checkpointing. ``engine``: ``"sync"``, ``"stream"`` or an
    :class:`OffloadEngine`.
    ``host``: where a named engine takes its host buffers (default: a manager of its own).
    """

    def __init__(
        self,
        targets: list[CheckpointTarget],
        stats: OffloadStats,
        engine: str | OffloadEngine = "sync",
        warn: WarnOnce | None = None,
        host: HostMemory | None = None,
    ) -> None:
        self.targets = targets
        self.warn = warn if warn is not None else WarnOnce()
        modules = [t.module for t in targets]
        self.engine = make_engine(engine, stats, modules, host) if isinstance(engine, str) else engine
        self._plain = {id(t): self._tag(_plain_function(t.kwargs), t) for t in targets}
        self._calls: dict[int, LayerCalls] = {}
        self._hooks: list[Any] = []
        self.layers = [
            LayerSlot(t, index)
            for t in targets
            if t.text and t.kind in ("layer", "container")
            for index in range(t.size)
        ]
        self.forward = ForwardState(len(self.layers))
        self._plain_layer = [
            self._tag(_plain_function(s.target.kwargs, self.forward.counter(i)), s.target)
            for i, s in enumerate(self.layers)
        ]
        self._offload = [
            self._tag(_offload_function(s.target.kwargs, self.engine, s is self.layers[-1], self.forward, i), s.target)
            for i, s in enumerate(self.layers)
        ]
        self.on_measured: Callable[[int, int, int], None] | None = None
        self._keep = [self._tag(keep_function(), s.target) for s in self.layers]
        self._keep_measured = [
            self._tag(
                measuring_keep_function(
                    functools.partial(parameter_storages, [s.target.module]), functools.partial(self._measured, i)
                ),
                s.target,
            )
            for i, s in enumerate(self.layers)
        ]
        self._plain_measured = [
            self._tag(
                measuring_plain_function(
                    _plain_function(s.target.kwargs, self.forward.counter(i)),
                    functools.partial(parameter_storages, [s.target.module]),
                    functools.partial(self._measured, i),
                ),
                s.target,
            )
            for i, s in enumerate(self.layers)
        ]
        for target in targets:
            if target.kind == "container" and target.text:
                calls = LayerCalls(target, self._plain[id(target)])
                self._calls[id(target)] = calls
                self.forward.calls.append(calls)
                setattr(target.module, target.attribute, self._tag(_dispatch_function(calls), target, wrap=False))
                self._hooks.append(target.module.register_forward_pre_hook(self._container_forward(calls)))
            else:
                self._install(target, self._plain[id(target)])
        self.offloaded = -1
        self.kept = 0
        self.measuring = False
        self.order: tuple[int, ...] = tuple(range(len(self.layers)))
        self.apply(0)

    @staticmethod
    def _tag(function: Callable[..., Any], target: CheckpointTarget, wrap: bool = True) -> Callable[..., Any]:
        """Mark ``function`` as autooffload's for ``target``; with ``wrap``, inside the target's own wrappers (a
        container's dispatcher is not wrapped: it must count every call; the functions it dispatches to are)."""
        if wrap and target.wrappers:
            function = rewrap(target.wrappers, function)
        function._autooffload_original = target.original
        function._autooffload_kwargs = target.kwargs
        return function

    def apply(self, k: int, keep: int = 0, measure: bool = False, order: tuple[int, ...] | None = None) -> None:
        """Offload the first ``k`` layers of ``order`` (positions in :attr:`layers`; default: module order, the
        earliest first), keep the last ``keep`` layers in module order, recompute the others."""
        k = max(0, min(k, len(self.layers)))
        keep = max(0, min(keep, len(self.layers) - k))
        measure = measure and k < len(self.layers)
        order = tuple(range(len(self.layers))) if order is None else tuple(order)
        if (k, keep, measure, order) == (self.offloaded, self.kept, self.measuring, self.order):
            return
        first_kept = len(self.layers) - keep
        offloading = set(order[:k])
        for position, slot in enumerate(self.layers):
            if position >= first_kept:
                function = (self._keep_measured if measure else self._keep)[position]
            else:
                plain = self._plain_measured[position] if measure else self._plain_layer[position]
                function = self._offload[position] if position in offloading else plain
            calls = self._calls.get(id(slot.target))
            if calls is not None:
                calls.functions[slot.index] = function
            else:
                self._install(slot.target, function)
        self.offloaded, self.kept, self.measuring, self.order = k, keep, measure, order
        self._installed = [(t.module, t.attribute, getattr(t.module, t.attribute)) for t in self.targets]

    def _measured(self, position: int, nbytes: int, cast_bytes: int) -> None:
        if self.on_measured is not None:
            self.on_measured(position, nbytes, cast_bytes)

    def new_forward(self) -> None:
        """A forward of the attached model begins: container calls count from layer 0 again. Warns once if a
        container called its function more often in one forward than its stack has layers."""
        for calls in self._calls.values():
            self._restart(calls)
        self.forward.new_forward()

    def _container_forward(self, calls: LayerCalls) -> Callable[..., None]:
        """A pre-forward hook on the container itself: its calls count from layer 0 at each of its forwards,
        also when something calls it without the attached model (TRL's Liger-loss paths call ``model.model``)."""

        def restart(module: torch.nn.Module, args: tuple) -> None:
            self._restart(calls)

        return restart

    def _restart(self, calls: LayerCalls) -> None:
        if calls.count > len(calls.functions):
            target = calls.target
            self.warn(
                f"container-calls:{target.name}",
                f"{target.name or type(target.module).__name__} called its checkpoint function {calls.count} "
                f"times in one forward, but {target.stack} has {len(calls.functions)} layers; the calls beyond "
                "those run plain checkpointing",
            )
        calls.count = 0

    def close(self) -> None:
        """Remove the hooks this switch put on container modules (the switch is being replaced or detached)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _install(self, target: CheckpointTarget, function: Callable[..., Any]) -> None:
        setattr(target.module, target.attribute, function)

    def intact(self) -> bool:
        """True while every target still runs the function this switch installed last, with checkpointing on.

        Identity checks only, no allocation: it runs before every training forward, to notice a trainer that
        disabled and re-enabled checkpointing (TRL's reference forward), which installs new functions.
        """
        for module, attribute, function in self._installed:
            if getattr(module, attribute, None) is not function:
                return False
            if getattr(module, "gradient_checkpointing", True) is False:
                return False
        return True

    def restore(self) -> None:
        """Put back the functions found at construction."""
        for target in self.targets:
            setattr(target.module, target.attribute, target.original)
        self.offloaded, self.kept, self.measuring = -1, 0, False


def install_plain(model: torch.nn.Module) -> None:
    """Put plain checkpointing (torch's checkpoint with the kwargs found, without ``offload``) on every
    checkpointed module of ``model`` whose function autooffload knows: the fallback when autooffload gives up
    before its switch exists (:mod:`autooffload.guard`), since transformers' own functions may carry an
    ``offload`` key that fails (before 5.17; on a CPU-only build) or always offloads."""
    wrapper_type = _checkpoint_wrapper_type()
    for module in model.modules():
        attribute = "checkpoint_fn" if wrapper_type is not None and isinstance(module, wrapper_type) else None
        if attribute is None and getattr(module, "gradient_checkpointing", False) is True:
            attribute = "_gradient_checkpointing_func"
        function = getattr(module, attribute, None) if attribute else None
        kwargs = _torch_checkpoint_kwargs(function) if function is not None else None
        if kwargs is not None:
            setattr(module, attribute, _plain_function(kwargs))
