"""Fastest within the budget, compiled or not: PyTorch's own ways next to autooffload, on the ladder's scenarios.

    python benchmarks/peers.py --out DIR [--rounds N] [--quick] [--scenario a b ...] [--modes ...]
                               [--backend inductor|aot_eager]

The ladder's scenarios, models, length traces and budgets (``benchmarks/ladder.py``, imported: the budget is the
step's real peak on torch's CPU allocator, gradients and the backward's transients included), with every mode
on one model with the same weights and inputs, interleaved step by step:

- eager: ``none`` (no checkpointing), ``plain`` (transformers' checkpointing), ``always`` and ``auto``
  (autooffload, ``recompute="always"`` / ``"auto"``), ``hf-offload`` (transformers' ``offload=True``: its
  ``save_on_cpu(pin_memory=True)`` cannot pin on a CPU-only build, so on the CPU the same hooks copy into host
  buffers outside torch's allocator, as a device's copy would leave it), ``sac`` (selective activation
  checkpointing, torchtitan's op policy: every layer checkpointed, the outputs of attention and of every other
  matmul saved), ``every-2nd`` (transformers' ``every_n_layers=2``: half the layers checkpointed, the rest
  keep their activations);
- compiled (``torch.compile``, ``--backend``, inductor by default): ``compile-<b>`` for
  ``activation_memory_budget`` b in 1.0, 0.5, 0.2, 0.0 (no checkpointing: the partitioner's knapsack decides what
  the backward recomputes; 1.0 is the default, speed-first), ``compile-plain`` (transformers' checkpointing,
  compiled), ``compile-auto`` (autooffload, ``recompute="auto"``, on the compiled model);
- layers compiled in place (``layer.compile()`` on each decoder layer, the rest eager): ``layers-plain``
  (transformers' checkpointing) and ``layers-auto`` (autooffload, ``recompute="auto"``). Whole-model compiles
  peak higher than eager on the CPU (``benchmarks/results/2026-12-04-compile-regions-cpu``); these do not.

Per mode and scenario: the trace's process CPU time (median over the rounds, the spread, against plain and
against the fastest mode that fits), the real peak's largest reading against the budget and the steps over it,
and for compiled modes the compile apart: the warm-up's wall time, the graphs compiled (warm-up, timed) and
the graph breaks. ``compile-auto`` also reports its recompiling plan switches (the controller's budget), and,
per length of the scenario, its loss and gradients against ``compile-plain``'s for the same input. A mode
"fits" when no timed step is over the budget and its warm-up is no worse than ``always``'s (the first step of a
length, before any reading, is the policy's).

The modes themselves are ``harness/peer_modes.py``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import results as written
from harness import scenarios as ladder
from harness.compiled import graph_breaks
from harness.environment import cpu_name, load, own_settings, stamp
from harness.forms import transformers_options
from harness.peer_modes import Peer, compare_compiled
from harness.verdicts import paired as paired_rounds

EAGER = ("none", "plain", "always", "auto", "hf-offload", "sac", "every-2nd")
BUDGETS = (1.0, 0.5, 0.2, 0.0)
COMPILED = ("compile-plain", *(f"compile-{b}" for b in BUDGETS), "compile-auto")
LAYERS = ("layers-plain", "layers-auto")
MODES = EAGER + COMPILED + LAYERS
OURS = ("always", "auto", "compile-auto", "layers-auto")
# Whom each of ours is held against round by round: the other modes of its kind.
KIND = {"always": EAGER, "auto": EAGER, "compile-auto": COMPILED, "layers-auto": LAYERS}


# ---- a scenario -----------------------------------------------------------------------------------------------


def fits(values: dict[str, Any], always: dict[str, Any] | None) -> bool:
    warm = always["warmup_steps_over_budget"] if always is not None else 0
    return values["steps_over_budget"] == 0 and values["warmup_steps_over_budget"] <= warm


def run(bench: ladder.Bench, name: str, scenario: ladder.Scenario, rounds: int, modes: list[str], backend: str):
    peers = {m: Peer(m, bench, backend) for m in modes}
    result = ladder.run_scenario(bench, name, scenario, rounds, list(peers.values()))
    values = result["modes"]
    always = values.get("always")
    for mode, peer in peers.items():
        v = values[mode]
        v["fits"] = fits(v, always)
        if peer.compiled:
            v["compile"] = dict(
                warmup_wall_s=peer.warmup_wall_s,
                graphs=dict(peer.graphs),
                timed_steps_compiling=peer.compiled_timed_steps,
            )
        if peer.controller is not None:
            budget = peer.controller.planner.budget
            v["switch_budget"] = dict(
                spent=budget.spent, recompiled=budget.recompiles, latched=peer.controller.planner.latched
            )
    fitting = [m for m in modes if values[m]["fits"] and m not in OURS]
    fastest = fastest_fitting(values, fitting)
    result["fastest_fitting_peer"] = fastest
    for v in values.values():
        v["vs_fastest_fitting"] = v["median_s"] / values[fastest]["median_s"] if fastest else None
    budgets = [m for m in modes if m.startswith("compile-") and m[len("compile-") :][0].isdigit()]
    result["fastest_fitting_budget"] = fastest_fitting(values, budgets)
    result["compiled_equal"] = compare_compiled(bench, peers, scenario) + compare_compiled(
        bench, peers, scenario, "layers-plain"
    )
    result["graph_breaks"] = graph_breaks()
    for ours in OURS:
        if ours in values:
            values[ours]["paired"] = {m: paired(values, ours, m) for m in fitting}
    return result


def paired(values: dict[str, Any], ours: str, peer: str) -> dict[str, Any]:
    """``ours`` against ``peer`` round by round (:func:`harness.verdicts.paired`)."""
    return paired_rounds(values[ours]["round_s"], values[peer]["round_s"])


def fastest_fitting(values: dict[str, Any], modes: list[str] | tuple[str, ...]) -> str | None:
    """The fastest of ``modes`` that ran and fits."""
    fitting = [m for m in modes if m in values and values[m]["fits"]]
    return min(fitting, key=lambda m: values[m]["median_s"], default=None)


def fastest_peer(values: dict[str, Any], ours: str) -> str | None:
    """The fastest mode of ``ours``'s kind that fits, not one of ours."""
    return fastest_fitting(values, [m for m in KIND[ours] if m not in OURS])


