"""Apply: the offload engines, by name, and what the checkpoint functions need of one.

``sync`` (:mod:`~autooffload.apply.offload`) copies each saved layer input on the compute stream; ``stream``
(:mod:`~autooffload.apply.stream_engine`) overlaps the copies on a copy stream. Both take their host buffers from
one :class:`~autooffload.apply.host_memory.HostMemory` and count every byte they move in one
:class:`~autooffload.apply.offload.OffloadStats`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .host_memory import HostMemory
from .offload import LayerInput, OffloadStats, SyncEngine
from .stream_engine import HostPool, StreamEngine


class OffloadEngine(Protocol):
    """Makes the saved-tensor hooks for one call of a checkpointed layer.

    ``last``: the text stack's last layer. ``layer_input``: the layer's inputs (the first positional tensor of
    the call, and the second activations of its own: :mod:`.layer_inputs`), one tensor or several; only their
    storages move, so masks, position ids, position embeddings and what several layers share that reach the
    checkpoint as positional arguments stay where they are. ``None``: no such filter.
    """

    def hooks(self, last: bool, layer_input: LayerInput = None) -> torch.autograd.graph.saved_tensors_hooks: ...

    def begin_forward(self) -> None:
        """A top-level training forward begins: its layer calls form one chain, apart from earlier forwards'."""


def make_engine(
    name: str, stats: OffloadStats, modules: list[torch.nn.Module], host: HostMemory | None = None
) -> OffloadEngine:
    if name == "sync":
        return SyncEngine(stats, host)
    if name == "stream":
        return StreamEngine(stats, modules=modules, pool=HostPool(host))
    raise ValueError(f"unknown offload engine {name!r}")
