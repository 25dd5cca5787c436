"""What keep's margin costs: eager ``auto`` with the margin it ships with (keep_margin 0.05 of the device) and with
narrower ones, side by side with plain checkpointing and every other layer, in the peers benchmark's eager scenarios.

Produced benchmarks/results/2026-12-05-keep-margin-cpu/ (margin.json, margin.md):

    OMP_NUM_THREADS=1 python benchmarks/probes/keep_margin_cost.py \
        --out DIR --rounds 8 --scenario e b d f --margins 0.02 0.0

Each margin is a controller of its own (``Settings(keep_margin=...)``) on the ladder's shared model, its steps
interleaved with the others' as in ``benchmarks/peers.py``. Writes ``margin.json`` (the ladder's per-mode values
plus, for each margin, the round-by-round ratio against ``auto``), ``margin.md``, and prints the table. A probe run
once to answer one question, not a benchmark the suite runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import harness.scenarios as ladder  # noqa: E402  (the ladder's scenarios, models and modes)
import peers  # noqa: E402
import torch  # noqa: E402

from autooffload import OffloadController, Settings  # noqa: E402


class Margin(peers.Peer):
    """Eager ``auto`` whose keep leaves ``margin`` of the device free below memory_high (the keep_margin setting)."""

    def __init__(self, margin: float, bench: ladder.Bench) -> None:
        super().__init__("auto", bench)
        self.name = f"auto-margin-{margin:g}"
        settings = Settings(
            recompute="auto", memory_high=ladder.HIGH, memory_low=ladder.HIGH - 0.1, engine=bench.engine,
            keep_margin=margin,
        )  # fmt: skip
        self.controller = OffloadController(settings, probe=self.probe, host=self.host)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--scenario", nargs="*", default=["b", "d", "e", "f"])
    parser.add_argument("--margins", nargs="*", type=float, default=[0.02])
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    shape = ladder.SHAPES["cpu"]
    bench = ladder.Bench(shape, "cpu")
    hybrid = ladder.Bench(shape, "cpu", "jamba") if "f" in options.scenario else None
    plans, _ = ladder.budgets(bench, hybrid, options.scenario)
    options.out.mkdir(parents=True, exist_ok=True)
    results = []
    lines = [
        "| scenario | mode | vs plain | kept | max reading / budget | timed steps over | vs auto, round by round |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in options.scenario:
        plan = plans[name]
        on = hybrid if plan.model == "jamba" else bench
        modes = [peers.Peer(m, on) for m in ("plain", "every-2nd", "auto")]
        modes += [Margin(m, on) for m in options.margins]
        result = ladder.run_scenario(on, name, plan, options.rounds, modes)
        values = result["modes"]
        for mode in modes[3:]:
            values[mode.name]["paired_vs_auto"] = peers.paired(values, mode.name, "auto")
        results.append(result)
        for mode in modes:
            v = values[mode.name]
            vs = v.get("paired_vs_auto")
            cell = (
                f"{vs['median']:.3f} ({vs['low']:.3f}-{vs['high']:.3f}), faster in {vs['faster_rounds']} of "
                f"{vs['rounds']}{', **beyond**' if vs['beyond'] else ''}"
                if vs
                else ""
            )
            lines.append(
                f"| {name} | {mode.name} | {v['vs_plain']:.3f} | {v['kept']:.0%} | {v['max_reading_over_budget']:.3f} "
                f"| {v['steps_over_budget']} | {cell} |"
            )
        (options.out / "margin.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"margin: scenario {name} done", file=sys.stderr)
    (options.out / "margin.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