def verdicts(result: dict[str, Any]) -> list[str]:
    """Per autooffload mode: fits, and how it stands against every peer that fits."""
    values, lines = result["modes"], []
    for ours in OURS:
        if ours not in values:
            continue
        v = values[ours]
        if not v["fits"]:
            lines.append(f"{ours} does NOT fit (max reading {v['max_reading_over_budget']:.3f} of the budget)")
            continue
        slower = [
            f"{m} ({values[m]['median_s'] / v['median_s']:.3f}x {ours}'s time)"
            for m in values
            if m not in OURS and values[m]["fits"] and values[m]["median_s"] < v["median_s"]
        ]
        if ours == "compile-auto" and result.get("fastest_fitting_budget"):
            b = result["fastest_fitting_budget"]
            ratio = v["median_s"] / values[b]["median_s"]
            lines.append(f"{ours} fits; {ratio:.3f}x the fastest compiled budget that fits ({b})")
        lines.append(
            f"{ours} fits; faster than every peer that fits"
            if not slower
            else f"{ours} fits; peers that fit and are faster: {', '.join(slower)}"
        )
    return lines


# ---- output ---------------------------------------------------------------------------------------------------

# The summary's columns: ours, then the peers it is held against (modes that fit, the fastest of them).
SUMMARY = (
    ("eager `auto`", ("auto",)),
    ("fastest other eager mode that fits", tuple(m for m in EAGER if m != "auto")),
    ("compiled `auto`", ("compile-auto",)),
    ("fastest compiled mode that fits", tuple(m for m in COMPILED if m != "compile-auto")),
    ("layers compiled, `auto`", ("layers-auto",)),
    ("layers compiled, plain", ("layers-plain",)),
)
NAMES = {"every-2nd": "every other layer", "hf-offload": "`offload=True`", "plain": "plain", "none": "none"}


def display_name(mode: str) -> str:
    """How the summaries name a mode: ``compile-0.5`` as budget 0.5."""
    return NAMES.get(mode, mode.replace("compile-", "budget ") if mode[-1].isdigit() else mode)


