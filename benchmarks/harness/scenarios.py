"""The ladder's scenarios: a model shared by every mode, a trace of lengths per scenario, and a device sized so that
the budget falls where the scenario says; a mode (``none``, ``plain``, autooffload's ``always`` and ``auto``, or a
peer built on it: benchmarks/peers.py) set up on the shared model for each of its steps.

The budget is the step's real peak. CPU: the weights and AdamW's two moments (3 x the parameter bytes, held
before the step) plus the most torch's CPU allocator held above that during the step's forwards and backward
(:class:`autooffload.observe.allocations.AllocationPeak`: the allocator's own reports, the gradients, the
recompute and the backward's transient buffers included; an offloaded input is copied to host buffers outside
that allocator, as it would leave a GPU). The peak depends only on the mode's plan and the micro-batch, so it is
counted once per (mode, length, plan, autocast) and reused, which keeps the counting (15-20% slower steps) out
of almost every timed step; each mode reports how many of its timed steps were counted. GPU: the real allocator's
``max_memory_allocated`` over the step. The device's size is set per scenario from calibration readings (every
layer recomputing, and none) so that the budget, memory_high x size, falls where the scenario says; every step's
reading is checked against it.

Time: the process's CPU time per step on the CPU, CUDA events on the GPU (:class:`harness.rounds.StepClock`). A
step is forward + backward; gradients are dropped (no optimizer: it does not depend on the mode). Controllers warm
up on the scenario's lengths first (a run past its first steps: they have readings and measurements), then every
round runs the trace once per mode, interleaved (:func:`harness.rounds.interleaved`).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import torch

from autooffload import OffloadController, Settings
from autooffload.apply.host_memory import HostMemory
from autooffload.decide.ladder import KEEP_MARGIN
from autooffload.observe.allocations import AllocationPeak
from harness.models import Shape, StepProbe, build_model, set_checkpointing, token_ids
from harness.rounds import StepClock, interleaved, warm_heap_frozen, whole_heap_collections_outside
from harness.verdicts import spread

MODES = ("none", "plain", "always", "auto")
NAMES = ("a", "b", "c", "d", "e", "f")  # the scenarios (benchmarks/ladder.py's docstring)
HIGH = 0.9

SHAPES = {
    "cpu": Shape(4, 128, 4, 32, 1024, "fp32", 256, 1024, offload_batch=4),
    # Qwen3-1.7B-like layers; sized for a one-call GPU check of a few minutes.
    "cuda": Shape(16, 2048, 16, 128, 1024, "bf16", 4096, 16384),
    "quick": Shape(2, 64, 4, 16, 256, "fp32", 32, 128, offload_batch=16),  # checks the script, in seconds
}


class BudgetProbe(StepProbe):
    """The scenario's device (:class:`harness.models.StepProbe`), whose counted steps also give the keep model its
    segments."""

    def __init__(self, bench: Bench) -> None:
        super().__init__()
        self.bench = bench
        self.window: AllocationPeak | None = None  # the step's count, where it is counted (not reused)
        self.last_segments: list | None = None

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
        return token_ids(self.shape.vocab, seq, seed, self.device, batch)


class Mode:
    """One mode on the bench's shared model, set up for each of its steps (``configure``)."""

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
        with StepClock(cuda=True) as clock:
            losses, plans = [], []
            for ids in inputs:
                losses.append(self._forward(model, ids, autocast))
                plans.append(self.plan())
            sum(losses).backward()
        del losses
        return clock.peak or 0, clock.seconds, plans

    def _cpu_step(
        self, model: torch.nn.Module, inputs: list[torch.Tensor], seq: int, autocast: bool
    ) -> tuple[int, float, list[tuple[int, int]]]:
        bench = self.bench
        tokens = inputs[0].numel()
        window, key = None, None
        with StepClock(cuda=False) as clock:
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
        seconds = clock.seconds
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
    with warm_heap_frozen():
        for round_, i, seq, mode in interleaved(rounds, lengths, modes):
            mode.step(seq, seed=1000 * round_ + 10 * i, **how)
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
        layers = bench.shape.layers
        result["modes"][mode.name] = dict(
            round_s=per_round,
            median_s=statistics.median(per_round),
            spread=spread(per_round),
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


def describe(result: dict) -> str:
    """A scenario's line in a table's notes: its lengths, how it runs and its device's size."""
    lengths = ", ".join(map(str, result["lengths"]))
    how = ", bf16 autocast" if result["autocast"] else ""
    how += f", {result['forwards']} forwards per backward" if result["forwards"] > 1 else ""
    how += f", micro-batches of {result['batch']}" if result.get("batch", 1) > 1 else ""
    how += ", hybrid Jamba" if result["model"] == "jamba" else ""
    return f"({result['scenario']}) lengths {lengths}{how}; device {result['total_bytes'] / 2**20:.1f} MiB"
