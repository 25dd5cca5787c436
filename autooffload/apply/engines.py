"""Apply: the offload engines, by name, and what the checkpoint functions need of one.

``sync`` (:mod:`~autooffload.apply.offload`) copies each saved layer input on the compute stream; ``stream``
(:mod:`~autooffload.apply.stream_engine`) overlaps the copies on a copy stream. Both take their host buffers from
one :class:`~autooffload.apply.host_memory.HostMemory` and count every byte they move in one
:class:`~autooffload.apply.offload.OffloadStats`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..guard import StepFaults
from .host_memory import HostMemory
from .offload import LayerInput, OffloadStats, SyncEngine
from .stream_engine import StreamEngine
from .streams import HostPool


class OffloadEngine(Protocol):
    """Makes the saved-tensor hooks for one call of a checkpointed layer.

    ``last``: the text stack's last layer. ``layer_input``: the layer's inputs (the first positional tensor of
    the call, and the second activations of its own: :mod:`.layer_inputs`), one tensor or several; only their
    storages move, so masks, position ids, position embeddings and what several layers share that reach the
    checkpoint as positional arguments stay where they are. ``None``: no such filter. ``deferred``: tensors
    whose owner is known only when the forward ends (:mod:`.layer_inputs`); they stay on the device until then.
    """

    def hooks(
        self, last: bool, layer_input: LayerInput = None, deferred: Sequence[torch.Tensor] = ()
    ) -> torch.autograd.graph.saved_tensors_hooks: ...

    def begin_forward(self) -> None:
        """A top-level training forward begins: its layer calls form one chain, apart from earlier forwards'."""

    def settle(self, own: Sequence[torch.Tensor]) -> None:
        """The forward ended: of the tensors it deferred (``deferred`` of :meth:`hooks`), those of ``own``'s
        storages move to host memory now, and the others stay on the device."""


def make_engine(
    name: str,
    stats: OffloadStats,
    modules: list[torch.nn.Module],
    host: HostMemory | None = None,
    faults: StepFaults | None = None,
) -> OffloadEngine:
    """The engine ``name`` (``faults``: where its hooks' failures are noted, :class:`~autooffload.guard.StepFaults`)."""
    if name == "sync":
        return SyncEngine(stats, host, faults)
    if name == "stream":
        return StreamEngine(stats, modules=modules, pool=HostPool(host), faults=faults)
    raise ValueError(f"unknown offload engine {name!r}")
