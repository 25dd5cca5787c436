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

The budget is the step's real peak. CPU: the weights and AdamW's two moments (3 x the parameter bytes, held
before the step) plus the most torch's CPU allocator held above that during the step's forwards and backward
(:class:`autooffload.observe.allocations.AllocationPeak`: the allocator's own reports, the gradients, the
recompute and the backward's transient buffers included; an offloaded input is copied to host buffers outside
that allocator, as it would leave a GPU). The peak depends only on the mode's plan and the micro-batch, so it is
counted once per (mode, length, plan, autocast) and reused, which keeps the counting (15-20% slower steps) out
of almost every timed step; each mode reports how many of its timed steps were counted. On these models at one
sequence of 1024 tokens the peak is at the end of the backward (every gradient, and the first layer's
recompute and backward), where the offloaded inputs are back and freed: offload lowers it by nothing, hence
(c)'s larger micro-batches. GPU (``--device cuda``): the real allocator's ``max_memory_allocated`` over the
step. The device's size is set per scenario from calibration readings (every layer recomputing, and none) so
that the budget, memory_high x size, falls where the scenario says; every step's reading is checked against it.

Time: the process's CPU time per step on the CPU (``time.process_time``: a shared machine's other load moves
it far less than wall time), CUDA events on the GPU. A step is forward + backward; gradients are dropped
(no optimizer: it does not depend on the mode). Python's full collections run between steps, not in them
(:func:`whole_heap_collections_outside`). Controllers warm up on the scenario's lengths first (a run
past its first steps: they have readings and measurements), then every round runs the trace once per mode.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
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
from autooffload.apply.host_memory import HostMemory
from autooffload.decide.ladder import KEEP_MARGIN
from autooffload.observe.allocations import AllocationPeak

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
    # (c)'s micro-batch size: enough tokens that the step's real peak comes at the start of the backward, with
    # every layer's input alive, where offload lowers it. With fewer, the peak is at the end of the backward
    # (every gradient and the first layer's backward), which no offload lowers.
    offload_batch: int = 1


SHAPES = {
    "cpu": Shape(4, 128, 4, 32, 1024, "fp32", 256, 1024, offload_batch=4),
    # Qwen3-1.7B-like layers; sized for a one-call GPU check of a few minutes.
    "cuda": Shape(16, 2048, 16, 128, 1024, "bf16", 4096, 16384),
    "quick": Shape(2, 64, 4, 16, 256, "fp32", 32, 128, offload_batch=16),  # checks the script, in seconds
}


def build_model(shape: Shape, device: str, kind: str = "qwen3") -> torch.nn.Module:
    if kind == "jamba":
        return build_jamba(shape, device)
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
    return _instantiate(Qwen3ForCausalLM, config, shape, device)


def build_jamba(shape: Shape, device: str) -> torch.nn.Module:
    """A hybrid stack: state-space (Mamba) layers at even positions, attention layers with two experts at odd."""
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=3 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads // 2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=8,
        mamba_expand=2,
        use_mamba_kernels=False,
        max_position_embeddings=shape.long,
        use_cache=False,
    )
    return _instantiate(JambaForCausalLM, config, shape, device)


def _instantiate(model_class: type, config: Any, shape: Shape, device: str) -> torch.nn.Module:
    """Random weights from seed 0, built on ``device``, in the shape's dtype, in training mode."""
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config)
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
    """A device of ``total`` bytes whose reading is the step's memory (see the module's docstring), at most the
    device's size: a step that needs more reads as the device full, as a real device (and autooffload's probes)
    would; a reading above the size is no reading to the controller (dropped as garbage). The step's own row keeps
    what it needed."""

    separate_host = True  # offloaded inputs leave torch's CPU allocator for host buffers, as they would leave a GPU

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.total = 1
        self.last: int | None = None
        self.window: AllocationPeak | None = None  # the step's count, where it is counted (not reused)
        self.last_segments: list | None = None

    def read(self) -> MemoryReading | None:
        return None if self.last is None else MemoryReading(min(self.last, self.total), self.total)

    def mark(self, label: Any) -> None:
        """The keep model's marks split a counted step into segments; a step whose count is reused has none."""
        if self.window is not None:
            self.window.mark(label)

    def segments(self) -> list | None:
        return self.last_segments


