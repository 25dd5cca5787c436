"""What it costs to get pinned host memory, and whether a step pays it: the first offload of a new size does.

    PYTHONPATH=. python benchmarks/host_pinning.py --out DIR [--device cuda|cpu] [--sizes-mib 256,2048]
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/host_pinning.py --out DIR   # as torchrun runs each rank

autooffload's host buffers (:mod:`autooffload.apply.host_memory`) are anonymous mappings pinned in place with
``cudaHostRegister``, so that a buffer released goes back to the operating system. On a machine without a GPU,
``mlock`` stands in for the registration (``--device cpu``): it also faults every page in and holds it, which is
most of what registering a fresh mapping costs; what it cannot show is the driver's own part, nor the copies.

**Ways to get a buffer**, per size (seconds and GB/s of buffer):

- ``register``: a fresh mapping registered as it is (the kernel faults every page in and zeroes it, one thread);
- ``touch+register``: the mapping's pages written first by torch's parallel ``zero_`` (the faults spread over
  torch's threads: ``OMP_NUM_THREADS``), then registered;
- ``populate+register``: the mapping made with ``MAP_POPULATE`` (faulted in by the kernel at ``mmap``), then
  registered;
- GPU only: ``torch pinned``, ``torch.empty(pin_memory=True)`` of a size class its caching host allocator has not
  seen, and the same size again (served from its cache); and, for reference, the device-to-host copy of that many
  bytes into a registered buffer and into a pageable one (CUDA events).

**A step that needs new buffers** (``--layers`` x ``--layer-mib``, one buffer per layer; each layer computes for
about ``--layer-ms`` before its input is copied into its buffer, as a forward would): the step's time, and how
long it waited for pinning: ``in step`` (each buffer mapped and registered when its layer asks: autooffload's
default until a GPU shows ahead faster), ``ahead`` on 1, 2 and 4 threads (the buffers the micro-batch will need
mapped and registered on threads from the moment its plan is known: :meth:`HostMemory.expect`), and ``pinned
before`` (the buffers already held: every later step of that length). Results: ``host_pinning.json`` and
``host_pinning.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.environment import stamp  # noqa: E402

from autooffload.apply.host_memory import PAGE, HostMemory, page_round  # noqa: E402
from autooffload.apply.pinning import cuda_register, cuda_unregister, pageable  # noqa: E402

LIBC = ctypes.CDLL(None, use_errno=True)
KEY = torch.device("cuda", 0)  # the manager's key for the buffers; on a CPU only a label
STEP_WAYS = {"in step": 0, "ahead, 1 thread": 1, "ahead, 2 threads": 2, "ahead, 4 threads": 4}  # 0: the default


def mlock(buffer: torch.Tensor) -> None:
    """``cudaHostRegister``'s stand-in on a CPU: fault every page in and hold it in memory."""
    if LIBC.mlock(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(buffer.numel())) != 0:
        raise OSError(ctypes.get_errno(), "mlock failed (RLIMIT_MEMLOCK? run as root or raise ulimit -l)")


def munlock(buffer: torch.Tensor) -> None:
    LIBC.munlock(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(buffer.numel()))


def populated(nbytes: int) -> torch.Tensor:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=torch.uint8)


def timed(function) -> tuple[float, Any]:
    began = time.perf_counter()
    result = function()
    return time.perf_counter() - began, result


