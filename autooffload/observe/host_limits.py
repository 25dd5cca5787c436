"""Observe: how much host memory this process may still take, under every limit that applies to it.

The machine's free memory is one limit. A container sets another: cgroup v2 ``memory.max`` (and ``memory.high``,
above which the kernel throttles the cgroup), cgroup v1 ``memory.limit_in_bytes`` (and ``memory.stat``'s
``hierarchical_memory_limit``, which names the limits above a container's mount too), at the process's own cgroup
and at every cgroup above it, whose limits apply as well. The process may have its own: ``RLIMIT_AS`` (``ulimit
-v``: every mapping counts, host buffers included) and ``RLIMIT_DATA`` (``ulimit -d``: private writable
mappings). Each gives what is left under it (the limit less what is charged to it now: a cgroup's usage less the
page cache it can drop, the process's virtual or data size) and its size; the tightest is what offload may count
on. Reading the machine alone, a job under a container's limit took buffers the container could not afford, and
the kernel killed it or an allocation in the backward failed.

Where the limits live is read from ``/proc/self/cgroup`` and ``/proc/self/mountinfo`` (cgroup v2, v1, or both in
the hybrid layout), so a container's own view (a cgroup namespace, a bind mount) is followed as it is. The paths
and the readers are arguments, so tests pass a file tree and limits of their own.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

# cgroup v1 writes "no limit" as the largest page count times the page size (9223372036854771712 on 4 KiB pages).
V1_UNLIMITED = 2**62


@dataclasses.dataclass(frozen=True)
class Limit:
    """One limit on the host memory this process may take: ``available`` bytes left of ``total``. ``shared``: the
    machine's or a container's, shared by the node's processes (a process limit is this process's alone)."""

    name: str
    available: int
    total: int
    shared: bool = True


def machine_memory() -> tuple[int, int]:
    """(available, total) bytes of the machine's memory, from psutil, or /proc/meminfo where psutil is missing."""
    try:
        import psutil
    except ImportError:
        with open("/proc/meminfo") as meminfo:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo}
        return fields["MemAvailable"], fields["MemTotal"]
    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


def process_limits() -> dict[str, int]:
    """The soft ``RLIMIT_AS`` and ``RLIMIT_DATA`` of this process where they are set (bytes), by name."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return {}
    limits = {}
    for name in ("RLIMIT_AS", "RLIMIT_DATA"):
        try:
            soft, _hard = resource.getrlimit(getattr(resource, name))
        except (AttributeError, OSError, ValueError):
            continue
        if soft != resource.RLIM_INFINITY and soft >= 0:
            limits[name] = int(soft)
    return limits


def read_limits(
    proc: Path | str = "/proc/self",
    machine: Callable[[], tuple[int, int]] = machine_memory,
    rlimits: Callable[[], dict[str, int]] = process_limits,
) -> list[Limit]:
    """Every limit that applies to this process, the machine's first. ``proc``: the process's ``/proc`` folder
    (its ``cgroup``, ``mountinfo`` and ``status``); a limit that cannot be read is left out."""
    proc = Path(proc)
    available, total = machine()
    limits = [Limit("host memory", int(available), int(total))]
    limits += cgroup_limits(proc)
    status = _status(proc / "status")
    flags = {"RLIMIT_AS": ("ulimit -v", "VmSize"), "RLIMIT_DATA": ("ulimit -d", "VmData")}
    for name, limit in rlimits().items():
        shell, field = flags[name]
        used = status.get(field)
        if used is not None:
            limits.append(Limit(f"{name} ({shell})", max(limit - used, 0), limit, shared=False))
    return limits


def tightest(limits: list[Limit]) -> Limit:
    """The limit with the least available."""
    return min(limits, key=lambda limit: limit.available)


def host_memory() -> tuple[int, int]:
    """(available, total) under the tightest limit on this process: the machine's free memory, a container's
    memory limit, the process's own (what ``HostMemory`` keeps 10% of free)."""
    limit = tightest(read_limits())
    return limit.available, limit.total


def cgroup_limits(proc: Path) -> list[Limit]:
    """The memory limits of the process's cgroup and every cgroup above it, v2 and v1."""
    return [limit for read, folder in _cgroup_folders(proc) for limit in read(folder)]


_FOLDERS: dict[Path, list[tuple[Callable[[Path], list[Limit]], Path]]] = {}


