"""Host memory for offloaded inputs: one manager for both engines, sized to a budget, really given back.

torch's pinned allocator (``empty(pin_memory=True)``) rounds every block up to a power of two and keeps
freed blocks pinned until the process ends. Here each buffer is an anonymous ``mmap`` of the size asked,
rounded up to a 4 KiB page, then pinned with ``cudaHostRegister`` (what torch's own checkpoint stager does);
releasing one unregisters it and unmaps it, so the memory goes back to the operating system.

- **Reuse.** A buffer given back waits in a free list (per device, so only copies on that device's stream
  ever touch it, in order) and serves the next request it fits, the smallest first.
- **Budget.** The bytes held (in use and free) never exceed ``budget_bytes``: a request that would is
  first met by releasing free buffers (all smaller than it, or one would have served it), and refused if
  that is not enough; the caller keeps that tensor on the device. The controller plans under the same
  budget, so a refusal is the exception (a first guess of the layer size that was too small).
- **Host free memory.** A new buffer is taken only while the host keeps ``min_free`` of its memory free
  after it. Buffers already held are reused without asking: they are not free memory, but they are ours.
- **Release.** A free buffer unused for ``release_after`` optimizer steps is released (offload off for a
  while, or sizes that no longer come), and so is every buffer when the manager itself goes. Before a
  release each device whose buffers go is drained once (all its streams), so no copy still in flight
  reads a page that is being unmapped.
- **Pinning that fails** (WSL caps pinned memory at 1-2 GiB; a driver or container limit): the buffer
  stays pageable, with one warning, and so do later ones; copies into it do not overlap compute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import sys
import threading
from collections.abc import Callable

import torch

from ..settings import PAGE, parse_host_memory
from ..warn import WarnOnce

MIN_FREE = 0.10
RELEASE_AFTER_STEPS = 4


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory, from psutil, or /proc/meminfo where psutil is missing."""
    try:
        import psutil
    except ImportError:
        with open("/proc/meminfo") as meminfo:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo}
        return fields["MemAvailable"], fields["MemTotal"]
    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


LOCAL_SIZE_VARIABLES = (
    "LOCAL_WORLD_SIZE",  # torchrun, accelerate
    "LOCAL_SIZE",  # the deepspeed launcher
    "OMPI_COMM_WORLD_LOCAL_SIZE",  # Open MPI
    "MPI_LOCALNRANKS",  # MPICH, Intel MPI
    "MV2_COMM_WORLD_LOCAL_SIZE",  # MVAPICH
)


def ranks_per_node() -> int:
    """How many processes of the job share this host, from the first launcher variable set
    (:data:`LOCAL_SIZE_VARIABLES`), else 1."""
    for name in LOCAL_SIZE_VARIABLES:
        try:
            return max(1, int(os.environ[name]))
        except (KeyError, ValueError):
            continue
    return 1


def node_budget(setting: str, memory: Callable[[], tuple[int, int]] = host_memory) -> int:
    """Bytes of host memory the whole node may hold for offload, from ``AUTOOFFLOAD_HOST_MEMORY``.

    A fraction is of total RAM; ``auto`` is half of what is available now (at start).
    """
    kind, value = parse_host_memory(setting)
    if kind == "bytes":
        return int(value)
    available, total = memory()
    return int(value * (available if kind == "auto" else total))


def page_round(nbytes: int) -> int:
    return -(-max(nbytes, 1) // PAGE) * PAGE


def pageable(nbytes: int) -> torch.Tensor:
    """An anonymous mapping of ``nbytes`` (a multiple of the page size) as a uint8 tensor; unmapped when the
    tensor dies, so the memory really goes back to the operating system."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def cuda_register(buffer: torch.Tensor) -> None:
    """Pin ``buffer`` in place (``cudaHostRegister``, portable across devices)."""
    code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 1))
    if code != 0:
        consume_cuda_error()
        raise RuntimeError(f"cudaHostRegister failed with cudaError {code}")


def cuda_unregister(buffer: torch.Tensor) -> None:
    if int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())) != 0:
        consume_cuda_error()


def consume_cuda_error() -> None:
    """Clear the CUDA runtime's last error after a failed call torch does not check (its cudart bindings
    return the code and leave the error set): torch's next kernel launch would otherwise raise it, in the
    middle of a step. A launch of torch's own reads and clears it; that one is caught here."""
    with contextlib.suppress(RuntimeError):
        launch_kernel()


def launch_kernel() -> None:
    torch.zeros(1, dtype=torch.uint8, device="cuda")


