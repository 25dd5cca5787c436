"""The controller's host time per micro-batch against the number of distinct lengths a run has seen.

    python benchmarks/controller_time.py --out DIR [--layers 36 80] [--lengths 10 100 1000 10000 100000]
                                         [--timed 2000] [--code PATH] [--baseline JSON ...]

Padding-free and packed batches give nearly every micro-batch a length of its own, so whatever the controller
keeps per length, and whatever it does per length at each decision, grows with the run. A real
:class:`~autooffload.OffloadController` is driven through the calls a training loop makes per micro-batch, without
running the model, against a synthetic reading (:class:`Device`); each micro-batch is timed in the thread's CPU
time (``time.thread_time``), which other processes on a shared machine disturb far less than the wall clock. What
it calls, the *new* and *seen* figures and the table: benchmarks/README.md.

``--code PATH`` imports autooffload from another checkout (the code before a change, to compare); ``--baseline``
adds earlier runs' JSON to the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness.environment import load, stamp  # noqa: E402
from harness.results import pyplot  # noqa: E402
from harness.verdicts import per_call  # noqa: E402

PER_TOKEN = 100_000  # the step's all-recompute peak per token of its longest micro-batch
BASE = 1_000_000_000
KEPT_PER_TOKEN = 20_000  # what one kept layer adds per token (fp32-like, linear)
TOTAL = 4_000_000_000  # keeps about a third of 80 layers at 4096 tokens, every layer at a few hundred


class Device:
    """The synthetic reading: a constant, the longest micro-batch's tokens, and the kept layers' bytes."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)
        self.step_peak = 0.0

    def micro_batch(self, tokens: int, kept: int) -> None:
        extra = 1.02 if self.random.random() < 0.05 else 1.0
        self.step_peak = max(self.step_peak, BASE + PER_TOKEN * tokens + extra * kept * KEPT_PER_TOKEN * tokens)

    def reset(self) -> None:
        self.step_peak = 0.0

    def read(self) -> Any:
        from autooffload import MemoryReading

        return MemoryReading(round(self.step_peak), TOTAL) if self.step_peak else None


