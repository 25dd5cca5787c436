"""Python's garbage collector per training step, with and without autooffload (CPU, tiny Qwen3 through a custom
loop): do autooffload's modes make collections more frequent or leave cyclic garbage behind?

Produced benchmarks/results/2026-12-05-gc-cpu/ (the tables in its README):

    OMP_NUM_THREADS=1 python benchmarks/probes/gc_per_step.py

Per configuration, after 5 warm-up steps, over 30 steps: the automatic collections per step by generation and their
time (gc.callbacks), and, over 10 steps with gc.DEBUG_SAVEALL, the cyclic garbage a step leaves by type. The model
is the test suite's tiny Qwen3 (``autooffload.demo.tiny_qwen3``, hidden 64, vocabulary 256) with 8 layers. A probe
run once to answer one question, not a benchmark the suite runs.
"""

from __future__ import annotations

import collections
import gc
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]
from autooffload import OffloadController, Settings  # noqa: E402
from autooffload.demo import tiny_qwen3  # noqa: E402

CONFIGS = [None, ("off", "sync", "always"), ("on", "sync", "always"), ("on", "stream", "always"),
           ("auto", "sync", "always"), ("auto", "sync", "auto")]  # fmt: skip
LAYERS, HIDDEN, VOCAB = 8, 64, 256


def steps(net, optimizer, controller, count, seq=256):
    for step in range(count):
        ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(step))
        net(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if controller is not None:
            controller.end_step()


def measure(config):
    torch.manual_seed(0)
    net = tiny_qwen3(LAYERS, HIDDEN, VOCAB, 0)
    net.gradient_checkpointing_enable({"use_reentrant": False})
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    controller = None
    if config is not None:
        mode, engine, recompute = config
        controller = OffloadController(Settings(mode=mode, engine=engine, recompute=recompute), probe=None)
        controller.attach(net, optimizer=optimizer)
    steps(net, optimizer, controller, 5)
    counts, began = collections.Counter(), [0.0]

    def watch(phase, info):
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            counts[f"gen{info['generation']}"] += 1
            counts["ms"] += (time.perf_counter() - began[0]) * 1e3

    gc.collect()
    gc.callbacks.append(watch)
    steps(net, optimizer, controller, 30)
    gc.callbacks.remove(watch)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    garbage = collections.Counter()
    for _ in range(10):
        steps(net, optimizer, controller, 1)
        gc.collect()
        garbage.update(type(o).__name__ for o in gc.garbage)
        gc.garbage.clear()
    gc.set_debug(0)
    if controller is not None:
        controller.detach()
    per_step = {k: round(v / 30, 3) for k, v in sorted(counts.items())}
    return per_step, {k: v // 10 for k, v in garbage.most_common()}


def main() -> int:
    print(f"gc thresholds {gc.get_threshold()}, python {sys.version.split()[0]}, torch {torch.__version__}")
    for config in CONFIGS:
        per_step, garbage = measure(config)
        name = "plain checkpointing" if config is None else "mode={}, engine={}, recompute={}".format(*config)
        print(f"{name}: collections per step {per_step}; cyclic garbage per step {garbage}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