def cuda_drain(device: torch.device) -> None:
    """Wait for every stream of ``device`` (the copy streams too); ``synchronize()`` alone waits only for
    the current device, and a process may drive several."""
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)


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
    in place, ``drain(device)`` waits for that device before a release, ``memory()`` reads (available, total).
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
        min_free: float = MIN_FREE,
        release_after: int = RELEASE_AFTER_STEPS,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.pin = _pinning_available() if pin is None else pin
        self.copy_cpu = copy_cpu
        self.allocate, self.register, self.unregister, self.drain = allocate, register, unregister, drain
        self.memory = memory
        self.min_free = min_free
        self.release_after = release_after
        self.pinning_failed = False
        self.held_bytes = 0
        self.pinned_bytes = 0
        self.peak_held_bytes = 0
        self.allocations = 0
        self.releases = 0
        self.step = 0
        self._free: dict[torch.device, list[HostBuffer]] = {}
        self._lock = threading.RLock()  # give() runs from finalizers, possibly inside take() on this thread
        self.warn = WarnOnce()

    def take(self, nbytes: int, device: torch.device) -> HostBuffer | None:
        """A buffer of at least ``nbytes`` for a tensor on ``device``; None if the budget or the host is short."""
        with self._lock:
            free = self._free.get(device, [])
            fits = [buffer for buffer in free if buffer.nbytes >= nbytes]
            if fits:
                buffer = min(fits, key=lambda b: b.nbytes)
                free.remove(buffer)
                buffer.last_step = self.step
                return buffer
            size = page_round(nbytes)
            if self.budget_bytes is not None and self.held_bytes + size > self.budget_bytes:
                self._release([b for bs in self._free.values() for b in sorted(bs, key=lambda b: b.nbytes)], size)
            if self.budget_bytes is not None and self.held_bytes + size > self.budget_bytes:
                self.warn(
                    "host-budget",
                    f"the host memory budget ({self.budget_bytes / 2**20:.1f} MiB for this process, "
                    f"AUTOOFFLOAD_HOST_MEMORY) is full ({self.held_bytes / 2**20:.1f} MiB held); saved inputs "
                    "that do not fit stay on the device",
                )
                return None
            available, total = self.memory()
            if available - size < self.min_free * total:
                self.warn(
                    "host-short",
                    f"host memory is short ({available / 2**30:.1f} GiB available of {total / 2**30:.1f} GiB, "
                    f"{self.min_free:.0%} is kept free); saved inputs that do not fit in the host buffers "
                    "already held stay on the device",
                )
                return None
            return self._new(size, device)

    def set_budget(self, setting: str) -> None:
        """This process's share of the node's budget (``setting``: ``AUTOOFFLOAD_HOST_MEMORY``), unless one is set."""
        if self.budget_bytes is None:
            self.budget_bytes = node_budget(setting) // ranks_per_node()

    def give(self, buffer: HostBuffer) -> None:
        """Return a buffer; only later copies on its device's stream may touch it (the caller's rule)."""
        with self._lock:
            buffer.last_step = self.step
            self._free.setdefault(buffer.device, []).append(buffer)

    def end_step(self) -> None:
        """An optimizer step ended: release the free buffers unused for ``release_after`` steps."""
        with self._lock:
            self.step += 1
            idle = [b for bs in self._free.values() for b in bs if self.step - b.last_step >= self.release_after]
            self._release(idle, None)

    def release_all(self) -> None:
        """Release every free buffer (end of training)."""
        with self._lock:
            self._release([b for bs in self._free.values() for b in bs], None)

    def __del__(self, _finalizing=sys.is_finalizing) -> None:
        # Nothing is on loan (a loan holds its manager), so every buffer is free: unpin before the mappings go.
        # An unmapped range still registered stays pinned and may refuse a later registration at its address.
        # ``sys`` itself may be gone at interpreter exit, hence the bound default.
        if _finalizing():
            return
        with contextlib.suppress(Exception):  # a finalizer must not raise; at worst the pages stay pinned
            self.release_all()

    def _new(self, size: int, device: torch.device) -> HostBuffer | None:
        try:
            tensor = self.allocate(size)
        except (RuntimeError, OSError, MemoryError) as error:
            self.warn("host-failed", f"a host buffer could not be allocated ({error}); inputs stay on the device")
            return None
        pinned = self.pin and self._pin(tensor)
        buffer = HostBuffer(tensor, pinned, device, self.step)
        self.allocations += 1
        self.held_bytes += size
        self.pinned_bytes += size if pinned else 0
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        return buffer

    def _pin(self, tensor: torch.Tensor) -> bool:
        if self.pinning_failed:
            return False
        try:
            self.register(tensor)
        except Exception as error:  # a cap on pinned memory must not end the step
            self.pinning_failed = True
            self.warn(
                "pin-failed",
                f"pinning host memory failed ({error}) with {self.pinned_bytes / 2**20:.1f} MiB pinned; offload "
                "continues with pageable memory, whose copies do not overlap compute (slower, still correct)",
            )
            return False
        return True

    def _release(self, buffers: list[HostBuffer], needed: int | None) -> None:
        """Release ``buffers`` in order; with ``needed``, only until that many more bytes fit the budget."""
        drained: set[torch.device] = set()
        for buffer in buffers:
            if needed is not None and self.held_bytes + needed <= (self.budget_bytes or 0):
                break
            if buffer.pinned and buffer.device not in drained:
                self.drain(buffer.device)
                drained.add(buffer.device)
            self._free[buffer.device].remove(buffer)
            if buffer.pinned:
                self.unregister(buffer.tensor)
                self.pinned_bytes -= buffer.nbytes
            self.held_bytes -= buffer.nbytes
            self.releases += 1
            buffer.tensor = torch.empty(0, dtype=torch.uint8)
