"""A mixed-length trace that can decide: every way to hold checkpointed inputs, over several interleaved passes.

    python benchmarks/mixed.py --out DIR [--device cuda|cpu] [--passes 4] [--variants room budget] [--quick]

The modes (``MODES``), the variants (``room``; ``budget``, sized so that the long micro-batches must offload some
layers) and what is reported per mode: benchmarks/README.md. Every autooffload mode keeps its controller and its host
memory across the whole run, as one training run would; the first pass is the warm-up, reported apart. A step's
reading is ``max_memory_allocated`` over it on a GPU (a CPU: the weights plus torch's CPU allocator's peak over the
step), and the controllers read the same, as at most the device's size. Two modes are compared pass by pass (the
passes are interleaved, so a drift of the machine moves both): A is faster than B where its total is below B's in
every timed pass; the verdicts' tolerance is that spread, never a fixed figure. Writes ``mixed.json`` and
``mixed.md`` into ``--out`` after each variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import results as written
from harness.environment import cpu_name, own_settings, stamp
from harness.forms import torchtune_offloading
from harness.models import Shape, StepProbe, build_model, token_ids
from harness.rounds import interleaved
from harness.trace_modes import HIGH, MODES, Mode, run_step
from harness.verdicts import faster_in_every_round, negated, ratio_range, shown, spread
from harness.verdicts import ratios as verdicts_ratios

from autooffload.observe.costs import GcWatch

SHAPES = {
    # Qwen3-1.7B's layer shape, 16 of its 28 layers (the check's time); a 1024-token vocabulary. At 32k tokens the
    # step's peak is at the start of the backward, every layer's input alive, where offload lowers it (at 16k it
    # is at the end, weights' gradients and the first layer's backward, where it cannot).
    "cuda": Shape(16, 2048, 16, 128, 1024, "bf16", 4096, 32768),
    "cpu": Shape(4, 128, 4, 32, 1024, "fp32", 256, 1024),
    "quick": Shape(2, 64, 4, 16, 256, "fp32", 32, 128),
}
GIB = 2**30


def trace(shape: Shape) -> list[int]:
    """One pass: mostly short micro-batches, one long in five (the third)."""
    return [shape.short, shape.short, shape.long, shape.short, shape.short]


# ---- one variant: warm-up and timed passes ---------------------------------------------------------------


def calibrate(model: torch.nn.Module, shape: Shape, device: str, tune: Any, total: int, watch: GcWatch) -> dict:
    """Peaks of a long and a short micro-batch with every layer recomputing and with every layer offloaded."""
    probe = StepProbe(total, separate_host=device == "cpu")
    found = {}
    for name in ("plain", "on/sync"):
        mode = Mode(name, model, device, probe, tune)
        for seq in (shape.long, shape.short):
            ids = token_ids(shape.vocab, seq, seq, device)
            found[f"{name}_{seq}"] = run_step(mode, ids, device == "cpu", watch)["peak"]
        mode.close()
    return found


def run_variant(
    model: torch.nn.Module, shape: Shape, device: str, variant: str, total: int, passes: int, tune: Any,
    names: list[str], watch: GcWatch, deadline: float,
) -> dict[str, Any]:  # fmt: skip
    """The warm-up pass and up to ``passes`` timed passes (fewer where ``deadline`` would pass), every mode."""
    probe = StepProbe(total, separate_host=device == "cpu")
    modes = [Mode(name, model, device, probe, tune) for name in names]
    lengths = trace(shape)
    began = time.monotonic()
    timed_passes = 0
    failed: dict[str, str] = {}
    for index in range(passes + 1):
        if index >= 2 and time.monotonic() + (time.monotonic() - began) / index > deadline:
            break  # another pass would end past the deadline: what ran is reported
        for _, i, seq, mode in interleaved(range(index, index + 1), lengths, modes):
            if mode.name in failed:
                continue
            try:
                row = run_step(mode, token_ids(shape.vocab, seq, 1000 * index + i, device), device == "cpu", watch)
            except Exception as error:  # one mode that cannot run (a peer on this torch) leaves the others be
                failed[mode.name] = f"failed at pass {index}: {type(error).__name__}: {str(error)[:300]}"
                model.zero_grad(set_to_none=True)
                continue
            row["pass"] = index
            mode.steps.append(row)
        timed_passes = index
    for mode in modes:
        mode.close()
    modes = [mode for mode in modes if mode.name not in failed]
    limit = HIGH * total
    result: dict[str, Any] = dict(variant=variant, total_bytes=total, budget_bytes=limit, lengths=lengths)
    result["timed_passes"], result["modes"], result["failed"] = timed_passes, {}, failed
    for mode in modes:
        result["modes"][mode.name] = summarise(mode.steps, timed_passes, limit, shape)
    return result


def summarise(steps: list[dict[str, Any]], passes: int, limit: float, shape: Shape) -> dict[str, Any]:
    timed = [s for s in steps if s["pass"] > 0]
    totals = [sum(s["seconds"] for s in timed if s["pass"] == p) for p in range(1, passes + 1)]
    median = statistics.median(totals) if totals else float("nan")
    over = [s for s in steps if s["peak"] is not None and s["peak"] > limit]
    return dict(
        pass_s=totals,
        median_s=median,
        spread=spread(totals) if totals else None,
        warmup_s=sum(s["seconds"] for s in steps if s["pass"] == 0),
        short_median_s=statistics.median([s["seconds"] for s in timed if s["seq"] == shape.short] or [float("nan")]),
        long_median_s=statistics.median([s["seconds"] for s in timed if s["seq"] == shape.long] or [float("nan")]),
        steps_over_budget=sum(s["pass"] > 0 for s in over),
        warmup_steps_over_budget=sum(s["pass"] == 0 for s in over),
        max_peak=max((s["peak"] for s in steps if s["peak"] is not None), default=None),
        long_offloaded=[s["offloaded"] for s in timed if s["seq"] == shape.long],
        short_offloaded=sorted({s["offloaded"] for s in timed if s["seq"] == shape.short}),
        kept=sorted({s["kept"] for s in timed}),
        gc_collections=sum(s["gc_collections"] for s in timed),
        gc_seconds=round(sum(s["gc_seconds"] for s in timed), 4),
        steps=steps,
    )


# ---- comparisons and verdicts ----------------------------------------------------------------------------


def passes(result: dict[str, Any], a: str, b: str) -> tuple[list[float], list[float]]:
    """A's and B's pass totals (none where either did not run)."""
    modes = result["modes"]
    return (modes[a]["pass_s"], modes[b]["pass_s"]) if a in modes and b in modes else ([], [])


def ratios(result: dict[str, Any], a: str, b: str) -> list[float]:
    """A's pass totals over B's, pass by pass (the passes are interleaved: a drift moves both)."""
    return verdicts_ratios(*passes(result, a, b))


def faster(result: dict[str, Any], a: str, b: str) -> bool | None:
    """A faster than B: below it in every timed pass; None: not run."""
    return faster_in_every_round(*passes(result, a, b))


def verdicts(results: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """What the rule for the defaults reads from this benchmark (docs/engines.md, docs/ladder.md)."""
    room, budget = results.get("room"), results.get("budget")
    out: dict[str, bool | None] = {}
    if room is not None:
        modes = room["modes"]
        out["auto_faster_than_offload_true"] = faster(room, "auto", "offload=True")
        out["auto_stream_faster_than_offload_true"] = faster(room, "auto/stream", "offload=True")
        out["auto_stream_keep_faster_than_offload_true"] = faster(room, "auto/stream/keep", "offload=True")
        out["auto_stream_not_slower_than_auto"] = negated(faster(room, "auto", "auto/stream"))
        if "on/stream" in modes and "plain" in modes:
            out["on_stream_long_within_1pct_of_plain"] = (
                modes["on/stream"]["long_median_s"] <= 1.01 * modes["plain"]["long_median_s"]
            )
        out["on_stream_not_slower_than_torchtune"] = negated(faster(room, "torchtune", "on/stream"))
        keep = ratios(room, "auto/stream/keep", "plain")
        out["keep_at_most_085_of_plain"] = (statistics.median(keep) <= 0.85 and max(keep) < 1) if keep else None
    if budget is not None:
        modes = budget["modes"]
        for name in ("auto", "auto/stream", "auto/stream/keep"):
            if name in modes:
                out[f"{name.replace('/', '_')}_never_over_budget"] = modes[name]["steps_over_budget"] == 0
        if "auto/stream/keep" in modes and "auto/stream" in modes:
            out["keep_warmup_over_budget_no_more_than_stream"] = (
                modes["auto/stream/keep"]["warmup_steps_over_budget"]
                <= modes["auto/stream"]["warmup_steps_over_budget"]
            )
        out["budget_auto_faster_than_offload_true"] = faster(budget, "auto", "offload=True")
        out["budget_keep_not_slower_than_auto_stream"] = negated(faster(budget, "auto/stream", "auto/stream/keep"))
    return out


# ---- output ---------------------------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# A mixed-length trace that can decide",
        "",
        f"- device: {env['device_name']}; torch {env['torch']}, transformers {env['transformers']}, python "
        f"{env['python']}, autooffload {env['autooffload']}; {env['date']}",
        f"- command: `{env['command']}`",
        f"- model: {env['shape']}; a step is one micro-batch's forward and backward, no optimizer",
        f"- torchtune: {env['torchtune']}",
        "- time: " + ("CUDA events" if env["device"] == "cuda" else "process CPU time") + " per step, summed per "
        "pass; median over the timed passes; spread = (slowest - fastest pass) / median; the first pass is the "
        "warm-up, apart; `vs plain` and `vs offload=True`: median of the per-pass ratios, [lowest, highest]",
        "",
    ]
    for variant, result in report["results"].items():
        budget = result["budget_bytes"] / 2**20
        lines += [
            f"## {variant}: device {result['total_bytes'] / 2**20:,.1f} MiB, budget {budget:,.1f} MiB "
            f"(memory_high {HIGH}); lengths per pass {result['lengths']}, {result['timed_passes']} timed pass(es)",
            "",
            *([f"Note: {result['note']}", ""] if result.get("note") else []),
            "| mode | pass, s (median) | spread | vs plain | vs offload=True | short, ms | long, ms | warm-up, s "
            "| over budget (timed, warm-up) | long: layers offloaded | kept | GC (timed): n, s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, m in result["modes"].items():
            spread = "n/a" if m["spread"] is None else f"{m['spread']:.1%}"
            lines.append(
                f"| {name} | {m['median_s']:.3f} | {spread} | {_ratio(result, name, 'plain')} "
                f"| {_ratio(result, name, 'offload=True')} | {m['short_median_s'] * 1e3:.1f} "
                f"| {m['long_median_s'] * 1e3:.1f} | {m['warmup_s']:.2f} "
                f"| {m['steps_over_budget']}, {m['warmup_steps_over_budget']} | {sorted(set(m['long_offloaded']))} "
                f"| {m['kept']} | {m['gc_collections']}, {m['gc_seconds']:.3f} |"
            )
        for name, why in result.get("skipped", {}).items():
            lines.append(f"| {name} | skipped: {why} |||||||||||")
        lines.append("")
    lines += ["## Verdicts", ""] + [f"- {k}: {shown(v)}" for k, v in report["verdicts"].items()]
    return "\n".join(lines) + "\n"


def _ratio(result: dict[str, Any], a: str, b: str) -> str:
    return "-" if a == b else ratio_range(ratios(result, a, b))


# ---- entry point ----------------------------------------------------------------------------------------


def measure(
    out: Path, device: str, quick: bool, passes: int, variants: list[str], budget_s: float, argv: list[str],
    layers: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Build the model, calibrate the budget and run each variant; writes the files after each."""
    deadline = time.monotonic() + budget_s
    shape = SHAPES["quick" if quick else device]
    shape = dataclasses.replace(shape, layers=layers) if layers else shape
    model = build_model(shape, device)
    tune, tune_source = torchtune_offloading()
    names, skipped = list(MODES), {}
    if device != "cuda" or tune is None:
        names.remove("torchtune")
        skipped["torchtune"] = "needs a CUDA device" if device != "cuda" else tune_source
    watch = GcWatch()
    watch.start()
    full = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 64 * GIB
    report: dict[str, Any] = {"environment": environment(device, shape, argv, tune_source), "results": {}}
    if "budget" in variants:
        found = calibrate(model, shape, device, tune, full, watch)
        recompute, offloaded = found[f"plain_{shape.long}"], found[f"on/sync_{shape.long}"]
        report["calibration"] = found
    try:
        for variant in variants:
            total = full if variant == "room" else round((offloaded + 0.5 * (recompute - offloaded)) / HIGH)
            left = max(deadline - time.monotonic(), 0) / max(len(variants) - len(report["results"]), 1)
            result = run_variant(
                model, shape, device, variant, total, passes, tune, names, watch, time.monotonic() + left
            )
            result["skipped"] = {**skipped, **result.pop("failed")}
            if variant == "budget" and recompute - offloaded < 0.05 * recompute:
                result["note"] = (
                    "offloading every layer lowers the long micro-batch's peak by under 5% here (its peak is not "
                    "where the saved inputs are alive): the budget cannot make it offload some layers"
                )
            report["results"][variant] = result
            report["verdicts"] = verdicts(report["results"])
            write(out, report)
            print(f"mixed: {variant} done, {result['timed_passes']} timed pass(es)", file=sys.stderr)
    finally:
        watch.stop()
    return report


