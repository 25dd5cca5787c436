"""Apply: which tensors of a checkpointed layer call belong to that layer alone, and so may move to host memory.

A layer call's first positional tensor is its input (the hidden states). Some models pass a layer a second
activation of its own: ZAYA its router's hidden states, Pegasus-X its global tokens, each made by the layer before
it for this layer alone. Those move as well. What several layers share stays: the encoder's states every decoder
layer attends to, T5's position bias, masks and rotary tables (which need no gradient), and a view into a tensor
that holds every layer's slice (Gemma-4's per-layer inputs: moving one slice frees nothing while the others stay).

A second tensor is a layer's own when it is a floating-point activation (it requires grad), owns its storage (it is
not a view into a larger one), and no other layer call of the forward receives it. The last is known only once a
forward has run, so it is learned, per layer and argument position, from each forward (every call's tensors are
noted); within a forward, a tensor an earlier call received is shared at once. Before a forward has shown it, the
layer's ``forward`` names it. An argument named for what layers share (``encoder_hidden_states``, a mask, a position
bias or embedding, rotary tables, the stack's original input as Zamba passes it, the block states Inkling-2's layers
re-read), or one without a name (``*args``), is *deferred*: it stays on the device through that first forward, and
when the forward ends it moves if no other call received it (Granite-4-Vision runs one Q-Former layer per tower
feature, each with cross-attention states of its own). Deciding at the next call instead would be wrong: Zamba
passes its original input to every sixth layer only. Any other named argument moves at once (ZAYA's
``prev_router_hidden_states``, Pegasus-X's ``global_hidden_states``): deferring those would keep every layer's on the
device until the first forward ends, the peak offloading exists to lower. A shared tensor under such a name moves
once, at the first forward, and is then known: one copy wasted, nothing kept on the device that should have moved.
A container's calls (a model that runs the checkpoint for each of its layers, as many did on transformers 4.52) need
both: a tensor some calls make and pass to the next alone (4.52's T5 position bias) is no layer's own.
"""

from __future__ import annotations

import inspect
import weakref
from typing import NamedTuple

import torch


class LayerCall(NamedTuple):
    """A layer call's tensors that may move: ``moving`` now (its input first), ``deferred`` once the forward ends
    if no other call received them (:meth:`LayerInputs.settle`)."""

    moving: tuple[torch.Tensor, ...] = ()
    deferred: tuple[torch.Tensor, ...] = ()


class LayerInputs:
    """Per planned layer, the tensors of a call that move: its input and the second activations of its own."""

    def __init__(self, layers: int) -> None:
        self.own: list[dict[int, bool]] = [{} for _ in range(layers)]  # learned: argument place -> its own
        self.names: list[tuple[str, ...]] = [() for _ in range(layers)]  # each layer's forward's positional names
        # Per layer: is it a container's call (a model that calls the checkpoint for its layers, as many did on
        # transformers 4.52)? What a container passes beside the input may be made by some calls only (4.52's T5
        # position bias, made by the first block and passed to the rest), so one forward showing a tensor to a
        # single call does not make it the layer's own: its name must say so too (Pegasus-X's global tokens).
        self.named_only: list[bool] = [False] * layers
        # This forward: tensor id -> (a weak reference to the tensor, its (layer, argument position) places). Weak:
        # a strong one would keep an offloaded input on the device; a dead one means the id was reused.
        self._seen: dict[int, tuple[weakref.ref, list[tuple[int, int]]]] = {}
        self._deferred: list[weakref.ref] = []  # this forward's deferred tensors

    def new_forward(self) -> None:
        """A forward begins: what the last one showed is learned (a tensor received by one call only is that
        layer's own), and the notes start again."""
        for _, places in self._seen.values():
            for position, place in places:
                if place >= 0 and position < len(self.own):
                    self.own[position][place] = len(places) == 1
        self._seen, self._deferred = {}, []

    def forget(self) -> None:
        """This forward's notes are dropped unlearned (it raised part way)."""
        self._seen, self._deferred = {}, []

    def settle(self) -> list[torch.Tensor]:
        """The forward ends: of its deferred tensors, those no other call received (they move now)."""
        deferred, self._deferred = self._deferred, []
        own = []
        for ref in deferred:
            tensor = ref()
            noted = self._seen.get(id(tensor)) if tensor is not None else None
            if noted is not None and noted[0]() is tensor and len(noted[1]) == 1:
                own.append(tensor)
        return own

    def of(self, position: int, args: tuple, defer: bool = True) -> LayerCall:
        """The tensors of layer ``position``'s call with ``args`` that move: its first positional tensor, then its
        own second activations, and those deferred to the forward's end (none: no positional tensor). Without
        ``defer`` (no forward's end will settle them) those stay."""
        places = [(place, arg) for place, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
        if not places:
            return LayerCall()
        moving, deferred = [places[0][1]], []
        named_only = position < len(self.named_only) and self.named_only[position]
        names = self.names[position] if position < len(self.names) else ()
        for index, (place, tensor) in enumerate(places):
            noted = self._seen.get(id(tensor))
            if noted is None or noted[0]() is not tensor:
                noted = self._seen[id(tensor)] = (weakref.ref(tensor), [])
            earlier = noted[1]
            earlier.append((position, place if index > 0 else -1))
            if index == 0 or len(earlier) > 1 or not _activation(tensor):
                continue
            learned = self.own[position].get(place) if position < len(self.own) else None
            guess = place < len(names) and not any(word in names[place] for word in SHARED_NAMES)
            if named_only:
                if guess and learned is not False:
                    moving.append(tensor)
            elif learned is not None:
                if learned:
                    moving.append(tensor)
            elif guess:
                moving.append(tensor)
            elif defer:
                deferred.append(tensor)
                self._deferred.append(weakref.ref(tensor))
        return LayerCall(tuple(moving), tuple(deferred))


SHARED_NAMES = (
    "encoder",
    "mask",
    "position",
    "bias",
    "rotary",
    "cos",
    "sin",
    "cache",
    "past",
    "memory",
    "original",
    "block_states",
)


def argument_names(module: torch.nn.Module) -> tuple[str, ...]:
    """The names of ``module``'s positional ``forward`` parameters (a ``CheckpointWrapper``'s wrapped module's)."""
    module = getattr(module, "_checkpoint_wrapped_module", module)
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(parameter.name for parameter in parameters if parameter.kind in kinds)


def _activation(tensor: torch.Tensor) -> bool:
    """A floating-point tensor that requires grad and owns its storage (not a view into a larger one), and is not a
    parameter."""
    if isinstance(tensor, torch.nn.Parameter):  # the model holds it: moving a copy frees nothing
        return False
    if not (tensor.is_floating_point() and tensor.requires_grad) or tensor.layout != torch.strided:
        return False
    try:
        storage = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
        return False
    return tensor.storage_offset() == 0 and storage == tensor.numel() * tensor.element_size()
