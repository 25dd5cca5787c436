"""Where the compiled step's peak lies in the ladder's (c): eager, the layers compiled in place, or the whole model
compiled (inductor), each with transformers' checkpointing and with autooffload offloading every layer
(``mode="on"``). The ladder's CPU model, 4 x 1024 tokens; the step's real peak (``AllocationPeak``, the third step
of each mode) and process CPU time, median of interleaved rounds.

Produced benchmarks/results/2026-12-04-compile-regions-cpu/ (its README's table, 8 rounds):

    OMP_NUM_THREADS=1 python benchmarks/probes/compiled_peak_by_region.py 8

A probe, run to answer one question, not a benchmark the suite runs. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import harness.scenarios as ladder  # noqa: E402  (the ladder's scenarios, models and modes)

from autooffload import OffloadController, Settings  # noqa: E402
from autooffload.observe.allocations import AllocationPeak  # noqa: E402


def setup(shape: ladder.Shape, how: str, offload: bool):
    bench = ladder.Bench(shape, "cpu")
    model = bench.model
    ladder.set_checkpointing(model, True)
    run = model
    if how == "layers":
        for layer in model.model.layers:
            layer.compile(backend="inductor")
    elif how == "whole":
        run = torch.compile(model, backend="inductor")
    controller = None
    if offload:
        controller = OffloadController(Settings(mode="on"))
        controller.attach(model, compiled=how != "eager")
    return bench, model, run, controller


def step(bench, model, run, controller, peak: bool):
    ids = bench.ids(1024, 0, batch=4)
    gc.collect()
    window = AllocationPeak() if peak else None
    if window:
        window.start()
    began = time.process_time()
    run(input_ids=ids, labels=ids).loss.backward()
    spent = time.process_time() - began
    top = window.stop() if window else None
    model.zero_grad(set_to_none=True)
    if controller is not None:
        controller.end_step()
    return spent, top


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rounds", nargs="?", type=int, default=5, help="interleaved timed rounds (default 5)")
    rounds = parser.parse_args(argv).rounds
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64
    shape = ladder.SHAPES["cpu"]
    rows = {}
    for offload in (False, True):
        for how in ("eager", "layers", "whole"):
            name = f"{how}, {'offload every layer' if offload else 'checkpointing'}"
            s = setup(shape, how, offload)
            for _ in range(2):
                step(*s, peak=False)
            _, top = step(*s, peak=True)
            rows[name] = (s, top, [])
    for r in range(rounds):
        names = list(rows)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rows[name][2].append(step(*rows[name][0], peak=False)[0])
    base = statistics.median(rows["eager, checkpointing"][2])
    print(f"{rounds} interleaved rounds, 4 x 1024 tokens; torch {torch.__version__}")
    print("| mode | step's real peak, MiB | CPU time vs eager checkpointing | spread |")
    print("|---|---|---|---|")
    for name, (_, top, times) in rows.items():
        m = statistics.median(times)
        print(f"| {name} | {top / 2**20:.1f} | {m / base:.3f} | {(max(times) - min(times)) / m:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
