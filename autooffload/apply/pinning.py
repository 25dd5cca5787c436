"""Apply: pinned host memory from the CUDA runtime: a pageable mapping, pinned and unpinned in place, and a device
drained before its buffers go. The hardware surface of :mod:`autooffload.apply.host_memory`, which tests replace.
"""

from __future__ import annotations

import contextlib
import mmap

import torch


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
