"""What offload frees and what it costs, every mode side by side in one process, on the device that is present.

    python benchmarks/bench.py --out DIR [--device cpu|cuda] [--quick]

Modes on the same model, weights and inputs: ``checkpointing`` (the baseline), ``always`` (transformers'
``offload=True``, or the ``save_on_cpu`` wrap it makes), autooffload ``on`` and ``auto``. Per shape and length: the
memory resident after the forward, the step's peak, what was freed against the arithmetic, the step's time with the
modes interleaved; then a mixed-length run. The modes and the columns: benchmarks/README.md. Writes results.md,
results.json and results.png into ``--out`` after every block, so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers

# Measure the checkout this script lives in, not whichever autooffload happens to be installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_parts.report import write_results
from harness import models
from harness.environment import cpu_model, git_commit, own_settings, stamp
from harness.forms import Installed
from harness.models import DTYPES, has_native_offload
from harness.rounds import Clock, OverBudget, StepClock, interleaved
from harness.verdicts import spread

from autooffload import OffloadController, Settings
from autooffload.apply.host_memory import HostMemory
from autooffload.observe.costs import GcWatch

MODES = ("checkpointing", "always", "on", "auto")


# ---- what to run ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    seqs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything that decides the numbers, recorded in results.json."""

    device: str
    dtype: str
    shapes: tuple[Shape, ...]
    heads: int
    head_dim: int
    vocab: int
    batch: int
    warmup: int
    timed: int
    mixed_shape: tuple[int, int]
    mixed_lengths: tuple[int, ...]
    auto: dict[str, Any]
    budget_s: float
    attention: str = "sdpa"