class Machine:
    """Pinning, compute and copies on ``device``: CUDA's, or a CPU's stand-ins (``mlock``, a memcpy)."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.register = cuda_register if self.cuda else mlock
        self.unregister = cuda_unregister if self.cuda else munlock
        self.device = torch.device(device)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def way(self, name: str, nbytes: int) -> float:
        if name == "populate+register":
            seconds, buffer = timed(lambda: self._registered(populated(nbytes)))
        else:
            buffer = pageable(nbytes)
            seconds, _ = timed(lambda: self._registered(buffer.zero_() if name == "touch+register" else buffer))
        self.unregister(buffer)
        return seconds

    def _registered(self, buffer: torch.Tensor) -> torch.Tensor:
        self.register(buffer)
        return buffer

    def matmul_for(self, milliseconds: float) -> tuple[torch.Tensor, int]:
        """A square matrix and a repeat count whose products take about ``milliseconds`` on this device."""
        n = 2048 if self.cuda else 256
        a = torch.randn(n, n, device=self.device, dtype=torch.bfloat16 if self.cuda else torch.float32)
        a @ a  # warm
        self.sync()
        count = 32
        seconds, _ = timed(lambda: ([a @ a for _ in range(count)], self.sync()))
        return a, max(1, round(milliseconds / 1e3 / (seconds / count)))

    def step(self, host: HostMemory | None, layers: int, layer_bytes: int, work: tuple[torch.Tensor, int]) -> float:
        """A forward of ``layers`` layers: each computes, then its input (``layer_bytes``) goes into a buffer of
        ``host`` (none: compute alone)."""
        matrix, reps = work
        source = torch.empty(layer_bytes, dtype=torch.uint8, device=self.device)
        if host is not None:
            host.expect([layer_bytes] * layers)
        self.sync()
        began = time.perf_counter()
        loans = []
        for _ in range(layers):
            for _ in range(reps):
                matrix @ matrix
            if host is not None:
                buffer = host.take(layer_bytes, KEY)
                buffer.tensor.copy_(source, non_blocking=buffer.pinned and self.cuda)
                loans.append(buffer)
        self.sync()
        seconds = time.perf_counter() - began
        for buffer in loans:
            host.give(buffer)  # type: ignore[union-attr]
        return seconds


def ways_to_get(machine: Machine, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for mib in sizes:
        nbytes = page_round(mib * 2**20)
        row: dict[str, Any] = {"mib": mib}
        for name in ("register", "touch+register", "populate+register"):
            row[name] = min(machine.way(name, nbytes) for _ in range(repeats))
        if machine.cuda:
            # Once per size: torch's pinned allocator rounds up to a power of two and keeps what is freed, so only
            # its first request of a size class is a cudaHostAlloc (the sizes asked fall in different classes).
            row["torch pinned"], _ = timed(lambda n=nbytes: torch.empty(n + PAGE, dtype=torch.uint8, pin_memory=True))
            row["torch pinned, cached"], _ = timed(
                lambda n=nbytes: torch.empty(n + PAGE, dtype=torch.uint8, pin_memory=True)
            )
            row["copy d2h pinned"] = copy_seconds(nbytes, pinned=True)
            row["copy d2h pageable"] = copy_seconds(nbytes, pinned=False)
        rows.append(row)
        print(
            "host_pinning: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        )
    return rows


def copy_seconds(nbytes: int, pinned: bool) -> float:
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    destination = pageable(nbytes)
    if pinned:
        cuda_register(destination)
    destination.copy_(source, non_blocking=pinned)  # warm
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    destination.copy_(source, non_blocking=pinned)
    end.record()
    torch.cuda.synchronize()
    if pinned:
        cuda_unregister(destination)
    return start.elapsed_time(end) / 1e3


def first_steps(machine: Machine, layers: int, layer_mib: int, layer_ms: float) -> list[dict[str, Any]]:
    """The step that needs new buffers, each way (module docs); a compute-only step for reference."""
    layer_bytes = page_round(layer_mib * 2**20)
    work = machine.matmul_for(layer_ms)
    rows = []
    compute = min(machine.step(None, layers, layer_bytes, work) for _ in range(2))
    rows.append({"way": "compute alone", "step_s": compute, "pin_wait_s": 0.0})
    for name, threads in STEP_WAYS.items():
        host = HostMemory(
            pin=True, register=machine.register, unregister=machine.unregister, drain=lambda device: machine.sync(),
            prepare_threads=threads,
        )  # fmt: skip
        host.set_budget("auto", [KEY])
        seconds = machine.step(host, layers, layer_bytes, work)
        rows.append({"way": name, "step_s": seconds, "pin_wait_s": host.pin_seconds, "pinned": host.registrations})
        if name == "in step":
            waited = host.pin_seconds
            again = machine.step(host, layers, layer_bytes, work)
            rows.append({"way": "pinned before", "step_s": again, "pin_wait_s": host.pin_seconds - waited})
        host.release_all()
    for row in rows:
        row["over_compute_s"] = row["step_s"] - compute
        print(f"host_pinning: step, {row['way']}: {row['step_s']:.3f} s, waited for pinning {row['pin_wait_s']:.3f} s")
    return rows


def render(report: dict[str, Any]) -> str:
    rows, steps = report["ways"], report["step"]
    names = [k for k in rows[0] if k != "mib"]
    lines = [
        "# Pinned host memory: getting it, and whether a step waits for it",
        "",
        f"- device: {report['device']}; torch {report['torch']}; torch threads {report['threads']} "
        f"(OMP_NUM_THREADS={report['omp_num_threads']}); pinning: {report['pinning']}",
        "",
        "| MiB | " + " | ".join(f"{n}: s (GB/s)" for n in names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for row in rows:
        cells = [f"{row[n]:.4f} ({row['mib'] * 2**20 / max(row[n], 1e-9) / 1e9:.1f})" for n in names]
        lines.append(f"| {row['mib']} | " + " | ".join(cells) + " |")
    shape = report["step_shape"]
    lines += [
        "",
        f"A step that needs {shape['layers']} new buffers of {shape['layer_mib']} MiB, each layer computing for "
        f"about {shape['layer_ms']} ms first:",
        "",
        "| way | step, s | over compute alone, s | waited for pinning, s |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['way']} | {r['step_s']:.3f} | {r['over_compute_s']:+.3f} | {r['pin_wait_s']:.3f} |" for r in steps]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if available, else cpu (mlock)")
    parser.add_argument("--sizes-mib", default="256,2048")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=28, help="the step's layers, one new buffer each (28)")
    parser.add_argument("--layer-mib", type=int, default=128, help="one layer input (128: 32k tokens x 2048 bf16)")
    parser.add_argument("--layer-ms", type=float, default=18.0, help="one layer's forward compute (18 ms)")
    parser.add_argument("--name", default="host_pinning", help="the output files' name (host_pinning)")
    options = parser.parse_args(argv)
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("host_pinning: --device cuda needs a CUDA device")
        return 2
    if device == "cuda":
        torch.cuda.init()
    options.out.mkdir(parents=True, exist_ok=True)
    machine = Machine(device)
    sizes = [int(x) for x in options.sizes_mib.split(",")]
    report: dict[str, Any] = stamp(
        "host_pinning.py",
        sys.argv[1:] if argv is None else argv,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        threads=torch.get_num_threads(),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS", "unset"),
        pinning="cudaHostRegister" if device == "cuda" else "mlock (a CPU's stand-in for cudaHostRegister)",
        step_shape=dict(layers=options.layers, layer_mib=options.layer_mib, layer_ms=options.layer_ms),
    )
    report["ways"] = ways_to_get(machine, sizes, options.repeats)
    report["step"] = first_steps(machine, options.layers, options.layer_mib, options.layer_ms)
    (options.out / f"{options.name}.json").write_text(json.dumps(report, indent=2))
    text = render(report)
    (options.out / f"{options.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
