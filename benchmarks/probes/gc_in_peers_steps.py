"""Do Python's collections fall inside the peers benchmark's timed steps, and how much CPU time do they take there?
``benchmarks/peers.py`` run as it is, with the CPU time of the collections inside each step's timed part logged.

Produced benchmarks/results/2026-12-05-peers-cpu-rounds/gc-in-steps.md:

    OMP_NUM_THREADS=1 python benchmarks/probes/gc_in_peers_steps.py \
        --out DIR --scenario f --rounds 8 --modes plain auto every-2nd sac

Takes peers.py's arguments. After peers' own output, prints one line per step: the mode, its CPU time, the
collections' CPU time in it, and the collections over 50 ms (generation, seconds, objects collected). A probe run
once to answer one question, not a benchmark the suite runs.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import harness.scenarios as ladder  # noqa: E402  (the ladder's scenarios, models and modes)
import peers  # noqa: E402

spent, began, long_ones, log = [0.0], [0.0], [], []
timed_step = ladder.Mode._cpu_step


def collection(phase: str, info: dict) -> None:
    if phase == "start":
        began[0] = time.process_time()
        return
    seconds = time.process_time() - began[0]
    spent[0] += seconds
    if seconds > 0.05:
        long_ones.append((info["generation"], round(seconds, 3), info["collected"]))


def counted(self, model, inputs, seq, autocast):
    before, held = spent[0], len(long_ones)
    out = timed_step(self, model, inputs, seq, autocast)
    log.append((self.name, round(out[1], 3), round(spent[0] - before, 3), long_ones[held:]))
    return out


def main(argv: list[str] | None = None) -> int:
    gc.callbacks.append(collection)
    ladder.Mode._cpu_step = counted
    try:
        return peers.main(argv)
    finally:
        for row in log:
            print(*row)


if __name__ == "__main__":
    sys.exit(main())