class Bench:
    """The model, the device and the counting cache shared by every mode."""

    def __init__(self, shape: Shape, device: str, kind: str = "qwen3", engine: str = "sync") -> None:
        self.shape, self.device, self.kind, self.engine = shape, device, kind, engine
        self.model = build_model(shape, device, kind)
        parameters = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # Held before a step: weights and AdamW's two moments. The gradients are made in the step (set to None
        # after each), so the step's measured peak holds them.
        self.static = 3 * parameters
        self.counts: dict[tuple, int] = {}

    def ids(self, seq: int, seed: int, batch: int = 1) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.shape.vocab, (batch, seq), generator=generator).to(self.device)


@contextlib.contextmanager
def whole_heap_collections_outside() -> Any:
    """A timed step with Python's young collections as in any run, and the whole heap collected before it instead
    of inside it. A full collection walks every object the process holds (all the modes' models, dynamo's caches):
    0.24-0.37 s with four modes here, more with every mode's graphs. It lands in whichever mode's step crosses the
    threshold: on the Jamba scenario one step in a few rounds ran 2x, from plain's, every other layer's or
    autooffload's step alike (the reason ``timeit`` turns the collector off while it times). Python 3.11-3.13 only
    start a full collection past the third threshold; an incremental collector may not."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(*thresholds[:2], 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


class Mode:
    def __init__(self, name: str, bench: Bench) -> None:
        self.name, self.bench = name, bench
        self.model = bench.model  # shared by the modes, which set it up for their own step
        self.probe = BudgetProbe(bench)
        self.controller = None
        # The mode's own host memory, kept across its steps as one run keeps it: a manager the controller made would
        # be released at each detach, and every step would pin its buffers anew (H200, (c): +4-5%).
        self.host = HostMemory(copy_cpu=True)
        if name in ("always", "auto"):
            settings = Settings(recompute=name, memory_high=HIGH, memory_low=HIGH - 0.1, engine=bench.engine)
            self.controller = OffloadController(settings, probe=self.probe, host=self.host)
        self.steps: list[dict[str, Any]] = []
        self.profiled = False  # the last step ran with the allocator's peak counted (its time is inflated)

    def plan(self) -> tuple[int, int]:
        switch = self.controller.switch if self.controller is not None else None
        return (switch.offloaded, switch.kept) if switch is not None else (0, 0)

    def step(
        self, seq: int, seed: int, timed: bool = True, autocast: bool = False, forwards: int = 1, batch: int = 1
    ) -> dict:
        """One optimizer step: ``forwards`` forwards of ``batch`` x ``seq`` tokens (under bf16 autocast if asked),
        one backward."""
        bench, model = self.bench, self.model
        self.configure(model)
        if self.controller is not None and not (self.persistent and self.controller.switch is not None):
            self.controller.attach(model, compiled=self.compiled)
        inputs = [bench.ids(seq, seed + i, batch) for i in range(forwards)]
        try:
            with whole_heap_collections_outside():
                if bench.device == "cuda":
                    reading, seconds, plans = self._cuda_step(model, inputs, autocast)
                else:
                    reading, seconds, plans = self._cpu_step(model, inputs, seq, autocast)
            model.zero_grad(set_to_none=True)
            self.probe.last = reading
            if self.controller is not None:
                self.controller.end_step()
        finally:
            if self.controller is not None and not self.persistent:
                self.controller.detach()
        offload, keep = max(p[0] for p in plans), min(p[1] for p in plans)
        row = dict(
            seq=seq, seconds=seconds, reading=reading, offload=offload, keep=keep, plans=plans, timed=timed,
            profiled=self.profiled,
        )  # fmt: skip
        self.steps.append(row)
        return row

    # What another benchmark's modes (benchmarks/peers.py) change: how the shared model is set up for this mode's
    # step, what a forward calls (a compiled model), and whether the controller sees a compiled model.
    # a compiled model, and a controller that stays attached (a mode with a model of its own)
    compiled = False
    persistent = False

    def configure(self, model: torch.nn.Module) -> None:
        set_checkpointing(model, self.name != "none")

    def settle(self, lengths: list[int], how: dict[str, Any]) -> None:
        """After the warm-up, before the timed rounds: nothing more here (a compiled mode runs the trace until
        nothing compiles)."""

    def runner(self, model: torch.nn.Module) -> Any:
        return model

    def _forward(self, model: torch.nn.Module, ids: torch.Tensor, autocast: bool) -> torch.Tensor:
        with torch.autocast(self.bench.device, dtype=torch.bfloat16, enabled=autocast):
            return self.runner(model)(input_ids=ids, labels=ids).loss

    def _cuda_step(
        self, model: torch.nn.Module, inputs: list[torch.Tensor], autocast: bool
    ) -> tuple[int, float, list[tuple[int, int]]]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        losses, plans = [], []
        for ids in inputs:
            losses.append(self._forward(model, ids, autocast))
            plans.append(self.plan())
        sum(losses).backward()
        end.record()
        torch.cuda.synchronize()
        del losses
        return torch.cuda.max_memory_allocated(), start.elapsed_time(end) / 1e3, plans

    def _cpu_step(
        self, model: torch.nn.Module, inputs: list[torch.Tensor], seq: int, autocast: bool
    ) -> tuple[int, float, list[tuple[int, int]]]:
        bench = self.bench
        tokens = inputs[0].numel()
        window, key = None, None
        began = time.process_time()
        losses, plans = [], []
        for ids in inputs:
            if self.controller is not None:
                # The plan is made in the forward pre-hook; decide it here first, so the cache key is known.
                self.controller.before_forward(seq, tokens)
                plan = self.plan()
                decide, self.controller.before_forward = self.controller.before_forward, lambda *call: 0
            else:
                plan = (0, 0)
            plans.append(plan)
            if key is None:
                key = self.key(seq, tokens, plan, autocast, len(inputs))
                if key not in bench.counts:
                    window = AllocationPeak()
                    window.start()
                    self.probe.window = window
            try:
                losses.append(self._forward(model, ids, autocast))
            finally:
                if self.controller is not None:
                    self.controller.before_forward = decide
        sum(losses).backward()
        del losses
        seconds = time.process_time() - began
        self.profiled = window is not None
        self.probe.window, self.probe.last_segments = None, None
        if window is not None:
            bench.counts[key] = window.stop()
            self.probe.last_segments = window.segments
        return bench.static + bench.counts[key], seconds, plans

    def key(self, seq: int, tokens: int, plan: tuple[int, int], autocast: bool, forwards: int) -> tuple:
        """What the step's peak depends on: the mode, the micro-batch, the (first forward's) plan, whether its
        layers measure (the keep planner's counters hold each layer's tensors until its forward ends)."""
        switch = self.controller.switch if self.controller is not None else None
        measuring = switch is not None and switch.measuring
        return (self.name, seq, tokens, *plan, measuring, autocast, forwards)


# ---- scenarios ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A trace (one length per optimizer step), how each step runs, and the device it runs on."""

    lengths: list[int]
    total: int
    autocast: bool = False
    forwards: int = 1
    model: str = "qwen3"
    batch: int = 1


