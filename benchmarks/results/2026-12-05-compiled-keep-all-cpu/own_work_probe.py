"""Compiled ``auto`` where every layer keeps, against the partitioner's own step (budget 1.0): how much of the
difference is autooffload's own work per micro-batch.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/results/2026-12-05-compiled-keep-all-cpu/own_work_probe.py \
        [--scenario a] [--steps 60] [--out DIR]

The peers benchmark's ``compile-1.0`` and ``compile-auto`` on scenario (a), warmed up as there (two rounds), then
``--steps`` more steps of each, alternating, none compiling. The process CPU time spent in the controller's
per-micro-batch entry points (the decision, ``before_forward``; the forward hooks' ``_begin`` and ``_end``) is summed
per step by wrapping them before the controller is made. Prints and writes ``own_work.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import ladder  # noqa: E402
import peers  # noqa: E402
import torch  # noqa: E402

from autooffload.apply.hooks import ForwardHooks  # noqa: E402
from autooffload.controller import OffloadController  # noqa: E402

SPENT = [0.0]


def counted(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        began = time.process_time()
        try:
            return method(*args, **kwargs)
        finally:
            SPENT[0] += time.process_time() - began

    return wrapper


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="a")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    options = parser.parse_args()
    # The hooks' methods run eagerly under compile (torch.compiler.disable): wrapped, they stay so.
    ForwardHooks._begin = torch.compiler.disable(counted(ForwardHooks._begin.__wrapped__))
    ForwardHooks._end = torch.compiler.disable(counted(ForwardHooks._end.__wrapped__))
    OffloadController.before_forward = counted(OffloadController.before_forward)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    bench = ladder.Bench(ladder.SHAPES["cpu"], "cpu")
    plans, _ = ladder.budgets(bench, None, [options.scenario])
    scenario = plans[options.scenario]
    modes = {m: peers.Peer(m, bench) for m in ("compile-1.0", "compile-auto")}
    ladder.run_scenario(bench, options.scenario, scenario, 2, list(modes.values()))
    how = dict(autocast=scenario.autocast, forwards=scenario.forwards, batch=scenario.batch)
    seq = scenario.lengths[0]
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    own, kept = [], set()
    for i in range(options.steps):
        for name, mode in modes.items():
            SPENT[0] = 0.0
            row = mode.step(seq, seed=i, timed=False, **how)
            assert not row["compiled"], "a step compiled: not a steady step"
            seconds[name].append(row["seconds"])
            if name == "compile-auto":
                own.append(SPENT[0])
                kept.update(keep for _, keep in row["plans"])
    budget, ours = seconds["compile-1.0"], seconds["compile-auto"]
    result = dict(
        scenario=options.scenario,
        seq=seq,
        steps=options.steps,
        kept_layers=sorted(kept),
        budget_step_ms=statistics.median(budget) * 1e3,
        auto_step_ms=statistics.median(ours) * 1e3,
        ratio=statistics.median(a / b for a, b in zip(ours, budget, strict=True)),
        faster_steps=sum(a < b for a, b in zip(ours, budget, strict=True)),
        own_work_ms=statistics.median(own) * 1e3,
        ratio_less_own_work=statistics.median((a - o) / b for a, o, b in zip(ours, own, budget, strict=True)),
        torch=torch.__version__,
    )
    (options.out / "own_work.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
