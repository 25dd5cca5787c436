"""Which compiled graphs one step of ``compile-1.0`` and of ``compile-auto`` (every layer kept) runs: the profiler's
``CompiledFxGraph`` keys of the forward and the backward, inductor on the CPU.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/results/2026-12-05-compiled-keep-all-cpu/graphs_probe.py

The peers benchmark's scenario (a), both modes warmed up as there (two rounds), then one profiled step of each.
Prints, per mode, the compiled regions and graphs the step ran; the same keys mean the same generated code.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import ladder  # noqa: E402
import peers  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def main() -> int:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    bench = ladder.Bench(ladder.SHAPES["cpu"], "cpu")
    plans, _ = ladder.budgets(bench, None, ["a"])
    scenario = plans["a"]
    modes = {m: peers.Peer(m, bench) for m in ("compile-1.0", "compile-auto")}
    ladder.run_scenario(bench, "a", scenario, 2, list(modes.values()))
    how = dict(autocast=scenario.autocast, forwards=scenario.forwards, batch=scenario.batch)
    for name, mode in modes.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            row = mode.step(scenario.lengths[0], seed=2, timed=False, **how)
        ran = Counter(e.name for e in prof.events() if "CompiledFxGraph" in e.name or e.name == "CompiledFunction")
        kept = [keep for _, keep in row["plans"]]
        print(f"{name}: kept {kept} of {bench.shape.layers}, compiled in this step: {row['compiled']}")
        for event, count in sorted(ran.items()):
            print(f"  {count} x {event}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
