"""What ``autooffload estimate`` reads from the machine it runs on: the device's memory (NVML), the host's memory
(under a container's limit where it runs in one) and the node's host memory budget, and how much a process may
pin.

Each reader answers None (or a note) where it cannot read, and the figure then prints as unknown: the estimate
runs on a machine without a GPU. The command calls these through this module, so patch them here.
"""

from __future__ import annotations

import contextlib

from ..observe.host_limits import Limit, read_limits, tightest
from ..settings import parse_host_memory


def nvml_total_bytes() -> int | None:
    """Total memory of the first GPU NVML lists, or None without a readable GPU (no driver, no device)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def host_available_bytes() -> int | None:
    """What the node's tightest shared limit leaves: the machine's free memory, or a container's memory limit
    where the estimate runs inside one (:mod:`autooffload.observe.host_limits`)."""
    try:
        return tightest(_shared_limits()).available
    except Exception:
        return None


def host_total_bytes() -> int | None:
    """The size of the smallest shared limit: the machine's memory, or a container's memory limit."""
    try:
        return min(limit.total for limit in _shared_limits())
    except Exception:
        return None


def _shared_limits() -> list[Limit]:
    return [limit for limit in read_limits() if limit.shared]


def host_budget(setting: str) -> int | None:
    """The node's budget for ``AUTOOFFLOAD_HOST_MEMORY`` on this host (what the controller computes at start)."""
    kind, value = parse_host_memory(setting)
    if kind == "bytes":
        return int(value)
    base = host_available_bytes() if kind == "auto" else host_total_bytes()
    return None if base is None else int(value * base)


def pinnable_limit() -> tuple[int | None, str]:
    """RLIMIT_MEMLOCK (``ulimit -l``) where it is set, and a note (WSL is recognised; its cap is not readable)."""
    import platform

    note = (
        "WSL: pinned memory is capped near 1-2 GiB per process"
        if "microsoft" in platform.uname().release.lower()
        else ""
    )
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError):
        return None, note or "memlock limit unknown"
    if soft == resource.RLIM_INFINITY:
        return None, note or "memlock unlimited"
    return int(soft), note or "memlock limit, ulimit -l"
