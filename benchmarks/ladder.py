"""The ladder (keep / recompute / offload) against plain checkpointing, modes side by side in one process.

    python benchmarks/ladder.py --out DIR [--device cpu|cuda] [--rounds N] [--quick]

Modes, on one model with the same weights and inputs, interleaved step by step (the order rotating):

- ``none``: no checkpointing at all (the speed to reach; it may not fit the budget);
- ``plain``: transformers' checkpointing, nothing else;
- ``always``: autooffload, ``recompute="always"`` (predictive offload, every checkpointed layer recomputes);
- ``auto``: autooffload, ``recompute="auto"`` (the ladder: the last layers keep when the plan fits).

Scenarios: (a) short micro-batches only, ample memory; (b) a mixed trace, one long micro-batch in five, under
a budget where only the long ones need checkpointing (a long one without checkpointing does not fit); (c) long
micro-batches under a budget that needs offload (a long one with every layer recomputing does not fit).

The budget is a memory probe of this script's design. CPU: a step's memory is its parameters, gradients and
AdamW state (4 x the parameter bytes, a constant) plus the saved activations alive at the end of the forward,
counted exactly by saved-tensor hooks around the forward (each storage once, parameters excluded; an offloaded
input is in host memory and is not counted). The count depends only on the mode's plan and the length, so it
is made once per (mode, length, plan) and reused, which keeps the hooks out of the timed steps. GPU
(``--device cuda``): the real allocator's ``max_memory_allocated`` over the step. The device's size is set
per scenario from calibration readings (every layer recomputing, and none) so that the budget, memory_high x
size, falls where the scenario says; every step's reading is checked against it.

Time: the process's CPU time per step on the CPU (``time.process_time``: a shared machine's other load moves
it far less than wall time), CUDA events on the GPU. A step is forward + backward; gradients are dropped
(no optimizer: it does not depend on the mode). Controllers warm up on the scenario's lengths first (a run
past its first steps: they have readings and measurements), then every round runs the trace once per mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import cpu_model

import autooffload
from autooffload import MemoryReading, OffloadController, Settings
from autooffload.apply.keep import SavedBytesCounter
from autooffload.decide.ladder import KEEP_MARGIN

MODES = ("none", "plain", "always", "auto")
HIGH = 0.9


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    head_dim: int
    vocab: int
    dtype: str
    short: int
    long: int


SHAPES = {
    "cpu": Shape(4, 128, 4, 32, 1024, "fp32", 256, 1024),
    # Qwen3-1.7B-like layers; sized for a one-call GPU check of a few minutes.
    "cuda": Shape(16, 2048, 16, 128, 1024, "bf16", 4096, 16384),
    "quick": Shape(2, 64, 4, 16, 256, "fp32", 32, 128),  # checks the script, in seconds
}


def build_model(shape: Shape, device: str) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=3 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads // 2,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.long,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(torch.float32 if shape.dtype == "fp32" else torch.bfloat16).train()


def set_checkpointing(model: torch.nn.Module, on: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if on:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable({"use_reentrant": False})
        else:
            disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
            disable()


# ---- the budget probe -------------------------------------------------------------------------------------


class BudgetProbe:
    """A device of ``total`` bytes whose reading is the step's memory (see the module's docstring)."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.total = 1
        self.last: int | None = None

    def read(self) -> MemoryReading | None:
        return None if self.last is None else MemoryReading(self.last, self.total)


class Bench:
    """The model, the device and the counting cache shared by every mode."""

    def __init__(self, shape: Shape, device: str) -> None:
        self.shape, self.device = shape, device
        self.model = build_model(shape, device)
        parameters = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.static = 4 * parameters  # weights, gradients, AdamW's two moments
        self.parameter_storages = {(p.device, p.untyped_storage().data_ptr()) for p in self.model.parameters()}
        self.counts: dict[tuple, int] = {}

    def ids(self, seq: int, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.shape.vocab, (1, seq), generator=generator).to(self.device)