def _cell(values: dict[str, Any], modes: tuple[str, ...], single: bool) -> str:
    """A summary cell: one mode (its ratio to plain, spread, whether it fits) or the fastest of ``modes`` that fits."""
    present = [m for m in modes if m in values]
    if not present:
        return "-"
    if single:
        v = values[present[0]]
        over = "" if v["fits"] else f", over ({v['max_reading_over_budget']:.2f})"
        return f"{v['vs_plain']:.3f} ±{v['spread'] / 2:.0%}{over}"
    best = fastest_fitting(values, present)
    if best is None:
        return "none fits"
    v = values[best]
    return f"{display_name(best)}: {v['vs_plain']:.3f} ±{v['spread'] / 2:.0%}"


def summary(results: list[dict[str, Any]]) -> list[str]:
    """The issue's table: per scenario, CPU time against plain checkpointing of ours and of the fastest peer that
    fits, each with half its spread (a ratio apart from another by more than both half-spreads is beyond them)."""
    lines = [
        "| scenario | " + " | ".join(title for title, _ in SUMMARY) + " |",
        "|---" * (len(SUMMARY) + 1) + "|",
    ]
    for result in results:
        values = result["modes"]
        cells = [_cell(values, modes, title.endswith("`auto`") or title.endswith("plain")) for title, modes in SUMMARY]
        lines.append(f"| {result['scenario']} | " + " | ".join(cells) + " |")
    return lines


