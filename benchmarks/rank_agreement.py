"""What the ranks' agreement costs: the one collective autooffload makes before every micro-batch's forward.

    torchrun --nproc_per_node 2 benchmarks/rank_agreement.py             # gloo on a CPU, NCCL on GPUs
    torchrun --nproc_per_node 2 benchmarks/rank_agreement.py --out DIR   # also DIR/rank_agreement.json

Times ``autooffload.distributed.all_reduce_max`` (the exact call ``agree`` makes: a one-element int64 tensor on
the backend's device, ``all_reduce(MAX)``, then ``.item()``) back to back, after a warm-up, and prints the
median, mean and 90th percentile per call on rank 0. Ranks run in lockstep here, so this is the collective's
own cost; in training a rank that arrives early also waits for the slowest rank, which it would do at the
next gradient reduction anyway. On NCCL each call also waits for the work queued on the device (none here).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch

from autooffload.distributed import all_reduce_max, collective_device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args(argv)

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for index in range(options.warmup):
        all_reduce_max(index % 3)
    times = []
    for index in range(options.calls):
        start = time.perf_counter()
        agreed = all_reduce_max(rank + index % 3)
        times.append(time.perf_counter() - start)
        assert agreed == world - 1 + index % 3
    result = {
        "backend": backend,
        "device": str(collective_device()),
        "world_size": world,
        "calls": options.calls,
        "median_us": statistics.median(times) * 1e6,
        "mean_us": statistics.fmean(times) * 1e6,
        "p90_us": statistics.quantiles(times, n=10)[-1] * 1e6,
        "torch": torch.__version__,
    }
    if rank == 0:
        print(
            f"agreement ({backend}, {world} ranks, tensor on {result['device']}): "
            f"median {result['median_us']:.1f} us, mean {result['mean_us']:.1f} us, p90 {result['p90_us']:.1f} us "
            f"per micro-batch over {options.calls} calls",
            flush=True,
        )
        if options.out is not None:
            options.out.mkdir(parents=True, exist_ok=True)
            (options.out / "rank_agreement.json").write_text(json.dumps(result, indent=2))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
