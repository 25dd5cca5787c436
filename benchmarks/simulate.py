"""Replay micro-batch lengths against a simulated device and compare offload policies, without a GPU.

    python benchmarks/simulate.py --out DIR [--scenario NAME ...] [--trace FILE ...] [--seeds 1 2]

The policies and the replay: ``simulation/policies.py``; the scenarios, the memory model and its calibration from a
measured results file of ``benchmarks/bench.py`` (``--results``): ``simulation/device.py``. Per scenario and trace,
every policy's out-of-memory steps, the bytes it copied against the oracle's, its switches, and its time against
plain checkpointing's, with the targets the predictive policy must meet.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.environment import now
from harness.results import pyplot
from simulation.device import (
    FIXED_TRACE,
    GIB,
    SCENARIOS,
    Calibration,
    MemoryModel,
    Scenario,
    bursty,
    calibrate,
    compute_seconds,
    longtail,
    packed,
    read_trace,
)
from simulation.policies import POLICIES, replay

from autooffload.settings import Settings

HERE = Path(__file__).resolve().parent


def compare(
    scenario: Scenario,
    trace_name: str,
    lengths: list[int],
    calibration: Calibration,
    options: argparse.Namespace,
) -> dict[str, Any]:
    """Every policy over one trace on one scenario, with times and the ratios to the oracle."""
    model = MemoryModel(scenario, calibration)
    rng = random.Random(options.seed)
    noises = [rng.uniform(0, options.noise) for _ in lengths]
    settings = Settings.from_env({})
    bandwidth = calibration.bandwidth or options.bandwidth * 1e9
    compute = compute_seconds(scenario, lengths, options.flops * 1e12)
    total_compute = sum(compute)
    step_compute = statistics.fmean(compute)
    flops = options.flops * 1e12
    rows = [replay(name, model, lengths, noises, settings, options.micro_batches, flops) for name in POLICIES]
    by_name = {row["policy"]: row for row in rows}
    oracle = by_name["oracle"]["bytes"]
    plain_recompute = by_name["never"]["recompute_s"]
    for row in rows:
        row["copy_s"] = 2 * row["bytes"] / bandwidth
        row["failed_attempts_s"] = row["oom_steps"] * step_compute * options.micro_batches
        row["overhead"] = (row["copy_s"] + row["failed_attempts_s"]) / total_compute
        row["bytes_vs_oracle"] = row["bytes"] / oracle if oracle else None
        skipped = plain_recompute - row["recompute_s"]
        row["total_s"] = total_compute - skipped + row["copy_s"] + row["failed_attempts_s"]
        row["time_vs_plain"] = row["total_s"] / total_compute
    predictive, oracle_row = by_name["predictive"], by_name["oracle"]
    ratio = predictive["bytes_vs_oracle"]
    first_reading_oom = [step for step in predictive["oom_at"] if step > 0]
    constant = len(set(lengths)) == 1
    return {
        "scenario": scenario.name,
        "trace": trace_name,
        "steps": len(lengths),
        "max_seq": max(lengths),
        "compute_s": total_compute,
        "rows": rows,
        "constant": constant,
        "target": {
            "no_oom_after_step_0_where_the_oracle_has_none": bool(oracle_row["oom_steps"]) or not first_reading_oom,
            "bytes_within_1.05x_oracle": (predictive["bytes"] == 0) if ratio is None else ratio <= 1.05,
            "at_most_one_switch_on_a_constant_trace": not constant or predictive["switches"] <= 1,
        },
    }


# ---- output -----------------------------------------------------------------------------------------------


def table(results: list[dict[str, Any]]) -> str:
    head = (
        "| scenario | trace | policy | OOM steps | not rescuable | GiB copied | x oracle | time overhead "
        "| steps offloading | switches | levels used | kept | time vs plain checkpointing |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for result in results:
        for row in result["rows"]:
            ratio = "-" if row["bytes_vs_oracle"] is None else f"{row['bytes_vs_oracle']:.2f}"
            levels = row["distinct_levels"]
            shown = (
                ", ".join(map(str, levels)) if len(levels) <= 5 else f"{len(levels)} levels, {levels[0]}..{levels[-1]}"
            )
            lines.append(
                f"| {result['scenario']} | {result['trace']} | {row['policy']} | {row['oom_steps']} "
                f"| {row['unrescued_steps']} | {row['bytes'] / GIB:,.1f} | {ratio} | {row['overhead']:.2%} "
                f"| {row['steps_offloading']} / {row['steps']} | {row['switches']} | {shown} "
                f"| {row['kept_share']:.0%} | {row['time_vs_plain']:.3f} |"
            )
    return head + "\n".join(lines) + "\n"


def summary(results: list[dict[str, Any]]) -> str:
    """The targets, counted over every scenario and trace."""

    def row(result: dict[str, Any], name: str) -> dict[str, Any]:
        return next(r for r in result["rows"] if r["policy"] == name)

    clear = [r for r in results if not row(r, "oracle")["oom_steps"]]
    late_oom = [(r["scenario"], r["trace"], s) for r in clear for s in row(r, "predictive")["oom_at"] if s > 0]
    first_oom = sum(0 in row(r, "predictive")["oom_at"] for r in clear)
    ratios = [row(r, "predictive")["bytes_vs_oracle"] for r in results]
    measured = [x for x in ratios if x is not None]
    zero = sum(1 for r, x in zip(results, ratios, strict=True) if x is None and row(r, "predictive")["bytes"] == 0)
    constant = [r for r in results if r["constant"]]
    lines = [
        f"Targets, over {len(results)} scenario x trace blocks ({len(results) - len(clear)} where even the oracle "
        "runs out of memory: nothing fits there):",
        f"- predictive out-of-memory steps after step 0 where the oracle has none ({len(clear)} blocks): "
        f"{len(late_oom)}{f' {late_oom[:4]}' if late_oom else ''}; at step 0, before any reading: {first_oom} blocks",
        f"- predictive bytes / oracle bytes: max {max(measured):.3f}, median {statistics.median(measured):.3f}"
        f" ({len(measured)} blocks; in {zero} more the oracle and predictive both copy nothing)"
        if measured
        else "- predictive bytes / oracle bytes: the oracle copies nothing anywhere",
        f"- switches of predictive on constant traces ({len(constant)} blocks): max "
        f"{max((row(r, 'predictive')['switches'] for r in constant), default=0)}",
        f"- blocks missing a target: {sum(not all(r['target'].values()) for r in results)}",
    ]
    times = [row(r, "ladder")["time_vs_plain"] for r in results]
    ladder_oom = sum(row(r, "ladder")["oom_steps"] - row(r, "predictive")["oom_steps"] for r in results)
    lines.append(
        f"- ladder (recompute=auto) time / plain checkpointing's: median {statistics.median(times):.3f}, "
        f"best {min(times):.3f}, worst {max(times):.3f}; out-of-memory steps beyond predictive's: {ladder_oom}"
    )
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    try:
        plt = pyplot()
    except ImportError:
        return False
    scenarios = list(dict.fromkeys(r["scenario"] for r in results))
    figure, axes = plt.subplots(len(scenarios), 1, figsize=(11, 3.2 * len(scenarios)), squeeze=False)
    names = [p for p in POLICIES if p not in ("never", "always")]
    for axis, scenario in zip(axes[:, 0], scenarios, strict=True):
        mine = [r for r in results if r["scenario"] == scenario]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            rows = [next(row for row in r["rows"] if row["policy"] == name) for r in mine]
            xs = [j + i * width for j in range(len(mine))]
            bars = axis.bar(xs, [row["bytes"] / GIB for row in rows], width, label=name)
            for bar, row in zip(bars, rows, strict=True):
                if row["oom_steps"]:
                    axis.annotate(f"{row['oom_steps']} OOM", (bar.get_x(), bar.get_height()), fontsize=7, color="red")
        axis.set_xticks([j + 0.4 - width / 2 for j in range(len(mine))], [r["trace"] for r in mine], fontsize=8)
        axis.set_ylabel("GiB copied to host")
        axis.set_title(f"{scenario}: {SCENARIOS[scenario].description}", fontsize=9)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for simulate.md, simulate.json, simulate.png")
    parser.add_argument("--scenario", nargs="*", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--trace", nargs="*", type=Path, default=[FIXED_TRACE], help="trace files to replay")
    parser.add_argument("--seeds", nargs="*", type=int, default=[1, 2], help="generated traces: longtail and bursty")
    parser.add_argument(
        "--packed", nargs="*", type=int, default=[8192, 32768, 131072], help="fixed-length traces (packing)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-micro-batch noise")
    parser.add_argument("--noise", type=float, default=0.03, help="fragmentation: peaks grow by up to this share")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--bandwidth", type=float, default=25.0, help="host link, GB/s each way (sync engine)")
    parser.add_argument("--flops", type=float, default=400.0, help="achieved TFLOP/s of the device, for compute time")
    parser.add_argument(
        "--results",
        nargs="*",
        type=Path,
        default=sorted((HERE / "results").glob("*/results.json")),
        help="results.json files of benchmarks/bench.py to calibrate from (GPU runs only)",
    )
    parser.add_argument("--work-scale", type=float, help="override: w as a multiple of the arithmetic estimate")
    parser.add_argument(
        "--freed-fraction", type=float, help="override: f, the share of a layer input freed at the peak"
    )
    options = parser.parse_args(argv)

    calibration = calibrate(options.results)
    overrides = {"work_scale": options.work_scale, "freed_fraction": options.freed_fraction}
    if any(v is not None for v in overrides.values()):
        given = {k: v for k, v in overrides.items() if v is not None}
        calibration = dataclasses.replace(calibration, **given, source=f"{calibration.source}, overridden: {given}")
    traces = [(path.stem, read_trace(path)) for path in options.trace]
    traces += [(f"longtail-seed{seed}", longtail(seed)) for seed in options.seeds]
    traces += [(f"bursty-seed{seed}", bursty(seed)) for seed in options.seeds]
    traces += [(f"pack-{length // 1024}k", packed(length)) for length in options.packed]
    results = [
        compare(SCENARIOS[name], trace_name, lengths, calibration, options)
        for name in options.scenario
        for trace_name, lengths in traces
    ]
    options.out.mkdir(parents=True, exist_ok=True)
    text = table(results)
    bandwidth = (
        f"{calibration.bandwidth / 1e9:.1f} GB/s (measured)" if calibration.bandwidth else f"{options.bandwidth} GB/s"
    )
    header = (
        "# autooffload: policies replayed on a simulated device\n\n"
        f"- command: `python benchmarks/simulate.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n"
        f"- date: {now()}\n"
        f"- memory model: {calibration.source}; work scale {calibration.work_scale:.2f}, "
        f"freed fraction {calibration.freed_fraction:.2f}, noise up to {options.noise:.0%}\n"
        f"- time: copies at {bandwidth} each way, not overlapped (sync engine); compute at {options.flops} TFLOP/s\n"
        f"- micro-batches per step: {options.micro_batches}; settings: defaults ({Settings.from_env({}).to_dict()})\n\n"
        + summary(results)
        + "\n"
    )
    scenarios = "".join(f"- `{s.name}`: {s.description}\n" for s in (SCENARIOS[n] for n in options.scenario))
    report = header + "Scenarios:\n\n" + scenarios + "\n" + text
    (options.out / "simulate.md").write_text(report)
    payload = {
        "argv": argv if argv is not None else sys.argv[1:],
        "calibration": dataclasses.asdict(calibration),
        "scenarios": {n: dataclasses.asdict(SCENARIOS[n]) for n in options.scenario},
        "settings": Settings.from_env({}).to_dict(),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(options).items() if k != "results"},
        "results": results,
    }
    (options.out / "simulate.json").write_text(json.dumps(payload, indent=1, default=str))
    plotted = plot(results, options.out / "simulate.png")
    print(report + ("" if plotted else "\n(matplotlib not importable: no plot)\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
