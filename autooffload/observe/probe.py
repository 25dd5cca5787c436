"""Observe: how full the device was at its fullest during the last optimizer step.

A probe has one method, ``read() -> MemoryReading | None``, called once at the end of every optimizer
step, and may have ``reset()``, called at the start of every step so that its peak is the step's own
(evaluation and checkpoint saving run between steps). :class:`NvmlProbe` reads a CUDA device;
:class:`ScriptedProbe` replays given fractions, so that a memory curve can drive the controller on a
machine without a GPU.

Why not NVML alone: NVML's "used" counts what PyTorch's caching allocator has reserved, and the allocator
keeps its high-water mark reserved for reuse. After one long step "used" stays high for the rest of the
run, so a policy fed with it could switch offload on but never off again. ``max_memory_reserved`` has the
same flaw: resetting the peak statistics resets it to the current reservation, which is that same
high-water mark. What falls again when the batches get short is the peak of live tensors in the step,
``max_memory_allocated``, reset after every reading. NVML supplies the rest: the device's total, and
what this process does not account for in its allocator (other processes, CUDA context, NCCL buffers),
read as NVML's "used" minus this process's reservation at the same moment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Protocol


class ProbeUnavailable(RuntimeError):
    """The probe cannot read this device (no GPU, NVML library missing, driver error)."""


@dataclasses.dataclass(frozen=True)
class MemoryReading:
    used_bytes: int
    total_bytes: int

    @property
    def fraction(self) -> float:
        return self.used_bytes / self.total_bytes


class MemoryProbe(Protocol):
    """``read()`` at the end of a step; an optional ``reset()`` at its start starts the peak there."""

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
    """Peak memory of the last step on one CUDA device, from NVML and torch's caching allocator.

    ``device`` is a torch device (``cuda:N``, numbered as torch sees them); it is matched to the NVML
    device by UUID, so ``CUDA_VISIBLE_DEVICES`` renumbering cannot point it at another GPU. Raises
    :class:`ProbeUnavailable` at construction when NVML or the device cannot be read.
    """

    def __init__(self, device: object) -> None:
        import torch

        self.device = torch.device(device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise ProbeUnavailable(f"device {self.device} is not a CUDA device")
        try:
            import pynvml
        except ImportError as error:
            raise ProbeUnavailable(f"pynvml is not importable ({error}); install nvidia-ml-py") from error
        try:
            pynvml.nvmlInit()
            self._handle = _nvml_handle(pynvml, torch, self.device)
            pynvml.nvmlDeviceGetMemoryInfo(self._handle)
        except pynvml.NVMLError as error:
            raise ProbeUnavailable(f"NVML cannot read {self.device}: {error}") from error
        self._nvml = pynvml
        self._torch = torch
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> MemoryReading | None:
        cuda = self._torch.cuda
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        outside_allocator = max(0, int(info.used) - cuda.memory_reserved(self.device))
        peak = cuda.max_memory_allocated(self.device)
        cuda.reset_peak_memory_stats(self.device)
        return MemoryReading(peak + outside_allocator, int(info.total))

    def reset(self) -> None:
        """Start the peak here: at a step's start, so what ran between steps is not in its reading."""
        self._torch.cuda.reset_peak_memory_stats(self.device)


def _nvml_handle(pynvml, torch, device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    if uuid:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except pynvml.NVMLError:
            pass
    return pynvml.nvmlDeviceGetHandleByIndex(index)