def paired_table(results: list[dict[str, Any]]) -> list[str]:
    columns = [m for m in ("auto", "compile-auto", "layers-auto") if any(m in r["modes"] for r in results)]
    lines = ["| scenario | " + " | ".join(f"`{m}`" for m in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for result in results:
        values, cells = result["modes"], []
        for ours in columns:
            peer = fastest_peer(values, ours) if ours in values and values[ours]["fits"] else None
            if peer is None:
                cells.append("-")
                continue
            p = values[ours]["paired"][peer]
            cells.append(
                f"{display_name(peer)}: {p['median']:.3f} ({p['low']:.3f}-{p['high']:.3f}), "
                f"faster in {p['faster_rounds']} of {p['rounds']}{', **beyond**' if p['beyond'] else ''}"
            )
        lines.append(f"| {result['scenario']} | " + " | ".join(cells) + " |")
    return lines


def render(env: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = [
        "# autooffload and PyTorch's own ways to fit a budget: CPU",
        "",
        f"- device: {env['device_name']}; load (uptime's 1, 5, 15 min) before / after: {env['load_before']} / "
        f"{env.get('load_after', '-')}",
        f"- torch {env['torch']}, transformers {env['transformers']}, python {env['python']}, date {env['date']}",
        f"- command: `{env['command']}`",
        f"- model and scenarios: benchmarks/ladder.py's, {env['shape']}; compiled modes: {env['backend']}",
        f"- time: process CPU time of forward + backward per step, summed over the trace; median over {env['rounds']} "
        "rounds, modes interleaved step by step (rotating order); spread = (slowest - fastest round) / median",
        "- budget: memory_high 0.9 x device size; reading = weights and AdamW state + the step's peak on torch's "
        "CPU allocator (gradients and the backward's transients included); fits = no timed step over it",
        "",
        "| scenario | mode | time / trace, ms | spread | vs plain | vs fastest fitting peer | max reading / budget "
        "| steps over (timed, warm-up) | fits | kept | offloaded | compile: warm-up s, graphs (warm-up, timed) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for name, v in result["modes"].items():
            compile_ = v.get("compile")
            compiled = (
                f"{compile_['warmup_wall_s']:.0f}, {compile_['graphs']['warm-up']}, {compile_['graphs']['timed']}"
                if compile_
                else ""
            )
            fastest = v["vs_fastest_fitting"]
            lines.append(
                f"| {result['scenario']} | {name} | {v['median_s'] * 1e3:.1f} | {v['spread']:.0%} "
                f"| {v['vs_plain']:.3f} | {'-' if fastest is None else f'{fastest:.3f}'} "
                f"| {v['max_reading_over_budget']:.3f} | {v['steps_over_budget']}, {v['warmup_steps_over_budget']} "
                f"| {'yes' if v['fits'] else '**no**'} | {v['kept']:.0%} | {v['offloaded']:.0%} | {compiled} |"
            )
    lines += ["", "Against plain checkpointing (its time = 1), half the spread after ±:", "", *summary(results)]
    lines += [
        "",
        "Round by round against the fastest mode of its kind that fits (ours' time / its time, the median and the",
        "range over the rounds; **beyond** = on one side of 1 in every round):",
        "",
        *paired_table(results),
    ]
    lines += ["", "Per scenario:", ""]
    for result in results:
        lines.append(f"- {ladder.describe(result)}; fastest peer that fits: {result['fastest_fitting_peer']}")
        for verdict in verdicts(result):
            lines.append(f"  - {verdict}")
        for row in result["compiled_equal"]:
            loss = "equal" if row["loss_equal"] else f"differs by {row['loss_diff']:.2e}"
            grads = "equal" if row["grads_equal"] else f"differ by at most {row['grad_diff_rel']:.2e} of their largest"
            pair = f"{row.get('auto', 'compile-auto')} against {row.get('plain', 'compile-plain')}"
            lines.append(
                f"  - {pair} at {row['seq']} tokens (plan offload, keep "
                f"{tuple(row['auto_plan'])}): loss {loss}, gradients {grads}"
            )
        auto = result["modes"].get("compile-auto")
        if auto is not None and "switch_budget" in auto:
            b = auto["switch_budget"]
            lines.append(
                f"  - compile-auto: {b['spent']} recompiling plan switch(es) charged, {b['recompiled']} graph(s) "
                f"compiled after them{', latched' if b['latched'] else ''}"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--rounds", type=int, help="timed passes over each trace (default 12; --quick 1)")
    parser.add_argument("--scenario", nargs="*", choices=ladder.NAMES, help="default: all; --quick: a b c")
    parser.add_argument("--modes", nargs="*", choices=MODES, help="default: all")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--quick", action="store_true", help="the ladder's tiny model and one round: checks the script")
    parser.add_argument(
        "--skip-side-effects",
        action="store_true",
        help="dynamo's skip_fwd_side_effects_in_bwd_under_checkpoint: compiled checkpointing whole on transformers "
        "5.25 (docs/compile.md)",
    )
    options = parser.parse_args(argv)
    own_settings("peers")
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    # Every compiled mode keeps its own graphs for each length and plan, all on the same frames.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = options.skip_side_effects
    rounds = options.rounds or (1 if options.quick else 12)
    shape = ladder.SHAPES["quick" if options.quick else "cpu"]
    names = options.scenario or (["a", "b", "c"] if options.quick else list(ladder.NAMES))
    modes = options.modes or list(MODES)
    for mode, option in (("every-2nd", "every_n_layers"), ("hf-offload", "offload")):
        if mode in modes and option not in transformers_options():
            modes.remove(mode)
            print(f"peers: {mode} needs transformers' {option} (5.16 / 5.17 and later); left out", file=sys.stderr)
    bench = ladder.Bench(shape, "cpu")
    hybrid = ladder.Bench(shape, "cpu", "jamba") if "f" in names else None
    plans, readings = ladder.budgets(bench, hybrid, names)
    env = stamp(
        "peers.py",
        argv,
        device_name=f"{cpu_name()}, no GPU",
        shape=dataclasses.asdict(shape),
        rounds=rounds,
        backend=options.backend,
        skip_side_effects=options.skip_side_effects,
        modes=modes,
        calibration=readings,
        load_before=load(),
    )
    results = []
    for scenario in names:
        plan = plans[scenario]
        on = hybrid if plan.model == "jamba" else bench
        started = time.perf_counter()
        result = run(on, scenario, plan, rounds, modes, options.backend)
        result["wall_s"] = time.perf_counter() - started
        results.append(result)
        env["load_after"] = load()
        written.write(options.out, "peers", dict(env, results=results), render(env, results))
        print(f"peers: scenario {scenario} done ({result['wall_s']:.0f} s)", file=sys.stderr)
    print((options.out / "peers.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
