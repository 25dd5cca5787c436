"""Apply, part 1: the saved-tensor hooks that move checkpointed inputs to host memory and back.

``save_on_cpu(pin_memory=True)`` semantics, with three differences that matter in a training run:

- Pinned memory is asked for only where a pinned allocator exists (an accelerator is present and the
  tensor lives on it). On a CPU-only build ``save_on_cpu(pin_memory=True)`` fails at the first forward;
  here the hooks fire and are counted on any machine, and a tensor already in host memory is kept as it
  is (there is nothing to move).
- Every byte packed is counted, per optimizer step and in total, so the controller can report it and tests
  can hold it against the arithmetic (layers x batch x seq x hidden x dtype-bytes).
- The copies stay on the compute stream (``engine="sync"``): correct by construction, and the cost that
  the controller exists to avoid paying when it is not needed.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class OffloadStats:
    """Bytes moved to host memory: in the current optimizer step, and since training began."""

    step_bytes: int = 0
    total_bytes: int = 0
    tensors: int = 0

    def add(self, nbytes: int) -> None:
        self.step_bytes += nbytes
        self.total_bytes += nbytes
        self.tensors += 1

    def next_step(self) -> int:
        """Close the step: return its bytes and start counting the next one."""
        moved, self.step_bytes = self.step_bytes, 0
        return moved


def _pinned_allocator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return accelerator.is_available()
    return torch.cuda.is_available()


def storage_key(tensor: torch.Tensor) -> tuple[torch.device, int]:
    """Which storage a tensor views; compared only while both tensors are alive."""
    return tensor.device, tensor.untyped_storage().data_ptr()


class HostOffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks: pack copies a tensor to (pinned) host memory, unpack copies it back."""

    def __init__(self, stats: OffloadStats, layer_input: torch.Tensor | None = None) -> None:
        pin = _pinned_allocator_available()
        only = None if layer_input is None else storage_key(layer_input)

        def pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
            if only is not None and storage_key(tensor) != only:
                return tensor.device, tensor
            stats.add(tensor.numel() * tensor.element_size())
            if tensor.device.type == "cpu":
                return tensor.device, tensor
            pin_this = pin and not tensor.is_sparse
            host = torch.empty_like(tensor, device="cpu", pin_memory=pin_this)
            # Into pinned memory the copy is queued on the compute stream; the caching allocator reuses the
            # source's block only for work queued after it on that same stream, so freeing it is safe.
            host.copy_(tensor, non_blocking=pin_this)
            return tensor.device, host

        def unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
            device, host = packed
            return host.to(device, non_blocking=host.is_pinned())

        super().__init__(pack, unpack)


class SyncEngine:
    """``engine="sync"``: every offloading layer call runs under :class:`HostOffloadHooks`, the last one too;
    of the tensors it saves, only the layer input's storage moves (all of them when none is named)."""

    def __init__(self, stats: OffloadStats) -> None:
        self.stats = stats

    def hooks(self, last: bool, layer_input: torch.Tensor | None = None) -> HostOffloadHooks:
        return HostOffloadHooks(self.stats, layer_input)

    def begin_forward(self) -> None:
        """Nothing links one layer call to another here."""
