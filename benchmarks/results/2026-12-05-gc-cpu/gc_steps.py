"""Python's garbage collector per training step, with and without autooffload (CPU, tiny Qwen3 through a custom loop).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/results/2026-12-05-gc-cpu/gc_steps.py

Per configuration, after 5 warm-up steps, over 30 steps: the automatic collections per step by generation and their
time (gc.callbacks), and, over 10 steps with gc.DEBUG_SAVEALL, the cyclic garbage a step leaves by type."""

import collections
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from conftest import model

from autooffload import OffloadController, Settings

CONFIGS = [None, ("off", "sync", "always"), ("on", "sync", "always"), ("on", "stream", "always"),
           ("auto", "sync", "always"), ("auto", "sync", "auto")]  # fmt: skip


def steps(net, optimizer, controller, count, seq=256):
    for step in range(count):
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(step))
        net(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if controller is not None:
            controller.end_step()


def measure(config):
    torch.manual_seed(0)
    net = model(layers=8)
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


print(f"gc thresholds {gc.get_threshold()}, python {sys.version.split()[0]}, torch {torch.__version__}")
for config in CONFIGS:
    per_step, garbage = measure(config)
    name = "plain checkpointing" if config is None else "mode={}, engine={}, recompute={}".format(*config)
    print(f"{name}: collections per step {per_step}; cyclic garbage per step {garbage}")
