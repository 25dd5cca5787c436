"""What the ranks' agreement costs: the one collective autooffload makes before every micro-batch's forward.

    torchrun --nproc_per_node 2 benchmarks/rank_agreement.py             # gloo on a CPU, NCCL on GPUs
    torchrun --nproc_per_node 2 benchmarks/rank_agreement.py --out DIR   # also DIR/rank_agreement.json

Times ``autooffload.distributed.all_reduce_max`` (the exact call ``agree`` makes: two int64 values, the level
and the host-memory cap, ``all_reduce(MAX)``, then read on the host) back to back, after a warm-up, two ways:
over the default group (on its backend's device: CUDA under NCCL) and over the gloo side group autooffload
makes at attach (``AgreementGroup``; always on the host). On a CPU the default group is gloo as well, so the
two rows measure the same kind of collective, and differ only by noise. Prints the median, mean and 90th
percentile per call on rank 0. Ranks run in lockstep here, so this is the collective's own cost; in training
a rank that arrives early also waits for the slowest rank, which it would do at the next gradient reduction
anyway. Under NCCL the default-group row also waits, per call, for the work queued on the device: with
``--busy-ms`` each call is preceded by that much queued device work, which the side group does not wait for.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's autooffload first
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.environment import stamp
from harness.verdicts import per_call

from autooffload.distributed import AgreementGroup, all_reduce_max, collective_device


def time_calls(calls: int, warmup: int, group: AgreementGroup | None, busy_ms: float) -> list[float]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    busy = None
    if busy_ms > 0 and torch.cuda.is_available():
        busy = torch.randn(2048, 2048, device="cuda")
    for index in range(warmup):
        all_reduce_max([index % 3, -1], group)
    times = []
    for index in range(calls):
        if busy is not None:
            queue_work(busy, busy_ms)
        start = time.perf_counter()
        level, _ = all_reduce_max([rank + index % 3, -1], group)
        times.append(time.perf_counter() - start)
        assert level == world - 1 + index % 3
    if busy is not None:
        torch.cuda.synchronize()
    return times


def queue_work(tensor: torch.Tensor, ms: float) -> None:
    """Queue about ``ms`` of matrix products on the device without waiting for them."""
    for _ in range(max(1, round(ms / 0.1))):
        tensor @ tensor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--busy-ms", type=float, default=0.0, help="device work queued before each call (GPU only)")
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args(argv)

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    side_group = AgreementGroup(always_side=True)
    rows = {
        "default group": (time_calls(options.calls, options.warmup, None, options.busy_ms), str(collective_device())),
        "gloo side group": (time_calls(options.calls, options.warmup, side_group, options.busy_ms), "cpu"),
    }
    result = {
        **stamp("rank_agreement.py", sys.argv[1:] if argv is None else argv),
        "backend": backend,
        "world_size": world,
        "calls": options.calls,
        "busy_ms": options.busy_ms,
        "rows": {name: {"device": device, **per_call(times, "us")} for name, (times, device) in rows.items()},
    }
    if rank == 0:
        same = " (on a CPU both are gloo: the same collective)" if backend == "gloo" else ""
        print(f"agreement, default backend {backend}, {world} ranks, {options.calls} calls{same}", flush=True)
        for name, row in result["rows"].items():
            print(
                f"  {name:<16} tensor on {row['device']:<7} median {row['median_us']:8.1f} us, "
                f"mean {row['mean_us']:8.1f} us, p90 {row['p90_us']:8.1f} us per micro-batch",
                flush=True,
            )
        if options.out is not None:
            options.out.mkdir(parents=True, exist_ok=True)
            (options.out / "rank_agreement.json").write_text(json.dumps(result, indent=2))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