def write(out: Path, report: dict[str, Any]) -> None:
    written.write(out, "mixed", report, render(report))


def environment(device: str, shape: Shape, argv: list[str], tune_source: str) -> dict[str, Any]:
    name = torch.cuda.get_device_name() if device == "cuda" else cpu_name(torch.get_num_threads())
    return stamp(
        "mixed.py", argv, device=device, device_name=name, shape=dataclasses.asdict(shape), torchtune=tune_source
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available, else cpu")
    parser.add_argument("--passes", type=int, default=4, help="timed passes after the warm-up pass (4)")
    parser.add_argument("--variants", nargs="*", default=["room", "budget"], choices=("room", "budget"))
    parser.add_argument("--layers", type=int, help="the model's layers (default: the shape's, 28 on a GPU)")
    parser.add_argument("--budget-s", type=float, default=600.0, help="stop starting passes past this (600)")
    parser.add_argument("--quick", action="store_true", help="a tiny model: checks the script")
    options = parser.parse_args(argv)
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    own_settings("mixed")
    warnings.simplefilter("ignore")
    if device == "cpu":
        torch.set_num_threads(1)
    report = measure(
        options.out, device, options.quick, options.passes, options.variants, options.budget_s, argv, options.layers
    )
    print((options.out / "mixed.md").read_text())
    return 0 if all(v is not False for v in report.get("verdicts", {}).values()) or device == "cpu" else 1


if __name__ == "__main__":
    sys.exit(main())
