"""The ladder (keep / recompute / offload) against plain checkpointing, modes side by side in one process.

    python benchmarks/ladder.py --out DIR [--device cpu|cuda] [--rounds N] [--quick] [--scenario a b ...]

Modes, on one model with the same weights and inputs, interleaved step by step (the order rotating):

- ``none``: no checkpointing at all (the speed to reach; it may not fit the budget);
- ``plain``: transformers' checkpointing, nothing else;
- ``always``: autooffload, ``recompute="always"`` (predictive offload, every checkpointed layer recomputes);
- ``auto``: autooffload, ``recompute="auto"`` (the ladder: the last layers keep when the plan fits).

Scenarios: (a) short micro-batches only, ample memory; (b) a mixed trace, one long micro-batch in five, under
a budget where only the long ones need checkpointing (a long one without checkpointing does not fit) and where,
past the keep margin, half the layers keep at the long length with room to spare (60% of what keeping every layer
adds: sized at exactly half, the plan sits on the margin's edge); (c) long
micro-batches under a budget that needs offload (a long one with every layer recomputing does not fit; on the CPU
micro-batches of ``offload_batch`` sequences, so that offload can lower the peak at all: see below); (d) bf16
autocast over fp32 weights (each kept layer also keeps its weights' casts), a long micro-batch then four short
ones, under (b)'s kind of budget; (e) two forwards before each backward (chosen and rejected as two calls),
short micro-batches, room for 1.6 forwards' worth of kept layers: both forwards' kept layers are alive
together; (f) a model whose layers differ: a hybrid Jamba stack (state-space and attention layers, the
attention ones with a mixture of experts; the reference PyTorch kernels), short micro-batches, room for three
quarters of what keeping every layer adds. The CPU runs all six; the GPU and ``--quick`` by default (a)-(c).

The budgets, the clock and the rounds are the harness's (``harness/scenarios.py``, ``harness/rounds.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import results as written
from harness.environment import cpu_name, own_settings, stamp
from harness.scenarios import HIGH, MODES, NAMES, SHAPES, Bench, budgets, describe, run_scenario
from harness.verdicts import within_spread

TARGETS = {
    "a": "auto within 3% of none",
    "b": "auto at least 20% below plain",
    "c": "auto within the spread of always",
    "d": "auto below plain by at least half of what (a) saves",
    "e": "auto below plain by at least half of what (a) saves",
    "f": "auto below plain by at least half of what (a) saves",
}


def safe(result: dict[str, Any]) -> bool:
    """No timed step of ``always`` or ``auto`` over the budget, and no warm-up step of ``auto`` over it where
    ``always``'s is not (the first step of a length before any reading is the policy's, the same in both)."""
    modes = result["modes"]
    timed = all(modes[m]["steps_over_budget"] == 0 for m in MODES[2:])
    return timed and modes["auto"]["warmup_steps_over_budget"] <= modes["always"]["warmup_steps_over_budget"]


def verdict(result: dict[str, Any], reference: dict[str, Any] | None = None) -> bool:
    """The scenario's target (``TARGETS``) and :func:`safe`; ``reference``: scenario (a)'s result, for (d)-(f)."""
    m = result["modes"]
    auto = m["auto"]
    if not safe(result):
        return False
    if result["scenario"] == "a":
        return auto["vs_none"] <= 1.03
    if result["scenario"] == "b":
        return auto["vs_plain"] <= 0.80
    if result["scenario"] == "c":
        return within_spread(auto["median_s"], m["always"]["median_s"], m["always"]["spread"])
    if reference is None:
        return False
    saved_a = 1 - reference["modes"]["auto"]["vs_plain"]
    return 1 - auto["vs_plain"] >= 0.5 * saved_a


# ---- output ---------------------------------------------------------------------------------------------


def render(env: dict[str, Any], results: list[dict[str, Any]]) -> str:
    cpu = env["device"] == "cpu"
    clock = "process CPU time" if cpu else "CUDA events"
    lines = [
        f"# autooffload ladder: {'CPU' if cpu else 'GPU'}",
        "",
        f"- device: {env['device_name']}",
        f"- torch {env['torch']}, transformers {env['transformers']}, python {env['python']}, date {env['date']}",
        f"- command: `{env['command']}`",
        f"- model: Qwen3 layers ((f): a hybrid Jamba stack, Mamba and attention + 2 experts alternating), random "
        f"weights, {env['shape']}; autooffload's engine: {env.get('engine', 'sync')}",
        f"- time: {clock} of forward + backward per step, summed over the trace; median over {env['rounds']} "
        "rounds, modes interleaved step by step (rotating order); spread = (slowest - fastest round) / median",
        f"- budget: memory_high {HIGH} x device size; reading = "
        + (
            "weights and AdamW state + the step's peak on torch's CPU allocator (forwards and backward, gradients "
            "and transients included)"
            if cpu
            else "max_memory_allocated over the step"
        ),
        "",
        "| scenario | mode | time per trace, ms | spread | vs none | vs plain | kept | offloaded "
        "| max reading / budget | steps over budget (timed, warm-up) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for name, v in result["modes"].items():
            lines.append(
                f"| {result['scenario']} | {name} | {v['median_s'] * 1e3:.1f} | {v['spread']:.0%} | {v['vs_none']:.3f} "
                f"| {v['vs_plain']:.3f} | {v['kept']:.0%} | {v['offloaded']:.0%} "
                f"| {v['max_reading_over_budget']:.3f} | {v['steps_over_budget']}, {v['warmup_steps_over_budget']} |"
            )
    lines += ["", "Scenarios and targets:", ""]
    for result in results:
        met = "met" if result["met"] else "NOT met"
        lines.append(
            f"- {describe(result)}; target: {TARGETS[result['scenario']]}, no step of always or auto over the "
            f"budget: **{met}**"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, help="timed passes over each trace (CPU 12, GPU 3)")
    parser.add_argument("--scenario", nargs="*", choices=NAMES, help="default: all (CPU), a b c (GPU, --quick)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and one round: checks the script")
    parser.add_argument("--engine", choices=("sync", "stream"), default="sync", help="autooffload's engine (sync)")
    options = parser.parse_args(argv)
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    own_settings("ladder")
    warnings.simplefilter("ignore")
    if options.device == "cpu":
        torch.set_num_threads(1)
    rounds = options.rounds or (1 if options.quick else 12 if options.device == "cpu" else 3)
    shape = SHAPES["quick" if options.quick else options.device]
    names = options.scenario or (list(NAMES) if options.device == "cpu" and not options.quick else ["a", "b", "c"])
    bench = Bench(shape, options.device, engine=options.engine)
    hybrid = Bench(shape, options.device, "jamba", engine=options.engine) if "f" in names else None
    plans, readings = budgets(bench, hybrid, names)
    name = torch.cuda.get_device_name() if options.device == "cuda" else cpu_name()
    env = stamp(
        "ladder.py",
        argv,
        device=options.device,
        device_name=name,
        shape=dataclasses.asdict(shape),
        engine=options.engine,
        rounds=rounds,
        calibration=readings,
    )
    results = []
    for scenario in names:
        plan = plans[scenario]
        on = hybrid if plan.model == "jamba" else bench
        result = run_scenario(on, scenario, plan, rounds)
        reference = next((r for r in results if r["scenario"] == "a"), None)
        result["met"] = verdict(result, reference)
        result["safe"] = safe(result)
        results.append(result)
        written.write(options.out, "ladder", dict(env, results=results), render(env, results))
        print(f"ladder: scenario {scenario} done", file=sys.stderr)
    print((options.out / "ladder.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