class Mode:
    def __init__(self, name: str, bench: Bench) -> None:
        self.name, self.bench = name, bench
        self.probe = BudgetProbe(bench)
        self.controller = None
        if name in ("always", "auto"):
            settings = Settings(recompute=name, memory_high=HIGH, memory_low=HIGH - 0.1)
            self.controller = OffloadController(settings, probe=self.probe)
        self.steps: list[dict[str, Any]] = []

    def plan(self) -> tuple[int, int]:
        switch = self.controller.switch if self.controller is not None else None
        return (switch.offloaded, switch.kept) if switch is not None else (0, 0)

    def step(self, seq: int, seed: int, timed: bool = True) -> dict[str, Any]:
        bench, model = self.bench, self.bench.model
        set_checkpointing(model, self.name != "none")
        if self.controller is not None:
            self.controller.attach(model)
        ids = bench.ids(seq, seed)
        cuda = bench.device == "cuda"
        try:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                loss = model(input_ids=ids, labels=ids).loss
                plan = self.plan()
                loss.backward()
                end.record()
                torch.cuda.synchronize()
                seconds = start.elapsed_time(end) / 1e3
                reading = torch.cuda.max_memory_allocated()
                del loss
            else:
                reading, seconds, plan = self._cpu_step(model, ids, seq)
            model.zero_grad(set_to_none=True)
            self.probe.last = reading
            if self.controller is not None:
                self.controller.end_step()
        finally:
            if self.controller is not None:
                self.controller.detach()
        row = dict(seq=seq, seconds=seconds, reading=reading, offload=plan[0], keep=plan[1], timed=timed)
        self.steps.append(row)
        return row

    def _cpu_step(self, model: torch.nn.Module, ids: torch.Tensor, seq: int) -> tuple[int, float, tuple[int, int]]:
        bench = self.bench
        began = time.process_time()
        if self.controller is not None:
            # The plan is made in the forward pre-hook; decide it here first, so the cache key is known.
            self.controller.before_forward(seq, seq)
            key = (self.name, seq, *self.plan())
            decide, self.controller.before_forward = self.controller.before_forward, lambda s, t: 0
        else:
            key = (self.name, seq, 0, 0)
        try:
            counted = bench.counts.get(key)
            if counted is None:
                with SavedBytesCounter(bench.parameter_storages) as counter:
                    loss = model(input_ids=ids, labels=ids).loss
                bench.counts[key] = counted = counter.bytes
            else:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            seconds = time.process_time() - began
        finally:
            if self.controller is not None:
                self.controller.before_forward = decide
        plan = (key[2], key[3])
        return bench.static + counted, seconds, plan


# ---- scenarios ------------------------------------------------------------------------------------------


def calibrate(bench: Bench) -> dict[str, int]:
    """Readings of a short and a long step with every layer recomputing (plain) and with none kept (none)."""
    readings = {}
    for name in ("plain", "none"):
        mode = Mode(name, bench)
        for seq in (bench.shape.short, bench.shape.long):
            readings[f"{name}_{seq}"] = mode.step(seq, seed=seq, timed=False)["reading"]
    return readings


def budgets(bench: Bench, readings: dict[str, int]) -> dict[str, dict[str, Any]]:
    """The device size per scenario, from the calibration readings (see the module's docstring)."""
    short, long = bench.shape.short, bench.shape.long
    recompute_long, none_long = readings[f"plain_{long}"], readings[f"none_{long}"]
    layer_input = long * bench.shape.hidden * (4 if bench.shape.dtype == "fp32" else 2)
    mixed_limit = recompute_long + 0.5 * (none_long - recompute_long)
    return {
        "a": dict(lengths=[short] * 5, total=round(4 * readings[f"none_{short}"] / HIGH)),
        "b": dict(lengths=[short, short, long, short, short], total=round(mixed_limit / (HIGH - KEEP_MARGIN))),
        "c": dict(lengths=[long] * 3, total=round((recompute_long - 0.5 * layer_input) / HIGH)),
    }


def run_scenario(bench: Bench, name: str, lengths: list[int], total: int, rounds: int) -> dict[str, Any]:
    modes = [Mode(m, bench) for m in MODES]
    for mode in modes:
        mode.probe.total = total
        for seq in sorted(set(lengths)) * 2 + [max(lengths)] + [min(lengths)] * 2:  # readings and measurements
            mode.step(seq, seed=seq, timed=False)
    for round_ in range(rounds):
        for i, seq in enumerate(lengths):
            for j in range(len(modes)):
                modes[(round_ + i + j) % len(modes)].step(seq, seed=1000 * round_ + i)
    limit = HIGH * total
    result = dict(scenario=name, lengths=lengths, total_bytes=total, budget_bytes=limit, rounds=rounds, modes={})
    for mode in modes:
        timed = [s for s in mode.steps if s["timed"]]
        per_round = [sum(s["seconds"] for s in timed[r * len(lengths) : (r + 1) * len(lengths)]) for r in range(rounds)]
        median = statistics.median(per_round)
        result["modes"][mode.name] = dict(
            round_s=per_round,
            median_s=median,
            spread=(max(per_round) - min(per_round)) / median,
            kept=statistics.fmean(s["keep"] for s in timed) / bench.shape.layers,
            offloaded=statistics.fmean(s["offload"] for s in timed) / bench.shape.layers,
            max_reading_over_budget=max(s["reading"] for s in timed) / limit,
            steps_over_budget=sum(s["reading"] > limit for s in timed),
            warmup_steps_over_budget=sum(s["reading"] > limit for s in mode.steps if not s["timed"]),
            plans=sorted({(s["seq"], s["offload"], s["keep"]) for s in timed}),
        )
    base = result["modes"]
    for values in base.values():
        values["vs_none"] = values["median_s"] / base["none"]["median_s"]
        values["vs_plain"] = values["median_s"] / base["plain"]["median_s"]
    return result


