"""peers.py with the CPU time of Python's collections inside each step's timed part logged.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/results/2026-12-05-peers-cpu-rounds/gc_probe.py \
        --out DIR --scenario f --rounds 8 --modes plain auto every-2nd sac

Prints, per step: the mode, its CPU time, the collections' CPU time in it, and the collections over 50 ms
(generation, seconds, objects collected).
"""

import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

import ladder  # noqa: E402
import peers  # noqa: E402

spent, began, long_ones, log = [0.0], [0.0], [], []


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


gc.callbacks.append(collection)
timed_step, ladder.Mode._cpu_step = ladder.Mode._cpu_step, counted
try:
    peers.main(sys.argv[1:])
finally:
    for row in log:
        print(*row)
