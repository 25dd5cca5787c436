"""Observe: the checkpointed modules of a model, and which of them are the layers autooffload plans.

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
is known before the first forward. A module with the flag inside a layer (T5's attention modules hold one for
their position bias) or inside a container's blocks is *inner*: not a layer, it keeps plain checkpointing; so is one
that does not checkpoint itself inside a layer whose function autooffload leaves (a test's wrapper).
Layers are grouped in *stacks* (the ModuleList they share); the stacks that consume the tokens
(:mod:`~autooffload.observe.stacks`: the text stack, or an encoder-decoder's two) are planned, the others (a VLM's
vision blocks) keep plain checkpointing. A function autooffload does not know (DeepSpeed's, an offload wrapper's,
a framework's that wraps something other than torch's checkpoint) is left alone and named
(:mod:`~autooffload.observe.paths`); a framework's wrapper of torch's checkpoint is steered through the wrapper
(:mod:`~autooffload.observe.wrapped`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from .ours import ours
from .stacks import plan_stacks
from .wrapped import rewrap, wrapper_chain

NOT_TORCH_KEYS = ("offload", "every_n_layers")


class Foreign(NamedTuple):
    """A checkpointed module whose function autooffload cannot steer: left as it is, named in a warning
    (:mod:`.paths`), and watched, so that a change of it (a test's patch undone) is read again."""

    name: str
    function: Callable[..., Any]
    module: torch.nn.Module
    attribute: str


@dataclasses.dataclass
class CheckpointTarget:
    """One module whose checkpoint function autooffload controls.

    ``kind``: ``"layer"`` checkpoints its own forward; ``"container"`` calls the function once per layer of
    the ModuleList ``stack`` (``size`` layers); ``"outer"`` holds checkpointed layers and is not expected to
    call it; ``"inner"`` has the flag inside a layer or a container's blocks (T5's attention). ``stack``: the
    ModuleList its layers belong to (for a layer, its parent); ``text``: that stack is planned
    (:func:`~autooffload.observe.stacks.plan_stacks`).
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


def checkpoint_wrapper_type() -> type | None:
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # torch built without distributed
        return None
    return CheckpointWrapper


def torch_checkpoint_kwargs(function: Callable[..., Any]) -> dict[str, Any] | None:
    """The checkpoint kwargs behind ``function``, or None if it is not a checkpoint autooffload knows: one of
    autooffload's own functions (:mod:`.ours`, by identity) or a partial over torch's or transformers' checkpoint."""
    made = ours(function)
    if made is not None:
        return dict(made.kwargs)
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


def find_targets(model: torch.nn.Module) -> tuple[list[CheckpointTarget], list[Foreign]]:
    """Checkpointed modules of ``model`` in module order, each marked planned (``text``) or not, and those it cannot
    control."""
    found, unknown = checkpointed_modules(model)
    mark_planned(found, plan_stacks(model, found)[0])
    return found, unknown


def checkpointed_modules(model: torch.nn.Module) -> tuple[list[CheckpointTarget], list[Foreign]]:
    """Checkpointed modules of ``model`` in module order, classified (layer, container, outer, inner) but not yet
    marked planned, and those it cannot control. A function of autooffload's own is read as the function it
    replaced (:mod:`.ours`); anything else, a wrapper around one of autooffload's included, as what it is."""
    wrapper_type = checkpoint_wrapper_type()
    found: list[CheckpointTarget] = []
    unknown: list[Foreign] = []
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
        original = replaced(function)
        controllable = _controllable(function, original)
        if controllable is None:
            unknown.append(Foreign(name or type(module).__name__, function, module, attribute))
            continue
        kwargs, wrappers = controllable
        found.append(CheckpointTarget(name, module, attribute, original, kwargs, wrappers=wrappers))
    for target in found:
        _classify(target, found)
    for target in found:
        _mark_inner(target, found)
    for target in found:
        _mark_inner_foreign(target, unknown)
    return found, unknown


def mark_planned(targets: list[CheckpointTarget], stacks: list[Any]) -> None:
    """Mark the layer and container targets of the planned ``stacks`` (:func:`.stacks.plan_stacks`)."""
    planned = {stack.name for stack in stacks}
    for target in targets:
        target.text = target.stack in planned and target.kind in ("layer", "container")


def planned_layers(targets: list[CheckpointTarget]) -> list[LayerSlot]:
    """The planned layers, in module order: a layer target itself, or each of a container target's calls."""
    planned = [t for t in targets if t.text and t.kind in ("layer", "container")]
    return [LayerSlot(target, index) for target in planned for index in range(target.size)]


def replaced(function: Callable[..., Any]) -> Callable[..., Any]:
    """The function ``function`` stands for, which a restore puts back: one of autooffload's own stands for the
    function it replaced (:mod:`.ours`); wrappers put around one of them (``functools.wraps``, after autooffload
    installed it) stand for the same wrappers around that function, so that a framework's wrapper autooffload was
    steering through stays beneath them."""
    made = ours(function)
    if made is not None:
        return made.original
    chain = wrapper_chain(function, lambda inner: ours(inner) is not None)
    if not chain:
        return function
    made = ours(chain[-1].__wrapped__)
    assert made is not None
    return rewrap(chain, made.original)


def _controllable(function: Callable[..., Any], original: Callable[..., Any]) -> tuple[dict[str, Any], tuple] | None:
    """(checkpoint kwargs, wrappers) of an installed function: torch's checkpoint, or a framework's wrappers
    around it (LLaMA-Factory's, see wrapped.py); None for a function autooffload cannot steer."""
    wrappers = wrapper_chain(original, lambda f: torch_checkpoint_kwargs(f) is not None)
    if wrappers is None:
        return None
    kwargs = torch_checkpoint_kwargs(function)
    if kwargs is None and wrappers:
        kwargs = torch_checkpoint_kwargs(wrappers[-1].__wrapped__)
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


def _mark_inner_foreign(target: CheckpointTarget, unknown: list[Foreign]) -> None:
    """A target that does not checkpoint itself, inside a layer autooffload leaves (T5's attention inside a block
    whose function a test wrapped), is inner as it would be inside a layer of its own: it makes no checkpoint call,
    and taken for a layer it was a stack whose length cannot be read. One that checkpoints itself (Swin's blocks in
    a stage left alone) makes its own calls and stays a layer."""
    if target.kind != "layer" or _checkpoints_itself(target.module):
        return
    for other in unknown:
        if other.name and target.name.startswith(other.name + ".") and _checkpoints_itself(other.module):
            target.kind, target.stack, target.size = "inner", other.name.rpartition(".")[0], 1
            return


def _checkpoints_itself(module: torch.nn.Module) -> bool:
    """transformers' ``GradientCheckpointingLayer`` (4.52+) and torch's ``CheckpointWrapper`` checkpoint their
    own forward; a model or remote-code module with the flag calls the function for its children."""
    wrapper_type = checkpoint_wrapper_type()
    if wrapper_type is not None and isinstance(module, wrapper_type):
        return True
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)


def _repeated_blocks(module: torch.nn.Module) -> tuple[str, int] | None:
    """(name, length) of the ModuleList of blocks a container's checkpoint calls go to: the shallowest
    ModuleList (the decoder layers, not the experts inside one), of those one whose items are all of one class,
    the longest. Its items may be of several classes: a speech feature encoder's convolutions on transformers
    4.52 (a group-normed first layer, then plain ones), a hybrid's layers (Jamba's attention and Mamba layers,
    every other one holding a list of experts of one class, deeper); None when the module holds none."""
    best: tuple[int, bool, int, str] | None = None
    for name, child in module.named_modules():
        if not isinstance(child, torch.nn.ModuleList) or len(child) == 0:
            continue
        rank = (-name.count("."), len({type(item) for item in child}) == 1, len(child), name)
        if best is None or rank[:3] > best[:3]:
            best = rank
    return None if best is None else (best[3], best[2])


@dataclasses.dataclass(frozen=True)
class LayerSlot:
    """Layer ``index`` of a target: the target itself for a layer, one of a container's calls otherwise."""

    target: CheckpointTarget
    index: int = 0
