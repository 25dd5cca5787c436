"""A soak: thousands of optimizer steps through the real Trainer, and whether anything autooffload holds grows.

    python benchmarks/soak.py --out DIR [--steps 3000] [--every 100] [--config NAME ...]

A tiny random Qwen3 trains on a CPU through ``transformers.Trainer`` on heavy-tailed lengths (hundreds of distinct
ones) against a :class:`~autooffload.SimulatedDevice`, in the configurations of ``CONFIGS``, each in a process of its
own (so one's memory is not the next one's). Every ``--every`` steps it samples what autooffload could let grow:
the process's RSS, the live tensors, the host bytes held, the saved state's size, the controller's own time per
micro-batch and the history's lines. After a warm-up (the first fifth of the steps), each series is fitted with a
line: the growth per 1000 steps against its level says whether it is flat. The configurations and the samples in
full: benchmarks/README.md.

Writes ``results.json``, ``results.md`` and ``results.png`` into ``--out``. The script puts its own checkout first
on ``sys.path``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import results as written  # noqa: E402
from harness.environment import load, stamp  # noqa: E402
from harness.verdicts import slope  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "predictive-sync-always": {"policy": "predictive", "engine": "sync", "recompute": "always"},
    "predictive-sync-auto": {"policy": "predictive", "engine": "sync", "recompute": "auto"},
    "predictive-stream-auto": {"policy": "predictive", "engine": "stream", "recompute": "auto"},
    "hysteresis-sync-always": {"policy": "hysteresis", "engine": "sync", "recompute": "always"},
    "budget-on-sync": {"mode": "on", "engine": "sync", "host_memory": "256KiB", "pin": True},
    "budget-auto-stream": {"policy": "predictive", "engine": "stream", "host_memory": "256KiB", "pin": True},
}
LAYERS, HIDDEN, VOCAB = 4, 64, 256
DEVICE_BYTES = 4_650_000  # the demo's: a 512-token micro-batch does not fit with every layer recomputing
SHORT = 128  # a micro-batch under this many tokens is short, for the keep share
WARMUP = 0.2  # the share of the steps before the series are judged
METRICS = {
    "rss_mib": "RSS, MiB",
    "tensors": "live tensors",
    "host_held_kib": "host bytes held, KiB",
    "state_kib": "saved state, KiB",
    "controller_ms": "controller ms / micro-batch",
    "history_lines": "history lines - steps",
}


def lengths(count: int, seed: int = 0) -> list[int]:
    """Heavy-tailed lengths: 16 x Pareto(1.2), 16 to 512 tokens."""
    draw = random.Random(seed)
    return [min(512, max(16, round(16 * draw.paretovariate(1.2)))) for _ in range(count)]


class Timed:
    """Wraps the controller's entry points and adds up the time spent in them: the thread's CPU time
    (``time.thread_time``), which the other processes of a shared machine disturb far less than the wall clock."""

    def __init__(self, controller: Any) -> None:
        self.seconds = 0.0
        for name in ("_enter", "end_step", "begin_step", "_on_first_call", "_on_measured"):
            setattr(controller, name, self.wrap(getattr(controller, name)))
        controller.planner.backward = self.wrap(controller.planner.backward)

    def wrap(self, function: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - started

        return timed


def live_tensors() -> int:
    import torch

    gc.collect()
    return sum(1 for item in gc.get_objects() if isinstance(item, torch.Tensor))


def run_config(name: str, steps: int, every: int) -> dict[str, Any]:
    """Train ``steps`` optimizer steps under configuration ``name`` in this process; the samples and the history."""
    import psutil
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from autooffload import AutoOffloadCallback, SimulatedDevice
    from autooffload.apply.host_memory import HostMemory
    from autooffload.demo import MixedLengths, checkpointing_arguments, tiny_qwen3
    from autooffload.history import read_history

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    settings = dict(CONFIGS[name])
    pin = settings.pop("pin", False)
    out = Path(os.environ.get("SOAK_TMP", "/tmp")) / f"autooffload-soak-{name}-{os.getpid()}"
    callback = AutoOffloadCallback(probe=SimulatedDevice(DEVICE_BYTES), seq_high=1024, seq_low=768, **settings)
    controller = callback.controller
    if pin:  # a CPU cannot pin: the calls are stood in for, the buffers are real mappings
        controller.host = HostMemory(pin=True, register=lambda t: None, unregister=lambda t: None)
    timed = Timed(controller)
    process = psutil.Process()
    samples: list[dict[str, Any]] = []

    class Sample(TrainerCallback):
        def __init__(self) -> None:
            self.micro_batches = 0
            self.seconds = 0.0

        def on_substep_end(self, args, state, control, **kwargs):
            self.micro_batches += 1

        def on_step_end(self, args, state, control, **kwargs):
            self.micro_batches += 1
            if state.global_step % every:
                return
            controller.write_history(callback.history_path)  # what the callback does at its next logging step
            with callback.history_path.open() as history:
                lines = sum(1 for _ in history)
            spent, self.seconds = timed.seconds - self.seconds, timed.seconds
            samples.append(
                {
                    "step": state.global_step,
                    "rss_mib": process.memory_info().rss / 2**20,
                    "tensors": live_tensors(),
                    "host_held_kib": controller.host.held_bytes / 1024,
                    "state_kib": len(json.dumps(controller.state_dict())) / 1024,
                    "controller_ms": 1000 * spent / max(self.micro_batches, 1),
                    "history_lines": lines - state.global_step,
                }
            )
            self.micro_batches = 0

    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=steps,
        learning_rate=1e-4, logging_steps=every, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        seed=0, **checkpointing_arguments("auto"),
    )  # fmt: skip

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    model = tiny_qwen3(LAYERS, HIDDEN, VOCAB)
    data = MixedLengths(lengths(2 * steps), VOCAB)
    started = time.perf_counter()
    InOrder(model=model, args=args, train_dataset=data, callbacks=[callback, Sample()]).train()
    wall = time.perf_counter() - started
    records = read_history(callback.history_path)
    return {
        "name": name,
        "settings": CONFIGS[name],
        "steps": steps,
        "wall_s": wall,
        "samples": samples,
        "history_steps": [r["step"] for r in records] == list(range(1, steps + 1)),
        "windows": windows(records, every),
        "summary": controller.summary(),
    }


def windows(records: list[dict[str, Any]], every: int) -> list[dict[str, Any]]:
    """Per window of ``every`` steps: short micro-batches that kept, those that could, bytes that did not move."""
    rows = []
    for start in range(0, len(records), every):
        window = records[start : start + every]
        short = [
            k for r in window for k, t in zip(r.get("kept") or [0] * len(r["tokens"]), r["tokens"], strict=True)
            if t < SHORT
        ]  # fmt: skip
        rows.append(
            {
                "steps": f"{window[0]['step']}-{window[-1]['step']}",
                "short_kept": sum(1 for k in short if k > 0),
                "short": len(short),
                "short_bytes": sum(r.get("short_bytes", 0) for r in window),
                "host_short_micro_batches": sum(r["reasons"].count("host_short") for r in window),
            }
        )
    return rows


def trend(samples: list[dict[str, Any]], key: str, steps: int) -> dict[str, float]:
    """The series after the warm-up: its first and last values, and a least-squares slope per 1000 steps."""
    points = [(s["step"], s[key]) for s in samples if s["step"] > WARMUP * steps]
    if len(points) < 2:
        points = [(s["step"], s[key]) for s in samples]
    ys = [y for _, y in points]
    return {"first": ys[0], "last": ys[-1], "median": statistics.median(ys), "per_1000_steps": 1000 * slope(points)}


def flat(key: str, t: dict[str, float], steps: int) -> bool:
    """Flat: over the judged steps, the fitted growth is within the noise a shared CPU leaves in that series (a
    series that falls is flat)."""
    growth = t["per_1000_steps"] * steps * (1 - WARMUP) / 1000
    allowed = {"rss_mib": 8.0, "tensors": 2.0, "host_held_kib": 64.0, "state_kib": 1.0, "history_lines": 0.0}
    if key == "controller_ms":
        return growth <= max(0.25 * t["median"], 0.05)
    return growth <= allowed[key]


def report(results: list[dict[str, Any]], out: Path) -> str:
    lines = [
        "| configuration | steps | " + " | ".join(METRICS.values()) + " | history | short kept (first / last window) |",
        "|---|---|" + "---|" * len(METRICS) + "---|---|",
    ]
    for result in results:
        cells = []
        for key in METRICS:
            t = result["trends"][key]
            mark = "" if result["flat"][key] else " **grows**"
            cells.append(f"{t['first']:.3g} -> {t['last']:.3g} ({t['per_1000_steps']:+.2g}/1k){mark}")
        first, last = result["windows"][int(WARMUP * len(result["windows"]))], result["windows"][-1]
        kept = f"{first['short_kept']}/{first['short']} / {last['short_kept']}/{last['short']}"
        history = "one line per step" if result["history_steps"] else "**lines missing or doubled**"
        lines.append(f"| {result['name']} | {result['steps']} | " + " | ".join(cells) + f" | {history} | {kept} |")
    table = "\n".join(lines)
    (out / "results.md").write_text(
        "# Soak\n\n" + table + "\n\nEach cell: the first and last sample after the warm-up "
        f"({WARMUP:.0%} of the steps) and the fitted growth per 1000 steps.\n"
    )
    return table


def plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = written.pyplot()
    figure, axes = plt.subplots(len(METRICS), 1, figsize=(10, 2.2 * len(METRICS)), sharex=True)
    for ax, (key, label) in zip(axes, METRICS.items(), strict=True):
        for result in results:
            ax.plot([s["step"] for s in result["samples"]], [s[key] for s in result["samples"]], label=result["name"])
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
        ax.axvline(WARMUP * results[0]["steps"], color="gray", linestyle=":", linewidth=1)
    axes[0].legend(fontsize=7, ncol=3, loc="upper left", bbox_to_anchor=(0, 1.45))
    axes[-1].set_xlabel("optimizer step (dotted: end of the warm-up)")
    figure.suptitle("autooffload soak: tiny Qwen3 through Trainer on a CPU, simulated device", fontsize=10, y=0.995)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=100, help="steps between samples")
    parser.add_argument("--config", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        print(json.dumps(run_config(options.child, options.steps, options.every)))
        return 0
    options.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in options.config:
        command = [sys.executable, __file__, "--out", str(options.out), "--steps", str(options.steps)]
        command += ["--every", str(options.every), "--child", name]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return 1
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["trends"] = {key: trend(result["samples"], key, options.steps) for key in METRICS}
        result["flat"] = {key: flat(key, t, options.steps) for key, t in result["trends"].items()}
        results.append(result)
        print(f"{name}: {options.steps} steps in {result['wall_s']:.0f} s; {result['summary']}", flush=True)
        (options.out / "results.json").write_text(json.dumps(header(options) | {"results": results}, indent=1))
    print(report(results, options.out))
    try:
        plot(results, options.out / "results.png")
    except ImportError:
        print("matplotlib missing: no plot")
    every_flat = all(all(r["flat"].values()) and r["history_steps"] for r in results)
    print("everything flat after the warm-up" if every_flat else "SOMETHING GROWS: see results.md")
    return 0


def header(options: argparse.Namespace) -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "log", "-1", "--format=%h %s", "--", "autooffload"], capture_output=True, text=True
    ).stdout.strip()
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU; load ({load()})"
    return stamp("soak.py", sys.argv[1:], machine=machine, code=commit)


if __name__ == "__main__":
    sys.exit(main())
