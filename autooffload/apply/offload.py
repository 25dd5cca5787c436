"""Apply: the saved-tensor hooks that move checkpointed inputs to host memory and back.

``save_on_cpu(pin_memory=True)`` semantics, with three differences that matter in a training run:

- Host buffers come from :class:`~autooffload.apply.host_memory.HostMemory`: exact sizes, pinned where
  a device can pin, under the node's budget, given back when unused. On a CPU-only build
  ``save_on_cpu(pin_memory=True)`` fails at the first forward; here the hooks fire and are counted on any
  machine, and a tensor already in host memory is kept as it is (there is nothing to move).
- Every byte packed is counted, per optimizer step and in total, so the controller can report it and tests
  can hold it against the arithmetic (layers x batch x seq x hidden x dtype-bytes).
- The copies stay on the compute stream (``engine="sync"``): correct by construction, and the cost that
  the controller exists to avoid paying when it is not needed.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, MutableMapping, Sequence

import torch

from ..guard import ModifiedInPlace, StepFaults, in_step, shielded_method
from ..observe.saved import storage_key
from .host_memory import HostBuffer, HostMemory

PACK = in_step("the sync engine's pack hook")
UNPACK = in_step("the sync engine's unpack hook")
RETURN = in_step("a host buffer's return")


@dataclasses.dataclass
class OffloadStats:
    """Bytes moved to host memory: in the current optimizer step, and since training began; and bytes an engine
    was to move but kept on the device for want of host memory (the budget full, the host short, an allocation
    failed), with the planned layers they belong to in the running micro-batch (``layer``: the layer whose
    offloading call is packing, which the switch sets before the call)."""

    step_bytes: int = 0
    total_bytes: int = 0
    tensors: int = 0
    step_short_bytes: int = 0
    short_bytes: int = 0
    layer: int | None = None
    short_layers: set[int] = dataclasses.field(default_factory=set)

    def add(self, nbytes: int) -> None:
        self.step_bytes += nbytes
        self.total_bytes += nbytes
        self.tensors += 1

    def short(self, nbytes: int) -> None:
        """A saved input of ``nbytes`` stays on the device: no host buffer could take it."""
        self.step_short_bytes += nbytes
        self.short_bytes += nbytes
        if self.layer is not None:
            self.short_layers.add(self.layer)

    def take_short_layers(self) -> set[int]:
        """The planned layers that kept an input on the device since the last take (one micro-batch)."""
        layers, self.short_layers = self.short_layers, set()
        return layers

    def next_step(self) -> int:
        """Close the step: return its bytes moved and start counting the next one (its bytes kept short too)."""
        moved = self.step_bytes
        self.step_bytes = self.step_short_bytes = 0
        return moved


LayerInput = torch.Tensor | Sequence[torch.Tensor] | None  # the tensors whose storages may move (None: any)


def storage_keys(layer_input: LayerInput) -> set:
    """The storage keys of ``layer_input``: one tensor, several (a layer's input and its own second activations)."""
    if layer_input is None:
        return set()
    tensors = (layer_input,) if isinstance(layer_input, torch.Tensor) else tuple(layer_input)
    return {key for key in (storage_key(tensor) for tensor in tensors) if key is not None}


class _Loan:
    """A host buffer lent to one saved tensor; back to the manager when autograd lets go of the tensor."""

    __slots__ = ("buffer", "faults", "host")

    def __init__(self, host: HostMemory, buffer: HostBuffer, faults: StepFaults) -> None:
        self.host, self.buffer, self.faults = host, buffer, faults

    @shielded_method(RETURN, lambda loan: loan.faults, lambda loan: loan.host.give(loan.buffer, drop=True))
    def __del__(self) -> None:
        self.host.give(self.buffer)


class SavedVersion:
    """What autograd checks of a saved tensor and saved-tensor hooks skip: its version when it was saved. The
    backward raises (:class:`~autooffload.guard.ModifiedInPlace`) where the tensor was modified in place since, as
    it does without hooks; held weakly (a tensor moved to host memory must be free to go), so one modified and then
    let go of before the backward passes unseen."""

    __slots__ = ("shape", "source", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.version = tuple(tensor.shape), _version(tensor)
        self.source: Callable[[], torch.Tensor | None]
        try:
            self.source = weakref.ref(tensor)
        except TypeError:  # a tensor kind without weak references: not checked
            self.source = lambda: None

    def check(self) -> None:
        tensor = self.source()
        if tensor is not None:
            _check(tensor, self.version, self.shape)


def _check(tensor: torch.Tensor, version: int | None, shape: tuple) -> None:
    now = _version(tensor)
    if version is not None and now is not None and now != version:
        raise ModifiedInPlace(shape, now, version)


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (None where it has none: an inference tensor, some subclasses)."""
    try:
        return tensor._version
    except (RuntimeError, AttributeError):
        return None


def _held(tensor: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    return tensor, _version(tensor)


def _released(held: tuple[torch.Tensor, int | None]) -> torch.Tensor:
    tensor, version = held
    _check(tensor, version, tuple(tensor.shape))
    return tensor


def kept_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that keep every tensor as it is, and check its version as autograd would."""
    return torch.autograd.graph.saved_tensors_hooks(_held, _released)


class _HostStorage:
    """A device storage copied whole into a host buffer, once per layer call however many views of it the call saves
    (LUKE's word and entity states: two views of one tensor, at two offsets). In the backward it comes back as one
    device storage and each view as a view of it, at its own offset and strides: a copy of a view alone comes back
    contiguous, and the recompute then runs other kernels than the forward did (and saves other tensors, which
    non-reentrant checkpointing refuses). The restored storage is held until every view saved has been unpacked
    once, so that they share it; the views hold it after that."""

    __slots__ = ("__weakref__", "device", "loan", "nbytes", "resident", "unpacked", "views")

    def __init__(self, loan: _Loan, nbytes: int, device: torch.device) -> None:
        self.loan, self.nbytes, self.device = loan, nbytes, device
        self.resident: torch.UntypedStorage | None = None
        self.views = self.unpacked = 0

    def view(self, layout: tuple, fresh: bool = False) -> torch.Tensor:
        """A saved view back on the device (``fresh``: from a storage of its own, an unpack hook's fallback)."""
        storage = self.resident if not fresh else None
        if storage is None:
            target = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            target.copy_(self.loan.buffer.tensor[: self.nbytes], non_blocking=self.loan.buffer.pinned and not fresh)
            storage = target.untyped_storage()
        if not fresh:
            self.unpacked += 1
            self.resident = storage if self.unpacked < self.views else None
        dtype, size, stride, offset = layout
        return torch.empty(0, dtype=dtype, device=self.device).set_(storage, offset, size, stride)


class _Saved:
    """A packed tensor: on the device (``loan`` None), in a host buffer, or a view of a storage in one (``whole``,
    at ``layout``); and the version it was saved at (checked when it is unpacked). A deferred one may move later,
    when the forward ends (:meth:`SyncEngine.settle`), so it is mutable."""

    __slots__ = ("__weakref__", "device", "layout", "loan", "saved", "tensor", "whole")

    def __init__(self, tensor: torch.Tensor, stored: torch.Tensor | None = None, loan: _Loan | None = None) -> None:
        self.device, self.saved = tensor.device, SavedVersion(tensor)
        self.tensor, self.loan = (tensor if stored is None else stored), loan
        self.whole: _HostStorage | None = None
        self.layout: tuple = ()

    @staticmethod
    def kept(tensor: torch.Tensor) -> _Saved:
        """``tensor`` kept where it is, as plain checkpointing keeps it (a pack hook's fallback)."""
        return _Saved(tensor)

    def restored(self) -> torch.Tensor:
        """The tensor back on its device by the plainest way (an unpack hook's fallback): a copy of a host one."""
        if self.whole is not None:
            return self.whole.view(self.layout, fresh=True)
        if self.loan is None:
            return self.tensor if self.tensor.device == self.device else self.tensor.to(self.device)
        return self.tensor.to(self.device, copy=True)


def _storage_to_host(
    tensor: torch.Tensor, stats: OffloadStats, host: HostMemory, faults: StepFaults, copies: MutableMapping
) -> _Saved:
    """``tensor`` packed as a view of its whole storage in host memory, the storage copied and counted once per layer
    call (``copies``: this call's, by storage and version), so that a tensor and views of it saved in one call come
    back as views of one storage; kept on the device where no host buffer can take it."""
    storage = tensor.untyped_storage()
    key = (tensor.device, storage.data_ptr(), tensor._version)
    whole = copies.get(key)
    if whole is None:
        nbytes = storage.nbytes()
        buffer = host.take(nbytes, tensor.device)
        if buffer is None:
            stats.short(nbytes)
            return _Saved(tensor)
        try:
            source = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            buffer.tensor[:nbytes].copy_(source, non_blocking=buffer.pinned)
            stats.add(nbytes)
        except BaseException:  # the tensor stays on the device (the pack's fallback): its buffer goes back, not lost
            host.give(buffer)
            raise
        whole = copies[key] = _HostStorage(_Loan(host, buffer, faults), nbytes, tensor.device)
    saved = _Saved(tensor)
    saved.tensor, saved.whole = None, whole  # type: ignore[assignment]  # no tensor of its own: read via whole
    saved.layout = (tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset())
    whole.views += 1
    return saved


def _to_host(
    tensor: torch.Tensor,
    stats: OffloadStats,
    host: HostMemory,
    faults: StepFaults,
    copies: MutableMapping | None = None,
) -> _Saved:
    """``tensor`` packed into host memory, counted; kept on the device where no host buffer can take it. Where the
    call's ``copies`` are given, a strided tensor moves as its storage (:func:`_storage_to_host`): a view into a
    larger one, or a tensor whose views the call saves too, moves that storage once."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type == "cpu" and not (host.pin or host.copy_cpu):
        stats.add(nbytes)
        return _Saved(tensor)
    if copies is not None and not tensor.is_sparse and tensor.layout == torch.strided:
        return _storage_to_host(tensor, stats, host, faults, copies)  # a tensor and a view of it: one storage
    if tensor.is_sparse or not tensor.is_contiguous():
        stats.add(nbytes)
        return _Saved(tensor, tensor.to("cpu", copy=True))
    buffer = host.take(nbytes, tensor.device)
    if buffer is None:
        stats.short(nbytes)
        return _Saved(tensor)
    try:
        view = buffer.tensor[:nbytes].view(tensor.dtype).view(tensor.shape)
        # Into pinned memory the copy is queued on the compute stream; the caching allocator reuses the source's
        # block only for work queued after it on that same stream, so freeing it is safe. The buffer is written
        # again only by a later pack, queued on that stream after this unpack's copy.
        view.copy_(tensor, non_blocking=buffer.pinned)
        saved = _Saved(tensor, view)
        stats.add(nbytes)
    except BaseException:  # the tensor stays on the device (the pack's fallback): its buffer goes back, not lost
        host.give(buffer)
        raise
    saved.loan = _Loan(host, buffer, faults)
    return saved


class HostOffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks: pack copies a tensor to host memory from ``host``, unpack copies it back.

    A tensor the budget or the host cannot take stays on the device. A view into a larger storage moves as that
    storage, once per call however many of its views the call saves, and comes back at its offset and strides
    (:class:`_HostStorage`); any other non-contiguous one goes to a pageable copy of its own. A tensor already in
    host memory is kept as it is, unless ``host`` pins (on a CPU-only build it never does; tests inject the pinning)
    or stands for the host of a simulated device (``host.copy_cpu``). A tensor of ``deferred`` stays on the device
    and goes to ``defer``, for :meth:`SyncEngine.settle` to move when the forward ends. Both hooks run shielded
    (``faults``, :mod:`autooffload.guard`): a pack that fails keeps its tensor on the device, an unpack that fails
    copies it back.
    """

    def __init__(
        self,
        stats: OffloadStats,
        host: HostMemory,
        layer_input: LayerInput = None,
        deferred: Sequence[torch.Tensor] = (),
        defer: Callable[[tuple | None, _Saved], None] | None = None,
        faults: StepFaults | None = None,
    ) -> None:
        faults = faults if faults is not None else StepFaults()
        # Neither hook may hold a tensor: autograd keeps both hooks as long as a saved tensor (held, the input
        # would never leave the device).
        filtered, only, later = layer_input is not None, storage_keys(layer_input), storage_keys(deferred)
        copies: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # this call's storages moved whole

        def pack(tensor: torch.Tensor) -> _Saved:
            key = storage_key(tensor)
            if filtered and key not in only:
                saved = _Saved(tensor)
                if key in later and defer is not None:
                    defer(key, saved)
                return saved
            return _to_host(tensor, stats, host, faults, copies)

        def unpack(saved: _Saved) -> torch.Tensor:
            saved.saved.check()
            if saved.whole is not None:
                return saved.whole.view(saved.layout)
            if saved.loan is None:
                tensor = saved.tensor
                return tensor if tensor.device == saved.device else tensor.to(saved.device)
            restored = torch.empty(saved.tensor.shape, dtype=saved.tensor.dtype, device=saved.device)
            restored.copy_(saved.tensor, non_blocking=saved.loan.buffer.pinned)
            return restored

        super().__init__(faults.shield(PACK, pack, _Saved.kept), faults.shield(UNPACK, unpack, _Saved.restored))


class SyncEngine:
    """``engine="sync"``: every offloading layer call runs under :class:`HostOffloadHooks`, the last one too;
    of the tensors it saves, only the storages of the layer's inputs move (all of them when none is named), and
    those of its deferred tensors when the forward ends, if they are its own (:meth:`settle`)."""

    def __init__(self, stats: OffloadStats, host: HostMemory | None = None, faults: StepFaults | None = None) -> None:
        self.stats = stats
        self.host = host if host is not None else HostMemory()
        self.faults = faults if faults is not None else StepFaults()
        # This forward's deferred saves, weakly (one autograd let go of has nothing left to move), with their layer.
        self.pending: list[tuple[tuple | None, weakref.ref, int | None]] = []

    def hooks(
        self, last: bool, layer_input: LayerInput = None, deferred: Sequence[torch.Tensor] = ()
    ) -> HostOffloadHooks:
        return HostOffloadHooks(self.stats, self.host, layer_input, deferred, self._defer, self.faults)

    def _defer(self, key: tuple | None, saved: _Saved) -> None:
        # Through the engine, not a list the hooks hold: autograd keeps a pack hook while its saves live, and a list
        # it held would keep every other layer's deferred saves alive with it.
        self.pending.append((key, weakref.ref(saved), self.stats.layer))

    def begin_forward(self) -> None:
        """Nothing links one layer call to another here; what an earlier forward deferred stays where it is."""
        self.pending = []

    def settle(self, own: Sequence[torch.Tensor]) -> None:
        """The forward ended: the deferred tensors of ``own``'s storages move to host memory, the others stay."""
        keys, pending, self.pending = storage_keys(own), self.pending, []
        for key, ref, layer in pending:
            saved = ref() if key in keys else None
            if saved is not None and saved.loan is None and saved.whole is None:
                self.stats.layer = layer
                moved = _to_host(saved.tensor, self.stats, self.host, self.faults)
                saved.tensor, saved.loan = moved.tensor, moved.loan
