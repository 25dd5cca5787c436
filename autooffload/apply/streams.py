"""Apply: the stream engine's two sides, the device's streams and events and the host's buffers.

:mod:`.stream_engine` orders its copies only through these: :class:`Streams` (a copy stream per device, events,
copies; plain copies on a device without streams) and :class:`HostPool` (host buffers under the node's budget).
Tests replace either with a recording stand-in.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .host_memory import HostBuffer, HostMemory


class Streams:
    """Streams, events and copies for the engine; every other module reaches the device through this.

    Devices without streams (CPU) get ``None`` for streams and events, and plain copies. Tests replace the
    whole object with a recording stand-in.
    """

    def __init__(self) -> None:
        self._copy_streams: dict[torch.device, Any] = {}

    def current(self, device: torch.device) -> Any:
        module = _stream_module(device)
        return None if module is None else module.current_stream(device)

    def copy_stream(self, device: torch.device) -> Any:
        module = _stream_module(device)
        if module is None:
            return None
        if device not in self._copy_streams:
            self._copy_streams[device] = module.Stream(device)
        return self._copy_streams[device]

    def record(self, stream: Any) -> Any:
        return None if stream is None else stream.record_event()

    def wait(self, stream: Any, event: Any) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    def using(self, stream: Any) -> contextlib.AbstractContextManager:
        if stream is None:
            return contextlib.nullcontext()
        return _stream_module(stream.device).stream(stream)

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        destination.copy_(source, non_blocking=destination.is_pinned() or source.is_pinned())

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _stream_module(device: torch.device) -> Any:
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    needed = ("Stream", "current_stream", "stream")
    return module if all(hasattr(module, name) for name in needed) else None


class HostPool:
    """The engine's host side: buffers from a :class:`~autooffload.apply.host_memory.HostMemory` (shared with
    the controller, which plans under its budget and ticks its releases), keyed per device for the copies.

    ``take`` returns None when the budget or the host is short, and the caller keeps the tensor on the device.
    """

    def __init__(self, host: HostMemory | None = None) -> None:
        self.host = host if host is not None else HostMemory()

    @property
    def allocations(self) -> int:
        return self.host.allocations

    @property
    def held_bytes(self) -> int:
        return self.host.held_bytes

    def take(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, HostBuffer] | None:
        """A host buffer of at least ``nbytes`` for a tensor on ``device`` and its key for :meth:`give`."""
        buffer = self.host.take(nbytes, device)
        return None if buffer is None else (buffer.tensor, buffer)

    def give(self, tensor: torch.Tensor, key: HostBuffer, drop: bool = False) -> None:
        """Return a buffer. Only copies on its device's copy stream touch it again, so they are ordered. ``drop``:
        release it at once (its device drained first)."""
        self.host.give(key, drop)