TARGETS = {
    "a": "auto within 3% of none and at least 15% below plain",
    "b": "auto at least 10% below plain",
    "c": "auto within the spread of always",
}


def verdict(result: dict[str, Any]) -> bool:
    m = result["modes"]
    auto = m["auto"]
    safe = auto["steps_over_budget"] == 0 and m["always"]["steps_over_budget"] == 0
    if result["scenario"] == "a":
        return safe and auto["vs_none"] <= 1.03 and auto["vs_plain"] <= 0.85
    if result["scenario"] == "b":
        return safe and auto["vs_plain"] <= 0.90
    always = m["always"]
    return safe and abs(auto["median_s"] - always["median_s"]) <= always["spread"] * always["median_s"]


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
        f"- model: Qwen3 layers, random weights, {env['shape']}",
        f"- time: {clock} of forward + backward per step, summed over the trace; median over {env['rounds']} "
        "rounds, modes interleaved step by step (rotating order); spread = (slowest - fastest round) / median",
        f"- budget: memory_high {HIGH} x device size; reading = "
        + (
            "parameters, gradients and AdamW state + saved activations at the end of the forward (counted)"
            if cpu
            else "max_memory_allocated over the step"
        ),
        "",
        "| scenario | mode | time per trace, ms | spread | vs none | vs plain | kept | offloaded "
        "| max reading / budget | steps over budget |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for name, v in result["modes"].items():
            lines.append(
                f"| {result['scenario']} | {name} | {v['median_s'] * 1e3:.1f} | {v['spread']:.0%} | {v['vs_none']:.3f} "
                f"| {v['vs_plain']:.3f} | {v['kept']:.0%} | {v['offloaded']:.0%} "
                f"| {v['max_reading_over_budget']:.3f} | {v['steps_over_budget']} |"
            )
    lines += ["", "Scenarios and targets:", ""]
    for result in results:
        lengths = ", ".join(map(str, result["lengths"]))
        met = "met" if result["met"] else "NOT met"
        lines.append(
            f"- ({result['scenario']}) lengths {lengths}; device {result['total_bytes'] / 2**20:.1f} MiB; "
            f"target: {TARGETS[result['scenario']]}: **{met}**"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, help="timed passes over each trace (CPU 12, GPU 3)")
    parser.add_argument("--scenario", nargs="*", choices=("a", "b", "c"), default=["a", "b", "c"])
    parser.add_argument("--quick", action="store_true", help="a tiny model and one round: checks the script")
    options = parser.parse_args(argv)
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    for key in [k for k in os.environ if k.startswith("AUTOOFFLOAD_")]:
        os.environ.pop(key)
        print(f"ladder: ignoring {key}: the benchmark sets its own settings", file=sys.stderr)
    warnings.simplefilter("ignore")
    if options.device == "cpu":
        torch.set_num_threads(1)
    rounds = options.rounds or (1 if options.quick else 12 if options.device == "cpu" else 3)
    shape = SHAPES["quick" if options.quick else options.device]
    bench = Bench(shape, options.device)
    readings = calibrate(bench)
    plans = budgets(bench, readings)
    name = torch.cuda.get_device_name() if options.device == "cuda" else platform.processor() or platform.machine()
    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=options.device,
        device_name=name if options.device == "cuda" else f"{cpu_model()}, 1 torch thread of {os.cpu_count()}",
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        autooffload=autooffload.__version__,
        command=" ".join(["python", "benchmarks/ladder.py", *argv]),
        shape=dataclasses.asdict(shape),
        rounds=rounds,
        calibration=readings,
    )
    results = []
    options.out.mkdir(parents=True, exist_ok=True)
    for scenario in options.scenario:
        plan = plans[scenario]
        result = run_scenario(bench, scenario, plan["lengths"], plan["total"], rounds)
        result["met"] = verdict(result)
        result["safe"] = all(result["modes"][m]["steps_over_budget"] == 0 for m in ("always", "auto"))
        results.append(result)
        (options.out / "ladder.json").write_text(json.dumps(dict(env, results=results), indent=1) + "\n")
        (options.out / "ladder.md").write_text(render(env, results))
        print(f"ladder: scenario {scenario} done", file=sys.stderr)
    print((options.out / "ladder.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
