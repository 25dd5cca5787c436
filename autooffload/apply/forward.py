"""Apply: what the checkpoint functions share within one forward of the model.

The functions :mod:`~autooffload.apply.switch` installs are closures; what they must agree on lives here: which
layer inputs were already handed to the engine in this forward (an input is moved once, however many layers save
it), how often each planned layer was called under grad in the running micro-batch (HRM's layers run in cycles), and
which layer a container model's i-th call of its checkpoint function is.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..observe.saved import storage_key
from ..observe.sources import input_shape
from ..observe.targets import CheckpointTarget
from .layer_inputs import LayerCall, LayerInputs


class ForwardState:
    """What the checkpoint functions share within one forward of the attached model: the layer inputs already
    handed to the engine (one is not moved twice), each container's call counter, and how often each planned
    layer was called under grad (``counts``, since the last :meth:`take_counts`). The controller's
    pre-forward hook calls :meth:`new_forward` before every forward, and :meth:`take_counts` at every decision.

    ``on_first_call(position, nbytes, shape)``, when set, hears the bytes of each planned layer's inputs (its first
    positional tensor and the second activations of its own: :mod:`.layer_inputs`, what :meth:`claim` hands to the
    engine; 0 when the call has none) and its first tensor's (sequence length, tokens) at its first
    grad-enabled call after a take: the size a layer input really has (a source padded to a block size,
    ProphetNet's n-gram streams, a speech pre-net's frames), which no token count read before the forward
    says exactly. A first call whose deferred tensors turn out to be its own is reported again, with them, by
    :meth:`settle` when the forward ends."""

    def __init__(self, layers: int = 0) -> None:
        self.moved: list[weakref.ref] = []
        self.calls: list[LayerCalls] = []
        self.counts = [0] * layers
        self.calls_per_forward = [1] * layers  # per layer, its latest count of calls that was not 0
        self.inputs = LayerInputs(layers)
        self.called = [False] * layers  # per layer, whether a micro-batch called it yet
        self.on_first_call: Callable[[int, int, tuple[int, int] | None], None] | None = None
        # The running micro-batch, as the controller names it: a count made later (a reentrant recompute, in the
        # backward) is filed under the micro-batch of the call that made it, not the one running then.
        self.batch: Any = None
        # This forward's first calls that deferred tensors: position -> (its reported bytes, shape, the tensors).
        self._first_deferred: dict[int, tuple[int, tuple[int, int] | None, list[weakref.ref]]] = {}
        self.open = False  # a forward the hooks saw begin runs, and its end will settle what its calls deferred
        # The switch was replaced or detached: a function of it that a foreign wrapper still calls counts, reports and
        # moves nothing (plain checkpointing, with its layer's kwargs).
        self.retired = False

    def new_forward(self) -> None:
        self.moved.clear()
        self._first_deferred = {}
        self.open = True
        self.inputs.new_forward()
        for calls in self.calls:
            calls.count = 0

    def take_counts(self) -> list[int]:
        """The calls of each planned layer since the last take (one micro-batch: the controller takes them at
        every decision), and start counting again; ``calls_per_forward`` keeps, per layer, the last count not 0,
        and 0 for a layer never called in a micro-batch that called others: a layer that a framework's wrapper
        runs without the checkpoint (LLaMA-Factory's frozen layers) holds nothing to offload."""
        counts, self.counts = self.counts, [0] * len(self.counts)
        if not any(counts):  # no forward under grad ran (the first decision, an eval or no-grad forward)
            return counts
        self.called = [called or count > 0 for called, count in zip(self.called, counts, strict=True)]
        self.calls_per_forward = [
            count or (last if called else 0)
            for count, last, called in zip(counts, self.calls_per_forward, self.called, strict=True)
        ]
        return counts

    def counter(self, position: int) -> Callable[[tuple], LayerCall]:
        """What layer ``position``'s functions call at every call with its arguments: it counts the call when it
        saves inputs, reports the first such call's inputs to ``on_first_call``, and returns the tensors of the call
        that may move (none without grad). A call inside a backward (an outer checkpoint's recompute) is no call of
        the forward: counted nothing, it moves nothing. Where the forward ran it under grad (a non-reentrant outer
        checkpoint) it moved there; where it ran under no_grad (a reentrant one), its saves live only through the
        outer backward that follows at once, and a copy of them frees nothing."""

        @torch.compiler.disable
        def counted(args: tuple) -> LayerCall:
            if self.retired or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return LayerCall()
            # Deferred only where a forward's end will settle it: not in a forward the hooks did not see begin (a
            # loop over the layers).
            call = self.inputs.of(position, args, defer=self.open)
            if self.counts[position] == 0 and self.on_first_call is not None:
                nbytes, shape = _nbytes(call.moving), input_shape(call.moving[0]) if call.moving else None
                self.on_first_call(position, nbytes, shape)
                if call.deferred:
                    self._first_deferred[position] = (nbytes, shape, [weakref.ref(t) for t in call.deferred])
            self.counts[position] += 1
            return call

        return counted

    def abandon(self) -> list[torch.Tensor]:
        """The forward raised: nothing it deferred moves, and what its calls showed is forgotten, not learned."""
        self._first_deferred, self.open = {}, False
        self.inputs.forget()
        return []

    @torch.compiler.disable
    def settle(self) -> list[torch.Tensor]:
        """The forward ends: the deferred tensors that no other call received, which move now; a first call that
        deferred some of them is reported again to ``on_first_call`` with their bytes."""
        own = self.inputs.settle()
        first, self._first_deferred, self.open = self._first_deferred, {}, False
        for position, (nbytes, shape, refs) in first.items():
            extra = [ref() for ref in refs if any(ref() is tensor for tensor in own)]
            if extra and self.on_first_call is not None:
                self.on_first_call(position, nbytes + _nbytes(extra), shape)
        return own

    @torch.compiler.disable
    def claim(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Of a call's ``inputs`` (:meth:`counter`'s), those not yet handed to the engine in this forward."""
        self.moved = [ref for ref in self.moved if ref() is not None]
        fresh = tuple(tensor for tensor in inputs if not any(ref() is tensor for ref in self.moved))
        self.moved.extend(weakref.ref(tensor) for tensor in fresh)
        return fresh


def _nbytes(tensors: Any) -> int:
    """The bytes the engines move for ``tensors``: each storage once, whole (a view moves as its storage, with the
    other views of it the call saves: LUKE's entity states beside its word states), by :func:`storage_key`."""
    sizes: dict[Any, int] = {}
    for tensor in tensors:
        key = storage_key(tensor)
        try:
            sizes[key if key is not None else id(tensor)] = tensor.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
            sizes[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(sizes.values())


class LayerCalls:
    """Per-call dispatch for a container target: its i-th call in a forward is layer i of its stack and runs
    ``functions[i]``; a call beyond the stack's size runs ``beyond``. ``apply`` writes the slots, the installed
    function (:func:`~autooffload.apply.functions.dispatch_function`) only reads them, so a new kind of call (e.g.
    one that keeps the layer's activations and calls it directly) is a new function in a slot."""

    def __init__(self, target: CheckpointTarget, plain: Callable[..., Any]) -> None:
        self.target = target
        self.functions: list[Callable[..., Any]] = [plain] * target.size
        self.beyond = plain
        self.count = 0
        self.ran = False  # its module ran in training, with grad, since the attached model's last forward ended

    def next(self) -> Callable[..., Any]:
        index = self.count
        self.count = index + 1
        return self.functions[index] if index < len(self.functions) else self.beyond