def reading(bench: Bench, name: str, seq: int, autocast: bool = False, forwards: int = 1, batch: int = 1) -> int:
    """A calibration reading: one step of ``name`` (``plain``: every layer recomputing; ``none``: every layer
    keeping, as no checkpointing does)."""
    how = dict(autocast=autocast, forwards=forwards, batch=batch)
    return Mode(name, bench).step(seq, seed=seq, timed=False, **how)["reading"]


def budgets(bench: Bench, hybrid: Bench | None, names: list[str]) -> tuple[dict[str, Scenario], dict[str, int]]:
    """The device size per scenario, from calibration readings (see the module's docstring)."""
    short, long = bench.shape.short, bench.shape.long
    readings: dict[str, int] = {}

    def read(key: str, on: Bench, name: str, seq: int, **how: Any) -> int:
        if key not in readings:
            readings[key] = reading(on, name, seq, **how)
        return readings[key]

    batch = bench.shape.offload_batch
    layer_input = batch * long * bench.shape.hidden * (4 if bench.shape.dtype == "fp32" else 2)
    kept_room = HIGH - KEEP_MARGIN
    scenarios = {}
    for name in names:
        if name == "a":
            scenarios[name] = Scenario([short] * 5, round(4 * read(f"none_{short}", bench, "none", short) / HIGH))
        elif name in ("b", "d"):
            autocast = name == "d"
            tag = "_autocast" if autocast else ""
            recompute = read(f"plain_{long}{tag}", bench, "plain", long, autocast=autocast)
            everything = read(f"none_{long}{tag}", bench, "none", long, autocast=autocast)
            limit = recompute + 0.6 * (everything - recompute)  # 2.4 of 4 layers: 2 keep with room to spare
            lengths = [short, short, long, short, short] if name == "b" else [long, short, short, short, short]
            scenarios[name] = Scenario(lengths, round(limit / kept_room), autocast=autocast)
        elif name == "c":
            recompute = read(f"plain_{batch}x{long}", bench, "plain", long, batch=batch)
            scenarios[name] = Scenario([long] * 3, round((recompute - 0.5 * layer_input) / HIGH), batch=batch)
        elif name == "e":
            one = read(f"none_{short}", bench, "none", short) - read(f"plain_{short}", bench, "plain", short)
            both = read(f"plain_{short}_x2", bench, "plain", short, forwards=2)
            scenarios[name] = Scenario([short] * 4, round((both + 1.6 * one) / kept_room), forwards=2)
        elif name == "f":
            assert hybrid is not None
            recompute = read(f"hybrid_plain_{short}", hybrid, "plain", short)
            everything = read(f"hybrid_none_{short}", hybrid, "none", short)
            limit = recompute + 0.75 * (everything - recompute)
            scenarios[name] = Scenario([short] * 4, round(limit / kept_room), model="jamba")
    return scenarios, readings


