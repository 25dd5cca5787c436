"""The overlapped offload engine (``engine="stream"``): copies on their own stream, prefetch in backward.

``save_on_cpu`` copies on the compute stream, so the compute stream stalls for every copy. Here each
checkpointed layer is a *region*: the pack hook starts the device-to-host copy of the layer's saved input
on a copy stream and returns at once; in the backward, when layer i's recompute unpacks its input, the
host-to-device copy of layer i-1's input starts on the copy stream, so that it has arrived when needed.
The compute stream waits on events; the host never waits on the device. The regions of one top-level
forward form one chain (the controller calls :meth:`StreamEngine.begin_forward` before each): with two
forwards before one backward, the second one's first layer must not prefetch the first one's last input,
which would then sit on the device through the rest of the backward.

A race here corrupts gradients silently, so each one is named with the rule that prevents it:

- **Copy before the data exists.** The host runs ahead of the device: when the pack hook runs, the kernel
  that writes the tensor may not have executed. The pack hook records an event on the compute stream (it
  is enqueued after the producer) and the copy stream waits on it before copying. The compute stream is
  read *before* entering the copy-stream context; read inside it, ``current_stream()`` is the copy stream
  and the event would order nothing.
- **Freed while being copied.** Dropping the device tensor returns its block to the caching allocator,
  which hands it to the next kernel on the compute stream while the copy may still read it. The engine
  holds the tensor until the *next* layer call exits (or the backward begins); then the compute stream
  waits on the copy's event and only then is the reference dropped, so every later reuse of the block is
  ordered after the copy. Holding it one layer longer lets the copy overlap that next layer too, which
  is all the overlap reentrant checkpointing allows (it saves its inputs after the layer has run); the
  cost is one layer input more on the device during the forward.
- **Used before it arrived.** Unpack makes the compute stream wait on the host-to-device copy's event
  before it returns the tensor, whether the copy was prefetched or started just now.
- **A destination still in use.** The host-to-device destination is allocated on the compute stream
  (outside the copy context) and the copy stream waits on an event recorded after that allocation, so the
  copy cannot overwrite a block whose previous compute-stream users have not run yet. Its later users are
  all on the compute stream, after the wait. A prefetched copy that is never unpacked is dropped only
  after the compute stream waited on it.
- **A host buffer overwritten.** Both directions use one copy stream per device and buffers are pooled
  per device, so a buffer handed out again is written only after every earlier copy from it ran. The host
  never reads or writes the buffers.

What moves is the layer input's storage (the switch names it: the call's first positional tensor; other
saved inputs such as a causal mask stay), once per region even if several saves share it (views come back as
views of one restored storage). Left on the device: the input of the last checkpointed layer (its backward
starts right after the forward, so a copy would come straight back), storages below ``min_bytes`` (a small
view of a large storage moves with it: kept, it would keep the whole storage on the device), parameters
and registered buffers of the controlled modules, recognised by their storage (the model holds them,
offloading would free nothing), tensor subclasses and non-strided tensors.
:class:`~autooffload.apply.offload.OffloadStats` counts the bytes actually copied to the host: with every
layer offloading, that is one layer's input less than the ``sync`` engine counts. When only the first k
layers offload, layer k-1's input is copied but held on the device until the forward ends (no later layer call
lets go of it); the controller's post-forward hook lets go of it then (:meth:`StreamEngine.settle`).

Host memory is a third budget (:class:`HostPool` over :class:`~autooffload.apply.host_memory.HostMemory`):
buffers of the size asked, reused across steps, under the node's budget, released when unused; if pinning
fails the engine continues with pageable memory, and if the budget or the host is short the tensor stays on
the device, each with one warning.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..guard import StepFaults, in_step, nothing, shielded_method
from ..observe.saved import storage_key
from .host_memory import cuda_drain
from .offload import LayerInput, OffloadStats, SavedVersion, storage_keys
from .streams import HostPool, Streams

MIN_BYTES = 1024
PACK = in_step("the stream engine's pack hook")
UNPACK = in_step("the stream engine's unpack hook")
REGION_END = in_step("the stream engine's region end")
COPY_END = in_step("the stream engine's host copy end")


class _Region:
    """One call of a checkpointed layer: its host copies, and a weak link to the region before it."""

    __slots__ = ("__weakref__", "copies", "previous", "serial", "unpacked")

    def __init__(self, previous: _Region | None, serial: int) -> None:
        self.previous = weakref.ref(previous) if previous is not None else None
        self.serial = serial
        self.copies: dict[tuple, _HostCopy] = {}
        self.unpacked = False


class _HostCopy:
    """One storage in a host buffer, and its way back: a pending prefetch or the tensor already handed out."""

    def __init__(
        self, engine: StreamEngine, lease: tuple[torch.Tensor, tuple], nbytes: int, device: torch.device
    ) -> None:
        self.engine = engine
        self.buffer, self.key = lease
        self.nbytes = nbytes
        self.device = device
        self.pending: tuple[torch.Tensor, Any, Any] | None = None
        self.ready: Any = None
        self.resident: torch.UntypedStorage | None = None

    def fetch(self) -> None:
        """Start the host-to-device copy unless it is already on its way or on the device."""
        if self.pending is not None or self.resident is not None:
            return
        streams = self.engine.streams
        compute = streams.current(self.device)
        target = streams.empty(self.nbytes, self.device)
        allocated = streams.record(compute)
        copier = streams.copy_stream(self.device)
        with streams.using(copier):
            streams.wait(copier, allocated)
            streams.copy(target, self.buffer[: self.nbytes])
            ready = streams.record(copier)
        self.pending = (target, ready, compute)

    def unpack(self, layout: tuple) -> torch.Tensor:
        """The saved tensor on the device; the compute stream waits for its copy, the host does not."""
        if self.resident is None:
            self.fetch()
            assert self.pending is not None
            target, self.ready, _ = self.pending
            self.pending = None
            self.resident = target.untyped_storage()
        streams = self.engine.streams
        streams.wait(streams.current(self.device), self.ready)
        dtype, size, stride, offset = layout
        return torch.empty(0, dtype=dtype, device=self.device).set_(self.resident, offset, size, stride)

    def restored(self, layout: tuple) -> torch.Tensor:
        """The saved tensor on the device by the plainest way (an unpack hook's fallback): the device drained, so
        that its copy to the host is done, then a copy back."""
        cuda_drain(self.device)
        storage = self.buffer[: self.nbytes].to(self.device, copy=True).untyped_storage()
        dtype, size, stride, offset = layout
        return torch.empty(0, dtype=dtype, device=self.device).set_(storage, offset, size, stride)

    @shielded_method(COPY_END, lambda packed: packed.engine.faults, lambda packed: packed._dropped())
    def __del__(self) -> None:
        if self.pending is not None:
            _target, ready, compute = self.pending
            self.engine.streams.wait(compute, ready)
        self.engine.pool.give(self.buffer, self.key)

    def _dropped(self) -> None:
        """The end failed: the buffer is released at once (its device drained first), not lost to the budget."""
        self.engine.pool.give(self.buffer, self.key, drop=True)


class _Packed:
    """A saved tensor: on the device (``tensor``) or in a host copy (``copy``, its ``layout`` there), and the version
    of ``source`` it was saved at (checked when it is unpacked)."""

    __slots__ = ("__weakref__", "copy", "layout", "region", "saved", "tensor")

    def __init__(
        self,
        region: _Region,
        source: torch.Tensor,
        copy: _HostCopy | None = None,
        layout: tuple | None = None,
    ) -> None:
        self.region, self.saved, self.copy, self.layout = region, SavedVersion(source), copy, layout
        self.tensor = source if copy is None else None

    def restored(self) -> torch.Tensor:
        """The saved tensor by the plainest way (an unpack hook's fallback)."""
        if self.copy is None or self.layout is None:
            assert self.tensor is not None
            return self.tensor
        return self.copy.restored(self.layout)


class _RegionHooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(
        self, engine: StreamEngine, keep: bool, layer_input: LayerInput, deferred: Sequence[torch.Tensor]
    ) -> None:
        self.engine = engine
        self.region = engine._open_region()
        region = self.region
        # Neither hook may hold a tensor: autograd keeps both hooks as long as a saved tensor (held, the input
        # would never leave the device).
        filtered, only = layer_input is not None, storage_keys(layer_input)
        later = storage_keys(deferred) if not keep else set()

        def pack(tensor: torch.Tensor) -> _Packed:
            key = storage_key(tensor)
            if filtered and key not in only:
                packed = _Packed(region, tensor)
                if key in later:
                    engine.pending.append((key, weakref.ref(packed), engine.stats.layer))
                return packed
            return engine._pack(tensor, region, keep)

        def kept(tensor: torch.Tensor) -> _Packed:
            return _Packed(region, tensor)

        faults = engine.faults
        super().__init__(faults.shield(PACK, pack, kept), faults.shield(UNPACK, engine._unpack, _Packed.restored))

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        self.engine.faults.shield(REGION_END, self.engine._close_region, nothing)(self.region)


class StreamEngine:
    """Saved-tensor hooks per checkpointed layer that overlap offload copies with compute (module docs).

    ``streams`` and ``pool`` are the device and host sides (replaceable in tests); ``modules``: whose
    parameters and registered buffers are never offloaded (nor any other parameter, by its type); ``faults``: where
    its hooks' failures are noted (:class:`~autooffload.guard.StepFaults`; a pack that fails keeps its tensor on the
    device, an unpack that fails copies it back once the device is drained).
    """

    def __init__(
        self,
        stats: OffloadStats,
        *,
        streams: Streams | None = None,
        pool: HostPool | None = None,
        min_bytes: int = MIN_BYTES,
        modules: Iterable[torch.nn.Module] = (),
        faults: StepFaults | None = None,
    ) -> None:
        self.stats = stats
        self.faults = faults if faults is not None else StepFaults()
        self.streams = streams if streams is not None else Streams()
        self.pool = pool if pool is not None else HostPool()
        self.min_bytes = min_bytes
        self._modules = [weakref.ref(module) for module in modules]
        self.held: dict[tuple[torch.device, int], list[weakref.ref]] = {}
        self._find_held()
        self._last: weakref.ref | None = None
        self._unpacking: weakref.ref | None = None
        self._serial = 0
        self._in_flight: list[tuple[int, torch.Tensor, Any, Any]] = []
        # This forward's deferred saves (:meth:`settle`), weakly: one autograd let go of has nothing left to move.
        self.pending: list[tuple[tuple, weakref.ref, int | None]] = []

    def hooks(
        self, last: bool, layer_input: LayerInput = None, deferred: Sequence[torch.Tensor] = ()
    ) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks for one call of a checkpointed layer; ``last``: the layer whose inputs stay on the device;
        ``layer_input``: the only tensors whose storages may move (any offloadable one when None); ``deferred``:
        tensors that stay on the device until the forward ends, and then move if :meth:`settle` names them."""
        return _RegionHooks(self, last, layer_input, deferred)

    def begin_forward(self) -> None:
        """A top-level forward begins: its first layer call starts a new chain, so that the backward of this
        forward never prefetches an input of an earlier one (two forwards before one backward), and the
        input the previous forward still held is let go of once its copy is done. What the previous forward
        deferred and did not settle stays on the device."""
        self._retire(before=self._serial + 1)
        self._last = None
        self.pending = []
        self._find_held()

    def settle(self, own: Sequence[torch.Tensor]) -> None:
        """The forward ended: the deferred tensors of ``own``'s storages start their copies to the host (each
        joins its layer's region, so the backward prefetches it with the rest), the others stay. The device
        tensors copied are let go of once the compute stream waits on their copies, as at a region's close, and so
        is the input the forward's last offloading layer still held: before the loss's backward, often the peak."""
        keys, pending, self.pending = storage_keys(own), self.pending, []
        for key, ref, layer in pending:
            packed = ref() if key in keys else None
            if packed is None or packed.tensor is None or packed.region.unpacked:
                continue
            self.stats.layer = layer
            moved = self._move(packed.tensor, packed.region)
            if moved is not None:
                (packed.copy, packed.layout), packed.tensor = moved, None
        self._retire(before=self._serial + 1)

    def _find_held(self) -> None:
        """Where the parameters and buffers live now (a cast or move after attach puts them elsewhere)."""
        self.held = {}
        for module in (ref() for ref in self._modules):
            for tensor in itertools.chain(module.parameters(), module.buffers()) if module is not None else ():
                key = storage_key(tensor)
                if key is not None:
                    self.held.setdefault(key, []).append(weakref.ref(tensor))

    def _open_region(self) -> _Region:
        previous = self._last() if self._last is not None else None
        self._serial += 1
        region = _Region(previous if previous is not None and not previous.unpacked else None, self._serial)
        self._last = weakref.ref(region)
        return region

    def _close_region(self, region: _Region) -> None:
        self._retire(before=region.serial)

    def _retire(self, before: int) -> None:
        """Let go of the device tensors copied in regions before ``before``, once the compute stream waits."""
        keep = []
        for serial, source, compute, done in self._in_flight:
            if serial < before:
                self.streams.wait(compute, done)
            else:
                keep.append((serial, source, compute, done))
        self._in_flight = keep

    def offloadable(self, tensor: torch.Tensor) -> bool:
        """Worth moving: a plain dense tensor, not a tiny one, and not (a view of) a parameter or buffer.

        Parameters and buffers are recognised by their storage, not by ``is_leaf and requires_grad``: with
        frozen embeddings (LoRA) transformers makes the first layer's input a leaf that requires grad, and
        only the autograd graph holds it.
        """
        return (
            type(tensor) is torch.Tensor
            and tensor.layout == torch.strided
            and not tensor.is_conj()
            and not tensor.is_neg()
            and tensor.untyped_storage().nbytes() >= self.min_bytes
            and not self._held(storage_key(tensor))
        )

    def _held(self, key: tuple[torch.device, int] | None) -> bool:
        """A parameter or buffer lives in this storage now: one seen at construction still exists and still has
        it. A block freed since (a parameter moved or cast after attach) is the allocator's again, and the
        activation it is handed to must move."""
        for ref in self.held.get(key, ()) if key is not None else ():
            tensor = ref()
            if tensor is not None and storage_key(tensor) == key:
                return True
        return False

    def _pack(self, tensor: torch.Tensor, region: _Region, keep: bool) -> _Packed:
        moved = None if keep else self._move(tensor, region)
        if moved is None:
            return _Packed(region, tensor)
        return _Packed(region, tensor, moved[0], moved[1])

    def _move(self, tensor: torch.Tensor, region: _Region) -> tuple[_HostCopy, tuple] | None:
        """``tensor``'s host copy in ``region`` (started now unless a save of its storage started it) and its layout
        there; None: it stays on the device (not worth moving, or no host buffer)."""
        if not self.offloadable(tensor):
            return None
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor._version)
        copy = region.copies.get(key)
        if copy is None:
            copy = self._offload(tensor, region)
            if copy is None:
                return None
            region.copies[key] = copy
        return copy, (tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _offload(self, tensor: torch.Tensor, region: _Region) -> _HostCopy | None:
        device, storage = tensor.device, tensor.untyped_storage()
        nbytes = storage.nbytes()
        lease = self.pool.take(nbytes, device)
        if lease is None:
            self.stats.short(nbytes)
            return None
        try:
            source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            compute = self.streams.current(device)
            produced = self.streams.record(compute)
            copier = self.streams.copy_stream(device)
            with self.streams.using(copier):
                self.streams.wait(copier, produced)
                self.streams.copy(lease[0][:nbytes], source)
                done = self.streams.record(copier)
            self._in_flight.append((region.serial, source, compute, done))
            self.stats.add(nbytes)
        except BaseException:  # the tensor stays on the device (the pack's fallback): its buffer goes back, not lost
            self.pool.give(*lease)
            raise
        return _HostCopy(self, lease, nbytes, device)

    def _unpack(self, packed: _Packed) -> torch.Tensor:
        packed.saved.check()
        region = packed.region
        first = not region.unpacked
        if first:
            self._begin_backward(region)
        if packed.copy is not None:
            packed.copy.fetch()
        if first:
            previous = region.previous() if region.previous is not None else None
            for copy in previous.copies.values() if previous is not None else ():
                copy.fetch()
        if packed.copy is None:
            return packed.tensor
        return packed.copy.unpack(packed.layout)

    def _begin_backward(self, region: _Region) -> None:
        """Layer i's recompute begins (its input is fetched next, then layer i-1's). Let go of what the
        forward still held, and of layer i+1's restored storages, held only so that several saves of one
        storage come back as one."""
        region.unpacked = True
        self._retire(before=self._serial + 1)
        done = self._unpacking() if self._unpacking is not None else None
        for copy in done.copies.values() if done is not None else ():
            copy.resident = None
        self._unpacking = weakref.ref(region)
