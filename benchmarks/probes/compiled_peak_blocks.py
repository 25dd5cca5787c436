"""What a step holds at its peak in the ladder's (c), eager, with the layers compiled in place or the whole model.

Produced benchmarks/results/2026-12-05-compile-peak-cpu/ (its where.txt):

    OMP_NUM_THREADS=1 python benchmarks/probes/compiled_peak_blocks.py \
        eager-plain,layers-plain,compile-plain,none-compiled inductor

Arguments: MODES [BACKEND]. MODES: a comma-separated list of ``eager-plain``, ``layers-plain``, ``compile-plain``
(transformers' checkpointing) and ``none-compiled`` (the whole model compiled without checkpointing); BACKEND:
inductor (default) or another dynamo backend. For one step after three (so that nothing compiles in it),
``torch.profiler``'s memory records give the most the allocator held above the step's start, the blocks alive at
that moment and the operation that allocated each (the largest six are printed). A probe run once to answer one
question, not a benchmark.
"""

from __future__ import annotations

import collections
import copy
import sys
import time
import warnings
from pathlib import Path

import torch
from torch._C._profiler import _EventType

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import harness.scenarios as ladder  # noqa: E402  (the ladder's scenarios, models and modes)

MiB = 2**20


def mark(name: str) -> None:
    with torch.profiler.record_function("mark:" + name):
        pass


def tree(prof: torch.profiler.profile) -> list:
    nodes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children)
    return nodes


def shapes(node) -> list:
    try:
        return [tuple(i.sizes) for i in node.extra_fields.inputs if hasattr(i, "sizes")][:3]
    except Exception:  # an event without inputs
        return []


def caller(node) -> str:
    names = []
    while node is not None and len(names) < 3:
        names.append(node.name[:50] + (str(shapes(node)) if not names else ""))
        node = node.parent
    return " < ".join(names)


def analyse(name: str, run) -> None:
    for _ in range(3):
        run()
    with torch.profiler.profile(profile_memory=True, record_shapes=True) as prof:
        run()
    nodes = tree(prof)
    marks = sorted((n.start_time_ns, n.name[5:]) for n in nodes if n.name.startswith("mark:"))
    blocks = [n for n in nodes if n.tag == _EventType.Allocation]
    live, held, peak, at, alive = {}, 0, 0, 0, {}
    for node in sorted(blocks, key=lambda n: n.start_time_ns):
        size = node.extra_fields.alloc_size
        if size > 0:
            live[node.extra_fields.ptr] = (size, node)
        else:
            live.pop(node.extra_fields.ptr, None)
        held += size
        if held > peak:
            peak, at, alive = held, node.start_time_ns, dict(live)
    large = [(size, node) for size, node in alive.values() if size >= MiB // 2]
    for size, node in sorted(large, key=lambda x: -x[0])[:6]:
        phase = [m for t, m in marks if t <= node.start_time_ns][-1:]
        print(f"   live {size / MiB:.1f} MiB allocated in {phase} by {caller(node.parent)}")
    sizes = collections.Counter(round(size / MiB, 2) for size, _ in large)
    counts = ", ".join(f"{k} MiB x{v}" for k, v in sorted(sizes.items(), reverse=True))
    phase = [m for t, m in marks if t <= at][-1:]
    print(f"{name}: peak {peak / MiB:.1f} MiB above the step's start, in {phase}; live blocks >= 0.5 MiB: {counts}")


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    modes = sys.argv[1].split(",")
    backend = sys.argv[2] if len(sys.argv) > 2 else "inductor"
    shape = ladder.SHAPES["cpu"]
    bench = ladder.Bench(shape, "cpu")
    ids = bench.ids(shape.long, 1, shape.offload_batch)
    for mode in modes:
        model = copy.deepcopy(bench.model)
        ladder.set_checkpointing(model, mode != "none-compiled")
        runner = model
        if mode in ("compile-plain", "none-compiled"):
            runner = torch.compile(model, backend=backend)
        elif mode == "layers-plain":
            for layer in model.model.layers:
                layer.compile(backend=backend)

        def run(model=model, runner=runner) -> None:
            mark("forward")
            loss = runner(input_ids=ids, labels=ids).loss
            loss.register_hook(lambda gradient: mark("backward"))
            loss.backward()
            model.zero_grad(set_to_none=True)

        began = time.time()
        analyse(mode, run)
        print(f"    {time.time() - began:.0f} s")
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
