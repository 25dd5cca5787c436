"""Apply: how much host memory this process may hold for offload: the node's budget and this rank's share.

``AUTOOFFLOAD_HOST_MEMORY`` is what the node may hold, shared by the ranks a launcher put on it
(:func:`ranks_per_node`); the limits it is read against are :mod:`autooffload.observe.host_limits`'s. The
manager that holds the buffers is :mod:`autooffload.apply.host_memory`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..observe.host_limits import Limit, machine_memory, tightest
from ..settings import parse_host_memory

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


def node_budget(setting: str, memory: Callable[[], tuple[int, int]] = machine_memory) -> int:
    """Bytes of host memory the whole node may hold for offload, from ``AUTOOFFLOAD_HOST_MEMORY``.

    A fraction is of ``memory()``'s total; ``auto`` is half of what is available now (at start).
    """
    kind, value = parse_host_memory(setting)
    if kind == "bytes":
        return int(value)
    available, total = memory()
    return int(value * (available if kind == "auto" else total))


def process_budget(setting: str, limits: list[Limit], ranks: int) -> tuple[int, str]:
    """This process's share of host memory for offload, and the limit that set it.

    The machine's and a container's limits are the node's, shared by its ``ranks``: the node's budget over them.
    A process limit (``RLIMIT_AS``, ``RLIMIT_DATA``) is this process's own: the setting applies to it whole. A
    size given in bytes is the node's as given (each new buffer is still checked against every limit).
    """
    kind, _ = parse_host_memory(setting)
    if kind == "bytes":
        return node_budget(setting) // ranks, "AUTOOFFLOAD_HOST_MEMORY"
    candidates = []
    for group, share in (([x for x in limits if x.shared], ranks), ([x for x in limits if not x.shared], 1)):
        if group:
            binding = tightest(group) if kind == "auto" else min(group, key=lambda x: x.total)
            candidates.append((node_budget(setting, lambda b=binding: (b.available, b.total)) // share, binding.name))
    return min(candidates)
