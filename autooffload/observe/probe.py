"""Observe: how full the device was at its fullest during the last optimizer step.

A probe has one method, ``read() -> MemoryReading | None``, called once at the end of every optimizer
step, and may have ``reset()``, called at the start of every step so that its peak is the step's own
(evaluation and checkpoint saving run between steps). :class:`NvmlProbe` reads CUDA devices;
:class:`ScriptedProbe` replays given fractions, so that a memory curve can drive the controller on a
machine without a GPU.

Which signal, when:

- The step's peak of live tensors, ``max_memory_allocated``, reset after every reading. NVML's "used" counts
  what PyTorch's caching allocator has reserved, and the allocator keeps its high-water mark reserved for
  reuse: after one long step "used" stays high for the rest of the run, so a policy fed with it could
  switch offload on but never off again. ``max_memory_reserved`` has the same flaw (a reset sets it to the
  current reservation, that same high-water mark). The peak of live tensors falls again when batches get
  short.
- Plus what this process's allocator does not account for (other processes, CUDA context, NCCL buffers):
  the device's "used" minus this process's reservation at the same moment, over the device's total. The
  device's used and total come from NVML where NVML can name the device: by UUID (``GPU-`` or, on a MIG
  instance, ``MIG-`` prefixed: torch's UUID has neither), else by index unless that index is a GPU in MIG
  mode (NVML would read the parent GPU, not the instance) or ``CUDA_VISIBLE_DEVICES`` renumbers the devices
  (NVML's index would name another GPU). Where NVML cannot name it (a MIG instance not
  found by UUID, pynvml missing), ``torch.cuda.mem_get_info``, which reads the instance torch runs on.
- Fragmentation: ``max_memory_allocated`` cannot see it. Without ``expandable_segments`` a device fails
  well before 100% allocated, and on the way the caching allocator frees its cache and retries
  (``memory_stats()["num_alloc_retries"]``). A step in which that count grew reads as a full device
  (``used_bytes == total_bytes``, ``alloc_retries`` > 0): above any ``memory_high``, so the hysteresis
  policy switches offload on and the predictive one plans more offload for that length.
- Several devices in one process (``device_map="auto"``): every device the parameters are on is read, and
  the reading is the fullest one's (by fraction).
- Segments (the keep model's marks, :mod:`autooffload.decide.growth`): on one device, a mark reads the peak of
  live tensors since the last one and resets torch's counter; the step's reading is the largest of them and the
  counter at its end, as without marks.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any, Protocol


class ProbeUnavailable(RuntimeError):
    """The probe cannot read this device (no GPU, NVML library missing, driver error)."""


@dataclasses.dataclass(frozen=True)
class MemoryReading:
    """``used_bytes`` of ``total_bytes`` at the step's fullest; ``alloc_retries``: how often the caching
    allocator had to free its cache and retry during the step (a full device, whatever ``used_bytes`` says)."""

    used_bytes: int
    total_bytes: int
    alloc_retries: int = 0

    @property
    def fraction(self) -> float:
        return self.used_bytes / self.total_bytes


class MemoryProbe(Protocol):
    """``read()`` at the end of a step; an optional ``reset()`` at its start starts the peak there; an optional
    ``peek()`` reads the step so far without ending its peak (before the optimizer's first step, so that its
    new state is not counted twice: :mod:`autooffload.observe.memory`)."""

    def read(self) -> MemoryReading | None: ...


class ScriptedProbe:
    """Replays a memory curve: one fraction of ``total_bytes`` per optimizer step, then repeats the last."""

    def __init__(self, fractions: Iterable[float], total_bytes: int = 80 * 2**30) -> None:
        self.fractions = list(fractions)
        self.total_bytes = total_bytes
        self.reads = 0

    def read(self) -> MemoryReading | None:
        if not self.fractions:
            return None
        fraction = self.fractions[min(self.reads, len(self.fractions) - 1)]
        self.reads += 1
        return MemoryReading(round(fraction * self.total_bytes), self.total_bytes)


class NvmlProbe:
    """Peak memory of the last step on the CUDA devices a model is on, from NVML (or ``mem_get_info``) and
    torch's caching allocator (see the module's docstring for which signal is used when).

    ``devices``: one torch device (``cuda:N``, numbered as torch sees them) or several; each is matched to
    its NVML device by UUID, so ``CUDA_VISIBLE_DEVICES`` renumbering cannot point it at another GPU.
    ``cuda`` and ``nvml``: the ``torch.cuda`` and ``pynvml`` modules (default: the real ones; ``nvml=None``
    with ``cuda`` given: no NVML). Raises :class:`ProbeUnavailable` at construction when a device cannot be
    read.

    Trainer's ``train_mem_gpu_peaked_delta`` (``skip_memory_metrics=False``) reads torch's peak counter
    once, at the end of ``train()``; this probe resets that counter every step, because a per-step peak is
    the signal that falls again and torch has no other per-step peak. So the probe keeps the run's peak
    itself (:meth:`peak_allocated`: every peak it reset, and the counter now) and the Trainer callback puts
    it back into that metric, rather than warn that the metric is wrong or give up the per-step signal.
    """

    def __init__(self, devices: object, *, cuda: Any = None, nvml: Any = "import") -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        if nvml == "import":
            try:
                import pynvml as nvml  # type: ignore[no-redef]
            except ImportError:
                nvml = None
        self._cuda = cuda
        self._nvml = nvml
        if not cuda.is_available():
            raise ProbeUnavailable("no CUDA device")
        if isinstance(devices, list | tuple | set):  # a model's devices: the CUDA ones among them
            self.devices = sorted({_cuda_index(d, cuda) for d in devices if _is_cuda(d)})
            if not self.devices:
                raise ProbeUnavailable(f"none of the devices {sorted(map(str, devices))} is a CUDA device")
        else:
            self.devices = [_cuda_index(devices, cuda)]
        if nvml is not None:
            try:
                nvml.nvmlInit()
            except nvml.NVMLError:
                self._nvml = None
        self._handles = {index: self._nvml_handle(index) for index in self.devices}
        self.sources = {index: "nvml" if self._handles[index] is not None else "mem_get_info" for index in self.devices}
        self._run_peak = dict.fromkeys(self.devices, 0)
        self._step_peak = dict.fromkeys(self.devices, 0)  # the most a step's marked segments peaked at, so far
        self._segments: list[tuple[object, int]] = []  # the running step's closed segments
        self._label: object = None  # the running segment's mark
        self._last_segments: list[tuple[object, int]] | None = None
        self._retries: dict[int, int] = {}
        for index in self.devices:
            self._device_memory(index)
        self._reset_peaks()

    def read(self) -> MemoryReading | None:
        readings = [self._read_device(index) for index in self.devices]
        self._last_segments = None
        if self._segments:  # the step was marked: its last segment ends here
            self._last_segments = [
                *self._segments,
                (self._label, int(self._cuda.max_memory_allocated(self.devices[0]))),
            ]
        self._reset_peaks()
        return max(readings, key=lambda reading: reading.fraction)

    def peek(self) -> MemoryReading:
        """The reading so far, the step's peak still counting (nothing is reset)."""
        return max((self._read_device(index) for index in self.devices), key=lambda reading: reading.fraction)

    def reset(self) -> None:
        """Start the peak (and the retry count) here: at a step's start, so what ran between steps (evaluation,
        checkpoint saving) is not in its reading. The run's peak keeps what came before."""
        self._reset_peaks()

    def mark(self, label: object) -> None:
        """A segment of the step begins here (one device only; with several, nothing is marked)."""
        if len(self.devices) != 1:
            return
        index = self.devices[0]
        peak = int(self._cuda.max_memory_allocated(index))
        self._segments.append((self._label, peak))  # the running segment (the first: before any mark) ends here
        self._step_peak[index] = max(self._step_peak[index], peak)
        self._run_peak[index] = max(self._run_peak[index], peak)
        self._cuda.reset_peak_memory_stats(index)
        self._label = label

    def segments(self) -> list[tuple[object, int]] | None:
        """The last read step's segments: (the mark that began it, the peak of live tensors in it)."""
        return self._last_segments

    def peak_allocated(self, device: object = None) -> int:
        """The largest ``max_memory_allocated`` of ``device`` (default: the current one) since this probe
        was made, across the probe's own resets: what torch's counter would say had nobody reset it."""
        index = _cuda_index(device, self._cuda)
        return max(self._run_peak.get(index, 0), int(self._cuda.max_memory_allocated(index)))

    def peaked_delta(self, device: object = None) -> int:
        """Trainer's ``peaked_delta`` as it would be without this probe's resets: the run's peak of live
        tensors on ``device`` (default: the current one, as Trainer reads) less what is allocated now."""
        index = _cuda_index(device, self._cuda)
        return max(0, self.peak_allocated(index) - int(self._cuda.memory_allocated(index)))

    def _read_device(self, index: int) -> MemoryReading:
        used, total = self._device_memory(index)
        outside_allocator = max(0, used - int(self._cuda.memory_reserved(index)))
        peak = max(int(self._cuda.max_memory_allocated(index)), self._step_peak[index])
        retries = self._alloc_retries(index) - self._retries.get(index, 0)
        if retries > 0:
            return MemoryReading(total, total, retries)
        return MemoryReading(min(peak + outside_allocator, total), total)

    def _reset_peaks(self) -> None:
        """Reset torch's peak counters for the next step; remember what they said and the retry counts first."""
        for index in self.devices:
            self._run_peak[index] = max(self._run_peak[index], int(self._cuda.max_memory_allocated(index)))
            self._retries[index] = self._alloc_retries(index)
            self._cuda.reset_peak_memory_stats(index)
            self._step_peak[index] = 0
        self._segments, self._label = [], None

    def _alloc_retries(self, index: int) -> int:
        return int(self._cuda.memory_stats(index).get("num_alloc_retries", 0))

    def _device_memory(self, index: int) -> tuple[int, int]:
        """(used, total) bytes of the device or MIG instance, as NVML or the CUDA driver sees it."""
        handle = self._handles[index]
        if handle is not None:
            try:
                info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                return int(info.used), int(info.total)
            except self._nvml.NVMLError as error:
                raise ProbeUnavailable(f"NVML cannot read cuda:{index}: {error}") from error
        try:
            free, total = self._cuda.mem_get_info(index)
        except Exception as error:
            raise ProbeUnavailable(f"cannot read the memory of cuda:{index}: {error}") from error
        return int(total) - int(free), int(total)

    def _nvml_handle(self, index: int) -> Any:
        """The NVML handle of torch's device ``index``, or None where NVML cannot name it."""
        nvml = self._nvml
        if nvml is None:
            return None
        uuid = str(getattr(self._cuda.get_device_properties(index), "uuid", "") or "")
        if uuid.startswith(("GPU-", "MIG-")):
            uuid = uuid[4:]
        if uuid:
            for prefix in ("GPU-", "MIG-"):
                try:
                    return nvml.nvmlDeviceGetHandleByUUID(prefix + uuid)
                except nvml.NVMLError:
                    pass
        if not _same_numbering(index):
            return None
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError:
            return None
        return None if _mig_enabled(nvml, handle) else handle


def _same_numbering(index: int) -> bool:
    """Whether torch's device ``index`` is NVML's device ``index``: not where ``CUDA_VISIBLE_DEVICES`` renumbers."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return True
    return [entry.strip() for entry in visible.split(",")][index : index + 1] == [str(index)]


def _mig_enabled(nvml: Any, handle: Any) -> bool:
    """True when NVML says the GPU is in MIG mode (its index names the parent, not the instance torch uses)."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except (nvml.NVMLError, AttributeError):
        return False
    return bool(current == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1))


def _is_cuda(device: Any) -> bool:
    import torch

    return isinstance(device, int) or torch.device(device).type == "cuda"


def _cuda_index(device: Any, cuda: Any) -> int:
    if isinstance(device, int):
        return device
    if device is None:
        return int(cuda.current_device())
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ProbeUnavailable(f"device {device} is not a CUDA device")
    return device.index if device.index is not None else int(cuda.current_device())
