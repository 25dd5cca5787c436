"""What it costs to get pinned host memory, and to copy into it: the first offload of a new size pays the first.

    PYTHONPATH=. python benchmarks/host_pinning.py --out DIR [--sizes-mib 256,2048] [--repeats 2]

autooffload's host buffers (:mod:`autooffload.apply.host_memory`) are anonymous mappings pinned in place with
``cudaHostRegister``, so that a buffer released goes back to the operating system. A new buffer is paid for on the
step that first needs it, inside that step. This measures, per size, each way of getting pinned memory (seconds
and GB/s of buffer):

- ``register``: a fresh mapping registered as it is (the kernel faults every page in and zeroes it, one thread);
- ``touch+register``: the mapping's pages written first by torch's parallel ``zero_`` (the faults spread over
  the CPU's threads), then registered;
- ``populate+register``: the mapping made with ``MAP_POPULATE`` (faulted in by the kernel at ``mmap``), then
  registered;
- ``torch pinned``: ``torch.empty(pin_memory=True)`` of a size class its caching host allocator has not seen
  (``cudaHostAlloc``, or its own register path where ``PYTORCH_CUDA_ALLOC_CONF`` asks for it), and the same
  size again (served from its cache);

and, for reference, the device-to-host copy of that many bytes into a registered buffer and into a pageable one
(CUDA events). Results: ``host_pinning.json`` and ``host_pinning.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autooffload.apply.host_memory import PAGE, cuda_register, cuda_unregister, page_round, pageable  # noqa: E402


def populated(nbytes: int) -> torch.Tensor:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=torch.uint8)


def timed(function) -> tuple[float, Any]:
    began = time.perf_counter()
    result = function()
    return time.perf_counter() - began, result


def way_register(nbytes: int) -> float:
    buffer = pageable(nbytes)
    seconds, _ = timed(lambda: cuda_register(buffer))
    cuda_unregister(buffer)
    return seconds


def way_touch_register(nbytes: int) -> float:
    buffer = pageable(nbytes)

    def make() -> None:
        buffer.zero_()
        cuda_register(buffer)

    seconds, _ = timed(make)
    cuda_unregister(buffer)
    return seconds


def way_populate_register(nbytes: int) -> float:
    def make() -> torch.Tensor:
        buffer = populated(nbytes)
        cuda_register(buffer)
        return buffer

    seconds, buffer = timed(make)
    cuda_unregister(buffer)
    return seconds


def way_torch_pinned(nbytes: int) -> tuple[float, float]:
    first, buffer = timed(lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
    del buffer
    again, buffer = timed(lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
    del buffer
    return first, again


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--sizes-mib", default="256,2048")
    parser.add_argument("--repeats", type=int, default=2)
    options = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_pinning: needs a CUDA device")
        return 2
    options.out.mkdir(parents=True, exist_ok=True)
    torch.cuda.init()
    rows = []
    for mib in (int(x) for x in options.sizes_mib.split(",")):
        nbytes = page_round(mib * 2**20)
        row: dict[str, Any] = {"mib": mib, "threads": torch.get_num_threads()}
        for name, way in (
            ("register", way_register),
            ("touch+register", way_touch_register),
            ("populate+register", way_populate_register),
        ):
            row[name] = min(way(nbytes) for _ in range(options.repeats))
        # Once per size: torch's pinned allocator rounds up to a power of two and keeps what is freed, so only its
        # first request of a size class is a cudaHostAlloc (the sizes asked fall in different classes).
        row["torch pinned"], row["torch pinned, cached"] = way_torch_pinned(nbytes + PAGE)
        row["copy d2h pinned"] = copy_seconds(nbytes, pinned=True)
        row["copy d2h pageable"] = copy_seconds(nbytes, pinned=False)
        rows.append(row)
        cells = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        print(f"host_pinning: {cells}")
    (options.out / "host_pinning.json").write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2))
    names = [k for k in rows[0] if k not in ("mib", "threads")]
    lines = ["| MiB | " + " | ".join(f"{n}: s (GB/s)" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for row in rows:
        cells = [f"{row[n]:.4f} ({row['mib'] * 2**20 / max(row[n], 1e-9) / 1e9:.1f})" for n in names]
        lines.append(f"| {row['mib']} | " + " | ".join(cells) + " |")
    text = "# Pinned host memory: getting it and copying into it\n\n" + "\n".join(lines) + "\n"
    (options.out / "host_pinning.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
