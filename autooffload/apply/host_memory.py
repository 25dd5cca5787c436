"""Host memory for offloaded inputs: one manager for both engines, sized to a budget, really given back.

torch's pinned allocator (``empty(pin_memory=True)``) rounds every block up to a power of two and keeps
freed blocks pinned until the process ends. Here each buffer is an anonymous ``mmap`` of the size asked,
rounded up to a 4 KiB page, then pinned with ``cudaHostRegister`` (what torch's own checkpoint stager does);
releasing one unregisters it and unmaps it, so the memory goes back to the operating system.

- **Reuse.** A buffer given back waits in a free list (per device, so only copies on that device's stream
  ever touch it, in order) and serves the next request it fits, the smallest first, where the budget holds it
  beside what the micro-batch still expects (:meth:`HostMemory.expect`); otherwise a new buffer of the request's
  size is taken, the larger free ones released first to make room. A free buffer more than ``SLACK`` times the
  request is lent only where no new buffer of the request's size fits under the budget: lent to a short
  micro-batch's input, a long one's buffer holds budget a later forward of the same step needs (a short and a long
  forward before one backward: the long one's inputs stayed on the device), while a small new one pins cheaply.
- **Budget.** The bytes held (in use and free) never exceed ``budget_bytes``: a request that would is
  first met by releasing free buffers (the oversized ones first, largest first, then the smaller ones), and
  refused if that is not enough; the caller keeps that tensor on the device (and the record says so:
  :class:`~autooffload.apply.offload.OffloadStats` counts it). The controller plans under the same budget, so
  a refusal is the exception (a first guess of the layer size that was too small).
- **Host free memory.** A new buffer is taken only while ``min_free`` of the memory under the tightest limit on
  this process stays free after it: the machine's, a container's (cgroup v2 ``memory.max``/``memory.high``, v1
  ``memory.limit_in_bytes``) or the process's own (``RLIMIT_AS``, ``RLIMIT_DATA``), whichever leaves the least
  (:mod:`autooffload.observe.host_limits`). The ``auto`` budget is half of what that leaves at start. Buffers
  already held are reused without asking: they are not free memory, but they are ours.
- **Release.** Pinning is slow (on an H200 machine 3.4 GiB of new buffers added 1.59 s to a 2.04 s step;
  ``benchmarks/host_pinning.py``), and a long micro-batch that comes back after short ones must find its buffers.
  So a free buffer is released when the host runs short (less than ``min_free`` free after an optimizer step: of
  the buffers that step did not use, the longest unused first, as many as the host lacks), after ``release_after``
  idle optimizer steps, to make room under the budget, and when the manager goes. Before a release each device
  whose buffers go is drained once (all its streams), so no copy in flight reads a page being unmapped.
- **Pinning ahead** (opt-in until a GPU shows it faster: ``PREPARE_THREADS``). A new buffer costs its page faults
  and its registration (3.1 GB/s on an H200 machine: 1.2 s for a 32k-token micro-batch's 3.4 GiB, inside its
  forward; ``benchmarks/host_pinning.py``). With ``prepare_threads`` > 0, once the controller says what a
  micro-batch will ask for (:meth:`HostMemory.expect`), on one CUDA device, the buffers no free one serves are
  mapped and pinned on that many threads (registering releases the GIL) while the forward computes; a request
  waits only for its own (``pin_seconds``: the time the step waited).
- **Pinning that fails** (WSL's 1-2 GiB cap, a driver or container limit): the buffer stays pageable, one warning.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Iterable
from operator import attrgetter

import torch

from ..guard import StepFaults, in_step, nothing, shielded_method
from ..observe.host_limits import Limit, host_memory, read_limits
from ..settings import PAGE
from ..warn import WarnOnce
from .host_budget import process_budget, ranks_per_node
from .pinning import cuda_drain, cuda_register, cuda_unregister, pageable

FINALIZER = in_step("host memory's finalizer")
MIN_FREE = 0.10
RELEASE_AFTER_STEPS = 256
_age, _size = attrgetter("last_step"), attrgetter("nbytes")  # sort keys of buffers
SLACK = 2  # without expect(): a free buffer serves a request of at least 1 / SLACK of its size
PREPARE_THREADS = 0  # threads that map and pin a micro-batch's new buffers ahead of its forward (0: in the step)
PREPARE_WAIT_S = 30.0  # the longest a request waits for a buffer being prepared before it makes its own


def page_round(nbytes: int) -> int:
    return -(-max(nbytes, 1) // PAGE) * PAGE


def _pinning_available() -> bool:
    return torch.cuda.is_available()


@dataclasses.dataclass(eq=False)
class HostBuffer:
    """One buffer the manager owns: ``tensor`` (uint8, ``nbytes`` long), pinned or not, for ``device``."""

    tensor: torch.Tensor
    pinned: bool
    device: torch.device
    last_step: int = 0

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()


class HostMemory:
    """Host buffers for offloaded inputs under a byte budget (module docs).

    ``budget_bytes``: this process's share; None until the controller sets it (no limit meanwhile).
    ``pin``: pin buffers (default: where CUDA is available). ``copy_cpu``: a tensor already in host memory is
    copied into a buffer too (a simulated device that lives in the CPU's memory, such as
    :class:`~autooffload.observe.simulated.SimulatedDevice`: its offloaded inputs must leave torch's allocator,
    as they would leave a GPU's). The functions are the hardware surface, and
    what tests replace: ``allocate(nbytes)`` a pageable buffer, ``register``/``unregister`` pin and unpin it
    in place, ``drain(device)`` waits for that device before a release, ``memory()`` reads (available, total) under the
    tightest limit, ``limits()`` every limit that applies (:mod:`autooffload.observe.host_limits`).
    """

    def __init__(
        self,
        budget_bytes: int | None = None,
        *,
        pin: bool | None = None,
        copy_cpu: bool = False,
        allocate: Callable[[int], torch.Tensor] = pageable,
        register: Callable[[torch.Tensor], None] = cuda_register,
        unregister: Callable[[torch.Tensor], None] = cuda_unregister,
        drain: Callable[[torch.device], None] = cuda_drain,
        memory: Callable[[], tuple[int, int]] = host_memory,
        limits: Callable[[], list[Limit]] = read_limits,
        min_free: float = MIN_FREE,
        release_after: int = RELEASE_AFTER_STEPS,
        prepare_threads: int | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.pin = _pinning_available() if pin is None else pin
        self.copy_cpu = copy_cpu
        self.allocate, self.register, self.unregister, self.drain = allocate, register, unregister, drain
        self.memory, self.limits = memory, limits
        self.budget_source = "the caller"  # what set budget_bytes: a limit's name, or the setting
        self.min_free = min_free
        self.release_after = release_after
        self.pinning_failed = False
        self.held_bytes = 0
        self.lent_bytes = 0  # held bytes on loan (the rest are free)
        self._expected = 0  # bytes the running micro-batch is still expected to ask for (expect)
        self._told = False  # expect() was called: larger free buffers are lent where the budget holds the rest
        self.pinned_bytes = 0
        self.peak_held_bytes = 0
        # Running totals (autooffload.observe.costs): requests, new buffers, pinned ones and the time pinning took,
        # releases, and host waits for the device (a drain; a copy to or from a buffer that is not pinned: two).
        self.takes = self.allocations = self.registrations = self.releases = self.syncs = 0
        self.pin_seconds, self.step = 0.0, 0
        self._free: dict[torch.device, list[HostBuffer]] = {}
        self._lock = threading.RLock()  # give() runs from finalizers, possibly inside take() on this thread
        self._landed = threading.Condition(self._lock)  # a buffer prepared ahead joined the free list
        self._preparing: list[int] = []  # sizes being prepared ahead, in the order they will be asked for
        self.devices: tuple[torch.device, ...] = ()  # the model's, where the controller said (set_budget)
        self.prepare_threads = prepare_threads if prepare_threads is not None else PREPARE_THREADS
        self.warn = WarnOnce()
        self.closed = False  # from release_all to set_budget (the next attach): a buffer given back is released

    def expect(self, sizes: Iterable[int]) -> None:
        """The micro-batch about to run will ask for buffers of these sizes (its planned layers' inputs, which the
        controller capped at what the budget holds): a free buffer larger than a request is lent only where the
        rest of them still fit beside it, and those no free buffer serves are prepared ahead (module docs)."""
        sizes = [page_round(n) for n in sizes]
        with self._lock:
            self._expected = sum(sizes)
            self._told = True
            cuda = [device for device in self.devices if device.type == "cuda"]
            if self.pin and not self.pinning_failed and self.prepare_threads > 0 and len(cuda) == 1:
                self._prepare(sizes, cuda[0])

    def _prepare(self, sizes: list[int], device: torch.device) -> None:
        """Map and pin, on threads, the buffers of ``sizes`` that no free buffer (nor one already being prepared)
        serves, as far as the budget and the host's free memory allow without releasing anything."""
        spare = sorted([b.nbytes for b in self._free.get(device, [])] + self._preparing)
        needed = []
        for size in sizes:
            fit = next((i for i, have in enumerate(spare) if have >= size), None)
            if fit is None:
                needed.append(size)
            else:
                del spare[fit]
        if not needed:
            return
        available, total = self.memory()
        budget = self.budget_bytes if self.budget_bytes is not None else available
        room = min(budget - self.held_bytes - sum(self._preparing), available - self.min_free * total)
        while needed and sum(needed) > room:
            needed.pop()
        queue = list(needed)
        self._preparing += needed
        for _ in range(min(self.prepare_threads, len(needed))):
            threading.Thread(target=self._prepare_from, args=(queue, device), daemon=True).start()

    def _prepare_from(self, queue: list[int], device: torch.device) -> None:
        """One preparing thread: the next size of ``queue`` until none is left; each buffer joins the free list."""
        while True:
            with self._lock:
                if not queue:
                    return
                size = queue.pop(0)
            tensor, error = None, None
            try:
                tensor = self.allocate(size)
                self.register(tensor)
            except Exception as failed:  # take() makes an unmapped one itself; a failed pinning warns below
                error = failed
            with self._landed:
                try:
                    if tensor is not None:
                        if error is not None:
                            self._pin_failed(error)
                        self.registrations += error is None
                        self._count_new(HostBuffer(tensor, error is None, device, self.step), size, lent=False)
                finally:  # whatever happened, no request waits for this one any longer
                    self._preparing.remove(size)
                    self._landed.notify_all()

    def _wait_for_prepared(self, nbytes: int, device: torch.device | None) -> None:
        """Where no free buffer fits ``nbytes`` but one being prepared ahead will, wait for it to land; with no
        ``device``, for all of them (the wait counts in ``pin_seconds``: the step's time spent on pinning)."""
        began = time.perf_counter()
        while any(size >= nbytes for size in self._preparing) and not any(
            b.nbytes >= nbytes for b in self._free.get(device, [])
        ):
            if not self._landed.wait(timeout=PREPARE_WAIT_S):
                break
        self.pin_seconds += time.perf_counter() - began

    def take(self, nbytes: int, device: torch.device) -> HostBuffer | None:
        """A buffer of at least ``nbytes`` for a tensor on ``device``; None if the budget or the host is short.

        The smallest free buffer that fits serves it where the budget holds that buffer beside what the micro-batch
        still expects (:meth:`expect`), if it is at most ``SLACK`` times the request or, larger, where no new buffer
        of the request's size fits under the budget (and :meth:`expect` was called); otherwise a new buffer of the
        request's size, room under the budget made by releasing free buffers, the oversized ones first; a larger
        free one is lent still where no new buffer can be had (the host is short, or allocating failed). Lent to a
        short micro-batch's small input, a long one's buffer would hold the budget its other inputs need, or a
        long forward's after it in the same step."""
        with self._lock:
            size, self.takes = page_round(nbytes), self.takes + 1
            self._wait_for_prepared(nbytes, device)
            self._expected = expected = max(self._expected - size, 0)  # what this micro-batch asks for after this
            free = self._free.get(device, [])
            fits = sorted((b for b in free if b.nbytes >= nbytes), key=_size)
            budget = self.budget_bytes
            room = budget is None or self.held_bytes + size <= budget  # a new buffer fits without a release
            snug = fits and (fits[0].nbytes <= SLACK * size or (self._told and not room))
            if snug and (budget is None or self.lent_bytes + fits[0].nbytes + expected <= budget):
                return self._lend(fits[0])
            available, total = self.memory()
            if available - size < self.min_free * total:
                if fits:
                    return self._lend(fits[0])  # not free memory, but ours to hand out
                self.warn(
                    "host-short",
                    f"host memory is short ({available / 2**30:.1f} GiB available of {total / 2**30:.1f} GiB, "
                    f"{self.min_free:.0%} is kept free); saved inputs that do not fit in the host buffers "
                    "already held stay on the device",
                )
                return None
            if budget is not None and self.held_bytes + sum(self._preparing) + size > budget:
                self._wait_for_prepared(0, None)  # they land free, to be released for room, not held beside it
                smaller = sorted((b for bs in self._free.values() for b in bs if b.nbytes < nbytes), key=_size)
                oversized = sorted((b for bs in self._free.values() for b in bs if b.nbytes >= nbytes), key=_size)
                self._release([*reversed(oversized), *smaller], size)
            if budget is not None and self.held_bytes + size > budget:
                self.warn(
                    "host-budget",
                    f"the host memory budget ({budget / 2**20:.1f} MiB for this process, "
                    f"AUTOOFFLOAD_HOST_MEMORY) is full ({self.held_bytes / 2**20:.1f} MiB held); saved inputs "
                    "that do not fit stay on the device",
                )
                return None
            buffer = self._new(size, device)
            if buffer is None and fits and fits[0] in free:
                return self._lend(fits[0])
            return buffer

    def _lend(self, buffer: HostBuffer) -> HostBuffer:
        self._free[buffer.device].remove(buffer)
        buffer.last_step = self.step
        self.lent_bytes += buffer.nbytes
        self.syncs += 2 if not buffer.pinned and buffer.device.type == "cuda" else 0
        return buffer

    def set_budget(self, setting: str, devices: Iterable[torch.device] = ()) -> None:
        """This process's share of host memory for offload (``setting``: ``AUTOOFFLOAD_HOST_MEMORY``) under every
        limit that applies (:func:`process_budget`), unless a budget is set; ``devices``: the model's, for the
        buffers prepared ahead."""
        self.devices, self.closed = tuple(devices), False
        if self.budget_bytes is None:
            self.budget_bytes, self.budget_source = process_budget(setting, self.limits(), ranks_per_node())

    def describe(self, setting: str) -> str:
        """The budget, for the log line at attach (``setting``: ``AUTOOFFLOAD_HOST_MEMORY``)."""
        return (
            f"host memory budget {(self.budget_bytes or 0) / 2**20:.1f} MiB for this rank (AUTOOFFLOAD_HOST_MEMORY="
            f"{setting} over {ranks_per_node()} rank(s) of the node, set by {self.budget_source})"
        )

    def give(self, buffer: HostBuffer, drop: bool = False) -> None:
        """Return a buffer; only later copies on its device's stream may touch it (the caller's rule). Released at once
        with ``drop`` (a return that failed) or after :meth:`release_all` (lent at a give-up, back in its backward)."""
        with self._lock:
            buffer.last_step, self.lent_bytes = self.step, self.lent_bytes - buffer.nbytes
            self._free.setdefault(buffer.device, []).append(buffer)
            if drop or self.closed:
                self._release([buffer], None)

    def end_step(self) -> None:
        """An optimizer step ended: release the free buffers unused for ``release_after`` steps and, where the host
        is short, of those the step that ended did not use, the longest unused first, as many as bring it back to
        ``min_free`` free (all of them would be pinned again by the next micro-batch that needs them)."""
        with self._lock:
            self.step += 1
            free = [b for bs in self._free.values() for b in bs]
            idle = [b for b in free if self.step - b.last_step >= self.release_after]
            self._release(idle, None)
            # The step that ended took its buffers at step - 1: they stay.
            unused = sorted((b for b in free if b not in idle and self.step - b.last_step >= 2), key=_age)
            shortfall = self._shortfall() if unused else 0
            going = []
            for buffer in unused:
                if shortfall <= 0:
                    break
                going.append(buffer)
                shortfall -= buffer.nbytes
            self._release(going, None)

    def _shortfall(self) -> int:
        """Bytes the host lacks to keep ``min_free`` free (0 where it has them, or cannot say)."""
        try:
            available, total = self.memory()
        except (OSError, ValueError):
            return 0
        return max(int(self.min_free * total) - available, 0)

    def release_all(self) -> None:
        """Release every free buffer (end of training) once those prepared ahead landed, lent ones as they come back."""
        with self._landed:
            self.closed = True
            self._wait_for_prepared(0, None)
            self._release([b for bs in self._free.values() for b in bs], None)

    @shielded_method(FINALIZER, lambda host: StepFaults(), nothing)  # at worst the pages stay pinned
    def __del__(self, _finalizing=sys.is_finalizing) -> None:
        # Nothing is on loan (a loan holds its manager), so every buffer is free: unpin before the mappings go (a range
        # left registered stays pinned, and may refuse a later registration). ``sys`` may be gone at exit: bound here.
        if _finalizing():
            return
        self.release_all()

    def _new(self, size: int, device: torch.device) -> HostBuffer | None:
        try:
            tensor = self.allocate(size)
        except (RuntimeError, OSError, MemoryError) as error:
            self.warn("host-failed", f"a host buffer could not be allocated ({error}); inputs stay on the device")
            return None
        pinned = self.pin and self._pin(tensor)
        buffer = HostBuffer(tensor, pinned, device, self.step)
        self._count_new(buffer, size, lent=True)
        self.syncs += 2 if not pinned and device.type == "cuda" else 0
        return buffer

    def _count_new(self, buffer: HostBuffer, size: int, lent: bool) -> None:
        """A new buffer is held: lent at once (``lent``) or, prepared ahead, free."""
        self.allocations += 1
        self.held_bytes += size
        self.lent_bytes += size if lent else 0
        self.pinned_bytes += size if buffer.pinned else 0
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        if not lent:
            self._free.setdefault(buffer.device, []).append(buffer)

    def _pin(self, tensor: torch.Tensor) -> bool:
        if self.pinning_failed:
            return False
        began = time.perf_counter()
        try:
            self.register(tensor)
            self.registrations += 1
        except Exception as error:  # a cap on pinned memory must not end the step
            self._pin_failed(error)
            return False
        finally:
            self.pin_seconds += time.perf_counter() - began
        return True

    def _pin_failed(self, error: Exception) -> None:
        self.pinning_failed = True
        self.warn(
            "pin-failed",
            f"pinning host memory failed ({error}) with {self.pinned_bytes / 2**20:.1f} MiB pinned; offload "
            "continues with pageable memory, whose copies do not overlap compute (slower, still correct)",
        )

    def _release(self, buffers: list[HostBuffer], needed: int | None) -> None:
        """Release ``buffers`` in order; with ``needed``, only until that many more bytes fit the budget."""
        drained: set[torch.device] = set()
        for buffer in buffers:
            if needed is not None and self.held_bytes + needed <= (self.budget_bytes or 0):
                break
            if buffer.pinned and buffer.device not in drained:
                self.drain(buffer.device)
                drained.add(buffer.device)
                self.syncs += 1
            self._free[buffer.device].remove(buffer)
            if buffer.pinned:
                self.unregister(buffer.tensor)
                self.pinned_bytes -= buffer.nbytes
            self.held_bytes -= buffer.nbytes
            self.releases += 1
            buffer.tensor = torch.empty(0, dtype=torch.uint8)