def make_plan(device: str, quick: bool, budget_s: float) -> Plan:
    """GPU: Qwen3-0.6B/1.7B-like layers (16 heads of 128, intermediate 3 x hidden), bf16, the shapes of the
    transformers PR plus one sequence where activations dominate. CPU: shapes that finish in a minute or two.
    The vocabulary is small on purpose: a 152k-token head would put the logits, not the layers, at the peak."""
    if device == "cuda":
        short, long = 4096, 32768
        shapes = (
            Shape(8, 1024, (8192,)),
            Shape(16, 1024, (16384,)),
            Shape(28, 2048, (32768,) + (() if quick else (65536,))),
        )
        return Plan(
            device, "bf16", shapes, heads=16, head_dim=128, vocab=1024, batch=1,
            warmup=1, timed=2 if quick else 3, mixed_shape=(28, 2048),
            mixed_lengths=mixed_lengths(short, long, 8 if quick else 12),
            auto={}, budget_s=budget_s,
        )  # fmt: skip
    short, long = 256, 1024
    return Plan(
        device, "fp32", (Shape(4, 128, (256, 512, 1024)),), heads=4, head_dim=32, vocab=1024, batch=1,
        warmup=1 if quick else 2, timed=3 if quick else 20, mixed_shape=(4, 128),
        mixed_lengths=mixed_lengths(short, long, 8 if quick else 16),
        auto={"seq_high": long, "seq_low": long // 2}, budget_s=budget_s,
    )  # fmt: skip


def mixed_lengths(short: int, long: int, steps: int) -> tuple[int, ...]:
    """Mostly short, one long step in every five, starting at the third (so a few short steps come first)."""
    return tuple(long if i % 5 == 2 else short for i in range(steps))


# ---- the model and its modes ----------------------------------------------------------------------------


def build_model(plan: Plan, layers: int, hidden: int, max_seq: int) -> torch.nn.Module:
    shape = models.Shape(layers, hidden, plan.heads, plan.head_dim, plan.vocab, plan.dtype, max_seq, max_seq)
    return models.build_model(shape, plan.device)


class Mode(Installed):
    """One mode (:class:`harness.forms.Installed`). Its host memory (``host``, shared with a warm-up's mode where
    given) lives as long as it does: the buffers pinned in one step serve the next, as torch's pinned allocator keeps
    ``always``'s."""

    def __init__(self, name: str, model: torch.nn.Module, plan: Plan, host: HostMemory | None = None) -> None:
        controller = None
        if name in ("on", "auto"):
            settings = Settings(mode=name, **(plan.auto if name == "auto" else {}))
            probe = "auto" if plan.device == "cuda" else None
            controller = OffloadController(settings, probe=probe, host=host or HostMemory())
        super().__init__(model, plan.device, offload=name == "always", controller=controller)
        self.name = name
        wrap = f"always: save_on_cpu(pin_memory={plan.device != 'cpu'}) wrap"
        always = "always: transformers offload=True" if self.native else wrap
        self.label = {"checkpointing": "checkpointing alone", "always": always}.get(name, f"autooffload {name}")

    def offloaded(self) -> bool:
        if self.controller is not None:
            return self.controller.record.active > 0
        return self.name == "always"

    def end_step(self) -> int | None:
        """Close the step; the bytes packed to host memory in it, None where they are not counted."""
        if self.controller is not None:
            self.controller.end_step()
            return self.controller.last_step_bytes
        if self.stats is not None:
            return self.stats.next_step()
        return 0 if self.name == "checkpointing" else None


# ---- one step, measured ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    seq: int
    seconds: float
    resident: int | None  # CUDA: memory_allocated after the forward minus before it
    peak: int | None  # CUDA: max_memory_allocated during the step (weights included)
    packed: int | None  # bytes the offload hooks moved to the host, where counted
    offloaded: bool
    cpu_seconds: float | None = None  # CPU: this process's CPU time, less disturbed by other processes
    gc_collections: int = 0  # Python's garbage collections in the step, and their time (every mode)
    gc_seconds: float = 0.0
    costs: dict[str, float] | None = None  # autooffload's own: autooffload.observe.costs


def run_step(mode: Mode, ids: torch.Tensor) -> Step:
    """One forward + backward under ``mode``; installing and removing the mode is outside the timing."""
    mode.activate()
    try:
        return _timed_step(mode.model, mode, ids)
    finally:
        mode.deactivate()


GC = GcWatch()  # started by main(): the collections of every mode's steps


def _timed_step(model: torch.nn.Module, mode: Mode, ids: torch.Tensor) -> Step:
    """CUDA events on a GPU; on the CPU the wall clock, and the process's CPU time beside it."""
    cuda = ids.device.type == "cuda"
    collections, gc_seconds = GC.collections, GC.seconds
    before = torch.cuda.memory_allocated() if cuda else 0
    with StepClock(cuda) as clock:
        loss = model(input_ids=ids, labels=ids).loss
        resident = torch.cuda.memory_allocated() - before if cuda else None
        offloaded = mode.offloaded()
        loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    packed = mode.end_step()
    seconds, cpu_seconds = (clock.seconds, None) if cuda else (clock.wall, clock.seconds)
    step = Step(int(ids.shape[-1]), seconds, resident, clock.peak, packed, offloaded, cpu_seconds)
    step.gc_collections, step.gc_seconds = GC.collections - collections, round(GC.seconds - gc_seconds, 4)
    step.costs = mode.controller.last_step_costs if mode.controller is not None else None
    return step


def token_ids(plan: Plan, seq: int, seed: int) -> torch.Tensor:
    return models.token_ids(plan.vocab, seq, seed, plan.device, plan.batch)


# ---- the two experiments --------------------------------------------------------------------------------


def measure_block(model: torch.nn.Module, plan: Plan, shape: Shape, seq: int, clock: Clock) -> list[dict[str, Any]]:
    """Every mode at one shape and sequence length: warm-up per mode, then timed rounds of one step per mode,
    the order rotating each round."""
    ids = token_ids(plan, seq, seed=seq)
    modes = [Mode(name, model, plan) for name in MODES]
    first = [run_step(modes[0], ids) for _ in range(plan.warmup)]
    steps_left = len(MODES) * (plan.warmup + plan.timed) - plan.warmup
    clock.check(f"{shape.layers}x{shape.hidden}x{seq}", first[-1].seconds * steps_left * 1.2)
    for mode in modes[1:]:
        for _ in range(plan.warmup):
            run_step(mode, ids)
    timed: dict[str, list[Step]] = {mode.name: [] for mode in modes}
    for _, _, _, mode in interleaved(plan.timed, [seq], modes):
        timed[mode.name].append(run_step(mode, ids))
    for mode in modes:
        if mode.controller is not None:
            mode.controller.host.release_all()  # the mode's own: the controller's detach leaves it to its owner
    arithmetic = shape.layers * plan.batch * seq * shape.hidden * torch.finfo(DTYPES[plan.dtype]).bits // 8
    rows = []
    for mode in modes:
        steps = timed[mode.name]
        last = steps[-1]
        rows.append(
            dict(
                layers=shape.layers, hidden=shape.hidden, seq=seq, batch=plan.batch, mode=mode.name,
                label=mode.label, median_s=statistics.median(s.seconds for s in steps),
                times_s=[s.seconds for s in steps], cpu_times_s=[s.cpu_seconds for s in steps],
                resident_bytes=last.resident, peak_bytes=last.peak, packed_bytes=last.packed,
                offloaded=last.offloaded, arithmetic_bytes=arithmetic,
            )
        )  # fmt: skip
    base = rows[0]
    for row in rows:
        row["ratio"] = row["median_s"] / base["median_s"]
        row["spread"] = spread(row["times_s"])
        row["tokens_per_s"] = plan.batch * seq / row["median_s"]
        if plan.device == "cpu":
            row["cpu_median_s"] = statistics.median(row["cpu_times_s"])
            row["cpu_ratio"] = row["cpu_median_s"] / statistics.median(base["cpu_times_s"])
        if plan.device == "cuda":
            row["freed_bytes"] = base["resident_bytes"] - row["resident_bytes"]
        else:
            row["freed_bytes"] = row["packed_bytes"]  # bytes moved to the host; on a CPU nothing is freed
    return rows


def measure_mixed(model: torch.nn.Module, plan: Plan, clock: Clock) -> dict[str, Any]:
    """The same sequence of lengths under every mode, interleaved step by step. Each mode first warms up on
    one short and one long step with throwaway state, then runs the sequence with fresh state (a new
    controller), so the policy starts clean."""
    lengths = plan.mixed_lengths
    short, long = min(lengths), max(lengths)
    hosts = {name: HostMemory() for name in MODES}
    warm = {}
    for name in MODES:
        warming = Mode(name, model, plan, hosts[name])
        warm[name] = [run_step(warming, token_ids(plan, seq, seed=seq)) for seq in (short, long)]
        if name == MODES[0]:
            n_long = sum(seq == long for seq in lengths)
            per_pass = warm[name][0].seconds * (len(lengths) - n_long + 1) + warm[name][1].seconds * (n_long + 1)
            clock.check("mixed-length run", per_pass * len(MODES) * 1.2)
    modes = [Mode(name, model, plan, hosts[name]) for name in MODES]
    per_mode: dict[str, list[Step]] = {mode.name: [] for mode in modes}
    for _, i, seq, mode in interleaved(1, lengths, modes):
        per_mode[mode.name].append(run_step(mode, token_ids(plan, seq, seed=1000 + i)))
    for host in hosts.values():
        host.release_all()
    cuda = plan.device == "cuda"
    metric = "resident" if cuda else "packed"
    summary = {}
    for mode in modes:
        steps = per_mode[mode.name]
        shorts = [s for s in steps if s.seq == short]
        longs = [s for s in steps if s.seq == long]
        summary[mode.name] = dict(
            label=mode.label,
            total_s=sum(s.seconds for s in steps),
            total_cpu_s=_sum_or_none(s.cpu_seconds for s in steps),
            tokens_per_s=plan.batch * sum(lengths) / sum(s.seconds for s in steps),
            short_median_s=statistics.median(s.seconds for s in shorts),
            long_median_s=statistics.median(s.seconds for s in longs),
            steps_offloaded=sum(s.offloaded for s in steps),
            packed_bytes=_sum_or_none(s.packed for s in steps),
            max_memory_short=_max_or_none(getattr(s, metric) for s in shorts),
            max_memory_long=_max_or_none(getattr(s, metric) for s in longs),
            max_peak=_max_or_none(s.peak for s in steps),
        )
    base = summary["checkpointing"]["total_s"]
    for values in summary.values():
        values["ratio"] = values["total_s"] / base
    return dict(
        layers=plan.mixed_shape[0],
        hidden=plan.mixed_shape[1],
        lengths=list(lengths),
        memory_metric="resident after forward" if cuda else "packed to host",
        steps={name: [dataclasses.asdict(s) for s in steps] for name, steps in per_mode.items()},
        summary=summary,
    )


def _sum_or_none(values) -> int | None:
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def _max_or_none(values) -> int | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


# ---- reporting ------------------------------------------------------------------------------------------


def environment(plan: Plan, argv: list[str]) -> dict[str, Any]:
    if plan.device == "cuda":
        device_name = torch.cuda.get_device_name()
    else:
        device_name = f"{cpu_model()}, torch on {torch.get_num_threads()} thread(s) of {os.cpu_count()}"
    return stamp(
        "bench.py",
        argv,
        threads=torch.get_num_threads(),
        device=plan.device,
        device_name=device_name,
        commit=git_commit("autooffload", "benchmarks/bench.py", "benchmarks/harness"),
        plan=dataclasses.asdict(plan),
    )


# ---- entry point ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for results.md, results.json, results.png")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available, else cpu")
    parser.add_argument("--quick", action="store_true", help="fewer steps; on the GPU, no 64k-token sequence")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default on the CPU: 1, since on a small shared machine oversubscribed threads "
        "made steps an order of magnitude slower and noisier; on the GPU: torch's default)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=400.0, help="skip blocks that would end past this many seconds (400)"
    )
    options = parser.parse_args(argv)
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    own_settings("bench", remove=False)
    warnings.simplefilter("ignore", FutureWarning)
    if options.threads or device == "cpu":
        torch.set_num_threads(options.threads or 1)
    plan = make_plan(device, options.quick, options.budget_s)
    clock = Clock(plan.budget_s)
    GC.start()
    env = environment(plan, argv)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    mixed = None
    for shape in plan.shapes:
        model = build_model(plan, shape.layers, shape.hidden, max(shape.seqs))
        if device == "cuda" and not has_native_offload(model):
            note = f"transformers {transformers.__version__} has no native offload: `always` is the save_on_cpu wrap"
            if note not in notes:
                notes.append(note)
        for seq in shape.seqs:
            try:
                rows += measure_block(model, plan, shape, seq, clock)
                print(f"bench: {shape.layers}x{shape.hidden}x{seq} done at {clock.elapsed:.0f} s", file=sys.stderr)
            except (OverBudget, torch.cuda.OutOfMemoryError) as skipped:
                note = str(skipped).splitlines()[0]
                if isinstance(skipped, torch.cuda.OutOfMemoryError):
                    note = f"{shape.layers}x{shape.hidden}x{seq} skipped: out of device memory ({note})"
                    model.zero_grad(set_to_none=True)
                    torch.cuda.empty_cache()
                notes.append(note)
                print(f"bench: {note}", file=sys.stderr)
            # The mixed run goes right after the block of its long length, before any longer (costlier) one.
            if mixed is None and (shape.layers, shape.hidden) == plan.mixed_shape and seq >= max(plan.mixed_lengths):
                try:
                    mixed = measure_mixed(model, plan, clock)
                    print(f"bench: mixed-length run done at {clock.elapsed:.0f} s", file=sys.stderr)
                except OverBudget as skipped:
                    notes.append(str(skipped))
                    print(f"bench: {skipped}", file=sys.stderr)
            write_results(options.out, env, rows, mixed, notes)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    print((options.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