def run_scenario(
    bench: Bench, name: str, scenario: Scenario, rounds: int, modes: list[Mode] | None = None
) -> dict[str, Any]:
    """Warm every mode up, then ``rounds`` rounds of the trace, modes interleaved step by step (``modes``: the
    ladder's four by default)."""
    lengths = scenario.lengths
    how = dict(autocast=scenario.autocast, forwards=scenario.forwards, batch=scenario.batch)
    modes = [Mode(m, bench) for m in MODES] if modes is None else modes
    for mode in modes:
        mode.probe.total = scenario.total
        for seq in sorted(set(lengths)) * 2 + [max(lengths)] + [min(lengths)] * 2:  # readings and measurements
            mode.step(seq, seed=seq, timed=False, **how)
        mode.settle(lengths, how)
    for mode in modes:  # compiled modes share dynamo's cache per code: one may have dropped another's (not the
        held = len(mode.steps)  # mode's own warm-up: its steps are not kept)
        mode.settle(lengths, how)
        del mode.steps[held:]
    gc.collect()
    gc.freeze()  # what the warm-ups built stays: each step's collection before it walks only what came since
    try:
        for round_ in range(rounds):
            for i, seq in enumerate(lengths):
                for j in range(len(modes)):
                    modes[(round_ + i + j) % len(modes)].step(seq, seed=1000 * round_ + 10 * i, **how)
    finally:
        gc.unfreeze()
    for mode in modes:
        mode.host.release_all()
    limit = HIGH * scenario.total
    result = dict(
        scenario=name,
        engine=bench.engine,
        lengths=lengths,
        autocast=scenario.autocast,
        forwards=scenario.forwards,
        batch=scenario.batch,
        model=scenario.model,
        total_bytes=scenario.total,
        budget_bytes=limit,
        rounds=rounds,
        modes={},
    )
    for mode in modes:
        timed = [s for s in mode.steps if s["timed"]]
        per_round = [sum(s["seconds"] for s in timed[r * len(lengths) : (r + 1) * len(lengths)]) for r in range(rounds)]
        median = statistics.median(per_round)
        layers = bench.shape.layers
        result["modes"][mode.name] = dict(
            round_s=per_round,
            median_s=median,
            spread=(max(per_round) - min(per_round)) / median,
            kept=statistics.fmean(k for s in timed for _, k in s["plans"]) / layers,
            offloaded=statistics.fmean(o for s in timed for o, _ in s["plans"]) / layers,
            max_reading_over_budget=max(s["reading"] for s in mode.steps) / limit,
            steps_over_budget=sum(s["reading"] > limit for s in timed),
            # a warm-up step in which dynamo compiled is left out: its count holds the compilation's own allocations
            # (on the CPU's allocator; a device's reading would not), and no controller took it as a sample
            warmup_steps_over_budget=sum(
                s["reading"] > limit for s in mode.steps if not s["timed"] and not s.get("compiled")
            ),
            profiled_timed_steps=sum(s["profiled"] for s in timed),
            plans=sorted({(s["seq"], *p) for s in timed for p in s["plans"]}),
        )
    base = result["modes"]
    for values in base.values():
        values["vs_none"] = values["median_s"] / base["none"]["median_s"] if "none" in base else None
        values["vs_plain"] = values["median_s"] / base["plain"]["median_s"] if "plain" in base else None
    return result


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
        always = m["always"]
        return abs(auto["median_s"] - always["median_s"]) <= always["spread"] * always["median_s"]
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