def run(layers: int, distinct: int, timed: int, seed: int = 0) -> dict[str, Any]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from autooffload import OffloadController, Settings

    hidden = 16
    config = Qwen3Config(
        vocab_size=64, hidden_size=hidden, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    device = Device(seed)
    controller = OffloadController(Settings(recompute="auto", seq_high=10**9, seq_low=10**9), probe=device)
    controller.attach(model)
    lengths = list(range(16, 16 + distinct))
    order = random.Random(seed).sample(lengths, len(lengths))
    draws = random.Random(seed + 1)
    schedule = order + [draws.choice(lengths) for _ in range(timed)]
    times: list[float] = []
    kept_any = 0
    for micro, tokens in enumerate(schedule):
        started = time.thread_time()
        if micro % 2 == 0:
            controller.begin_step()
        controller.before_forward(tokens, tokens)
        switch = controller.switch
        for position in range(layers):
            controller._on_first_call(position, tokens * hidden * 4)
        if switch.measuring:
            offloading = switch.offloading
            for position in range(layers):
                if position not in offloading:
                    controller._on_measured(position, KEPT_PER_TOKEN * tokens, 0)
        device.micro_batch(tokens, switch.kept)
        kept_any += switch.kept > 0
        controller.planner.backward()
        if micro % 2 == 1:
            controller.end_step()
            device.reset()
        times.append(time.thread_time() - started)
    first, seen = times[: len(order)], times[len(order) :]
    new = first[-timed:]
    windows = [statistics.median(first[i : i + 1000]) for i in range(0, len(first), 1000)]
    state = json.dumps(controller.state_dict())
    return {
        "layers": layers,
        "distinct_lengths": distinct,
        "new_timed": len(new),
        "seen_timed": len(seen),
        **{f"new_{key}": value for key, value in per_call(new).items()},
        **{f"seen_{key}": value for key, value in per_call(seen).items()},
        "first_visits_window_median_ms": [1000 * w for w in windows],
        "state_bytes": len(state),
        "kept_share_last": switch.kept / layers,
        "micro_batches_kept": kept_any,
    }


def code_version(root: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(root), "log", "-1", "--format=%h %s", "--", "autooffload"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def plot(results: list[dict[str, Any]], baselines: list[dict[str, Any]], out: Path) -> None:
    plt = pyplot()
    figure, ax = plt.subplots(figsize=(8, 4.5))
    for label, rows, style in [("after", results, "-o"), *[(b["label"], b["rows"], "--x") for b in baselines]]:
        for layers in sorted({r["layers"] for r in rows}):
            mine = sorted((r for r in rows if r["layers"] == layers), key=lambda r: r["distinct_lengths"])
            xs = [r["distinct_lengths"] for r in mine]
            ax.plot(xs, [r["new_median_ms"] for r in mine], style, label=f"{label}, {layers} layers, new length")
            ax.plot(xs, [r["seen_median_ms"] for r in mine], style, alpha=0.4, label=f"{label}, {layers} layers, seen")
    ax.axhline(1.0, color="tab:red", linestyle=":", label="target: 1 ms at 80 layers")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("distinct lengths seen")
    ax.set_ylabel("controller host time per micro-batch, ms (median)")
    ax.set_title("autooffload controller time per micro-batch (CPU time of its thread, no GPU)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=80)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, nargs="+", default=[36, 80])
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 100, 1000, 10_000, 100_000])
    parser.add_argument("--timed", type=int, default=2000, help="micro-batches timed after the warm-up")
    parser.add_argument("--code", type=Path, help="import autooffload from this checkout (default: this one)")
    parser.add_argument("--baseline", type=Path, nargs="*", default=[], help="earlier results.json to plot")
    parser.add_argument("--label", default="after", help="what this run measures, for a later --baseline")
    parser.add_argument("--plot-only", action="store_true", help="draw --out's results.json (and --baseline) again")
    options = parser.parse_args()
    baselines = [json.loads(path.read_text()) for path in options.baseline]
    if options.plot_only:
        plot(json.loads((options.out / "results.json").read_text())["rows"], baselines, options.out / "results.png")
        return 0
    root = (options.code or HERE.parent).resolve()
    sys.path.insert(0, str(root))
    import torch

    import autooffload

    torch.set_num_threads(1)
    assert Path(autooffload.__file__).resolve().is_relative_to(root), autooffload.__file__
    options.out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU"
    environment = stamp(
        "controller_time.py", sys.argv[1:], label=options.label, machine=machine, code=code_version(root)
    )
    header = (
        f"{'layers':>6} {'lengths':>8} {'new: median ms':>14} {'p90':>7} {'max':>7} {'seen: median ms':>15} "
        f"{'p90':>7} {'max':>7} {'state KiB':>9} {'kept':>6}"
    )
    print(header)
    for layers in options.layers:
        for distinct in options.lengths:
            row = run(layers, distinct, options.timed)
            results.append(row)
            print(
                f"{layers:>6} {distinct:>8} {row['new_median_ms']:>14.3f} {row['new_p90_ms']:>7.3f} "
                f"{row['new_max_ms']:>7.2f} {row['seen_median_ms']:>15.3f} {row['seen_p90_ms']:>7.3f} "
                f"{row['seen_max_ms']:>7.2f} {row['state_bytes'] / 1024:>9.1f} "
                f"{row['micro_batches_kept'] / (distinct + options.timed):>6.0%}",
                flush=True,
            )
            summary = {**environment, "load_average": load(), "rows": results}
            (options.out / "results.json").write_text(json.dumps(summary, indent=2))
    try:
        plot(results, baselines, options.out / "results.png")
    except ImportError:
        print("matplotlib missing: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
