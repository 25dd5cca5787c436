"""Compiled ``auto`` where every layer keeps, against the partitioner's own step (``compile-1.0``, budget 1.0):
what the difference is. Two answers, one setup: ``graphs``, whether the two steps run the same compiled graphs; and
``own-work``, how much of the difference is autooffload's own work per micro-batch.

Produced benchmarks/results/2026-12-05-compiled-keep-all-cpu/ (own_work.json from ``own-work``, graphs.txt from
``graphs``):

    OMP_NUM_THREADS=1 python benchmarks/probes/compiled_keep_all.py own-work --out DIR [--scenario a] [--steps 60]
    OMP_NUM_THREADS=1 python benchmarks/probes/compiled_keep_all.py graphs [--scenario a] > graphs.txt

Both take the peers benchmark's ``compile-1.0`` and ``compile-auto`` on scenario (a), warmed up as there (two
rounds), inductor on the CPU. ``graphs``: one profiled step of each, printing the compiled regions and graphs
(the profiler's ``CompiledFxGraph`` keys of the forward and the backward) it ran; the same keys mean the same
generated code. ``own-work``: ``--steps`` more steps of each, alternating, none compiling; the process CPU time
spent in the controller's per-micro-batch entry points (the decision, ``before_forward``; the forward hooks'
``_begin`` and ``_end``) is summed per step by wrapping them before the controller is made; prints and writes
``own_work.json``. A probe run once to answer one question, not a benchmark the suite runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import harness.scenarios as ladder  # noqa: E402  (the ladder's scenarios, models and modes)
import peers  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

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


def count_own_work() -> None:
    """Wrap the controller's per-micro-batch entry points so that SPENT sums their CPU time. The hooks' methods run
    eagerly under compile (torch.compiler.disable): wrapped, they stay so."""
    ForwardHooks._begin = torch.compiler.disable(counted(ForwardHooks._begin.__wrapped__))
    ForwardHooks._end = torch.compiler.disable(counted(ForwardHooks._end.__wrapped__))
    OffloadController.before_forward = counted(OffloadController.before_forward)


def warmed(scenario_name: str) -> tuple[ladder.Bench, ladder.Scenario, dict[str, peers.Peer]]:
    """The two modes on the peers benchmark's model, warmed up as the peers benchmark does (two rounds)."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    bench = ladder.Bench(ladder.SHAPES["cpu"], "cpu")
    plans, _ = ladder.budgets(bench, None, [scenario_name])
    scenario = plans[scenario_name]
    modes = {m: peers.Peer(m, bench) for m in ("compile-1.0", "compile-auto")}
    ladder.run_scenario(bench, scenario_name, scenario, 2, list(modes.values()))
    return bench, scenario, modes


def graphs(scenario_name: str) -> None:
    bench, scenario, modes = warmed(scenario_name)
    how = dict(autocast=scenario.autocast, forwards=scenario.forwards, batch=scenario.batch)
    for name, mode in modes.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            row = mode.step(scenario.lengths[0], seed=2, timed=False, **how)
        ran = Counter(e.name for e in prof.events() if "CompiledFxGraph" in e.name or e.name == "CompiledFunction")
        kept = [keep for _, keep in row["plans"]]
        print(f"{name}: kept {kept} of {bench.shape.layers}, compiled in this step: {row['compiled']}")
        for event, count in sorted(ran.items()):
            print(f"  {count} x {event}")


def own_work(scenario_name: str, steps: int, out: Path) -> None:
    count_own_work()
    _, scenario, modes = warmed(scenario_name)
    how = dict(autocast=scenario.autocast, forwards=scenario.forwards, batch=scenario.batch)
    seq = scenario.lengths[0]
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    own, kept = [], set()
    for i in range(steps):
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
        scenario=scenario_name,
        seq=seq,
        steps=steps,
        kept_layers=sorted(kept),
        budget_step_ms=statistics.median(budget) * 1e3,
        auto_step_ms=statistics.median(ours) * 1e3,
        ratio=statistics.median(a / b for a, b in zip(ours, budget, strict=True)),
        faster_steps=sum(a < b for a, b in zip(ours, budget, strict=True)),
        own_work_ms=statistics.median(own) * 1e3,
        ratio_less_own_work=statistics.median((a - o) / b for a, o, b in zip(ours, own, budget, strict=True)),
        torch=torch.__version__,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "own_work.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("own-work", "graphs"))
    parser.add_argument("--scenario", default="a")
    parser.add_argument("--steps", type=int, default=60, help="own-work: timed steps of each mode")
    parser.add_argument("--out", type=Path, help="own-work: the folder own_work.json is written to")
    options = parser.parse_args(argv)
    if options.what == "graphs":
        graphs(options.scenario)
    elif options.out is None:
        parser.error("own-work needs --out")
    else:
        own_work(options.scenario, options.steps, options.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
