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
second positional tensor is taken as the layer's own where it is laid out as the input is (as many axes, the same
batch), and anything else as shared: the shared tensors that reach a checkpoint positionally (an encoder's
states, T5's position bias) come later in the call or have other axes.
"""

from __future__ import annotations

import weakref

import torch


class LayerInputs:
    """Per planned layer, the tensors of a call that move: its input and the second activations of its own."""

    def __init__(self, layers: int) -> None:
        self.own: list[dict[int, bool]] = [{} for _ in range(layers)]  # learned: argument position -> its own
        # This forward: tensor id -> (a weak reference to the tensor, its (layer, argument position) places). Weak:
        # a strong one would keep an offloaded input on the device; a dead one means the id was reused.
        self._seen: dict[int, tuple[weakref.ref, list[tuple[int, int]]]] = {}

    def new_forward(self) -> None:
        """A forward begins: what the last one showed is learned (a tensor received by one call only is that
        layer's own), and the notes start again."""
        for _, places in self._seen.values():
            for position, index in places:
                if index > 0 and position < len(self.own):
                    self.own[position][index] = len(places) == 1
        self._seen = {}

    def of(self, position: int, args: tuple) -> tuple[torch.Tensor, ...]:
        """The tensors of layer ``position``'s call with ``args`` that move: its first positional tensor, then its
        own second activations (none: no positional tensor)."""
        tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
        if not tensors:
            return ()
        first, moving = tensors[0], [tensors[0]]
        for index, tensor in enumerate(tensors):
            noted = self._seen.get(id(tensor))
            if noted is None or noted[0]() is not tensor:
                noted = self._seen[id(tensor)] = (weakref.ref(tensor), [])
            earlier = noted[1]
            earlier.append((position, index))
            if index == 0 or len(earlier) > 1 or not _activation(tensor):
                continue
            learned = self.own[position].get(index) if position < len(self.own) else None
            guess = index == 1 and tensor.dim() == first.dim() and tensor.shape[:1] == first.shape[:1]
            if learned if learned is not None else guess:
                moving.append(tensor)
        return tuple(moving)


def _activation(tensor: torch.Tensor) -> bool:
    """A floating-point tensor that requires grad and owns its storage (not a view into a larger one)."""
    if not (tensor.is_floating_point() and tensor.requires_grad) or tensor.layout != torch.strided:
        return False
    try:
        storage = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
        return False
    return tensor.storage_offset() == 0 and storage == tensor.numel() * tensor.element_size()