def _cgroup_folders(proc: Path) -> list[tuple[Callable[[Path], list[Limit]], Path]]:
    """Each cgroup folder whose limits apply to the process (its own and those above it, up to each mount's top),
    with the reader of its version. Found once per process folder: the process's cgroup and the mounts do not
    move during a run, and a new host buffer reads the limits again (their usage moves)."""
    if proc in _FOLDERS:
        return _FOLDERS[proc]
    try:
        memberships = (proc / "cgroup").read_text().splitlines()
        mounts = _mounts((proc / "mountinfo").read_text())
    except OSError:
        return []
    found: list[tuple[Callable[[Path], list[Limit]], Path]] = []
    for line in memberships:
        number, controllers, path = [*line.split(":", 2), "", ""][:3]
        if number == "0" and controllers == "":
            found += [
                (_v2_limits, f) for folder, top in _folders(mounts, "cgroup2", None, path) for f in _up(folder, top)
            ]
        elif "memory" in controllers.split(","):
            found += [
                (_v1_limits, f) for folder, top in _folders(mounts, "cgroup", "memory", path) for f in _up(folder, top)
            ]
    _FOLDERS[proc] = found
    return found


def _mounts(mountinfo: str) -> list[tuple[str, Path, str, set[str]]]:
    """(root within the hierarchy, mount point, filesystem type, super options) of each mount."""
    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) < 3:
            continue
        mounts.append((_unescape(fields[3]), Path(_unescape(fields[4])), after[0], set(after[2].split(","))))
    return mounts


def _unescape(text: str) -> str:
    return text.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _folders(mounts: list, kind: str, controller: str | None, path: str) -> list[tuple[Path, Path]]:
    """The folder of cgroup ``path`` under each mount of its hierarchy, and that mount's top folder."""
    found = []
    for root, point, fstype, options in mounts:
        if fstype != kind or (controller is not None and controller not in options):
            continue
        relative = os.path.relpath(path, root) if path.startswith(root) else None
        if relative is None or relative.startswith(".."):
            continue
        folder = point if relative == "." else point / relative
        if folder.is_dir():
            found.append((folder, point))
    return found


def _up(folder: Path, top: Path) -> list[Path]:
    """``folder`` and every folder above it up to the mount's top."""
    folders = [folder]
    while folder != top and folder.parent != folder:
        folder = folder.parent
        folders.append(folder)
    return folders


def _v2_limits(folder: Path) -> list[Limit]:
    limits = [(name, _number(folder / name)) for name in ("memory.max", "memory.high")]
    limits = [(name, limit) for name, limit in limits if limit is not None]
    used = _number(folder / "memory.current") if limits else None
    if used is None:
        return []
    used -= _stat(folder / "memory.stat").get("inactive_file", 0)  # page cache the kernel drops before it kills
    return [Limit(f"cgroup v2 {name} ({folder})", max(limit - used, 0), limit) for name, limit in limits]


def _v1_limits(folder: Path) -> list[Limit]:
    """The cgroup's own ``memory.limit_in_bytes``, or, tighter, ``memory.stat``'s ``hierarchical_memory_limit``: the
    tightest limit of every cgroup above it, those a container does not mount included (a Kubernetes pod's), against
    this cgroup's usage (the usage above it cannot be read from here)."""
    stat = _stat(folder / "memory.stat")
    own = _number(folder / "memory.limit_in_bytes")
    named = [("memory.limit_in_bytes", own), ("hierarchical_memory_limit", stat.get("hierarchical_memory_limit"))]
    named = [(name, limit) for name, limit in named if limit is not None and limit < V1_UNLIMITED]
    used = _number(folder / "memory.usage_in_bytes") if named else None
    if used is None:
        return []
    name, limit = min(named, key=lambda item: item[1])
    used -= stat.get("total_inactive_file", stat.get("inactive_file", 0))
    return [Limit(f"cgroup v1 {name} ({folder})", max(limit - used, 0), limit)]


def _number(path: Path) -> int | None:
    """A cgroup file's number; None where it is missing, unreadable or ``max`` (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    pairs = [line.split() for line in lines]
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


def _status(path: Path) -> dict[str, int]:
    """``/proc/self/status``'s sizes in bytes (``VmSize``, ``VmData``, ...)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    sizes = {}
    for line in lines:
        name, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            sizes[name] = int(parts[0]) * 1024
    return sizes