def describe(result: dict) -> str:
    """A scenario's line in a table's notes: its lengths, how it runs and its device's size."""
    lengths = ", ".join(map(str, result["lengths"]))
    how = ", bf16 autocast" if result["autocast"] else ""
    how += f", {result['forwards']} forwards per backward" if result["forwards"] > 1 else ""
    how += f", micro-batches of {result['batch']}" if result.get("batch", 1) > 1 else ""
    how += ", hybrid Jamba" if result["model"] == "jamba" else ""
    return f"({result['scenario']}) lengths {lengths}{how}; device {result['total_bytes'] / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, help="timed passes over each trace (CPU 12, GPU 3)")
    parser.add_argument(
        "--scenario", nargs="*", choices=tuple(TARGETS), help="default: all (CPU), a b c (GPU, --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model and one round: checks the script")
    parser.add_argument("--engine", choices=("sync", "stream"), default="sync", help="autooffload's engine (sync)")
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
    names = options.scenario or (list(TARGETS) if options.device == "cpu" and not options.quick else ["a", "b", "c"])
    bench = Bench(shape, options.device, engine=options.engine)
    hybrid = Bench(shape, options.device, "jamba", engine=options.engine) if "f" in names else None
    plans, readings = budgets(bench, hybrid, names)
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
        engine=options.engine,
        rounds=rounds,
        calibration=readings,
    )
    results = []
    options.out.mkdir(parents=True, exist_ok=True)
    for scenario in names:
        plan = plans[scenario]
        on = hybrid if plan.model == "jamba" else bench
        result = run_scenario(on, scenario, plan, rounds)
        reference = next((r for r in results if r["scenario"] == "a"), None)
        result["met"] = verdict(result, reference)
        result["safe"] = safe(result)
        results.append(result)
        (options.out / "ladder.json").write_text(json.dumps(dict(env, results=results), indent=1) + "\n")
        (options.out / "ladder.md").write_text(render(env, results))
        print(f"ladder: scenario {scenario} done", file=sys.stderr)
    print((options.out / "ladder.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
