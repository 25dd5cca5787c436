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
from harness import models
from harness import results as written
from harness.environment import cpu_model, git_commit, own_settings, stamp
from harness.forms import Installed
from harness.models import DTYPES, has_native_offload
from harness.rounds import Clock, OverBudget, StepClock, interleaved
from harness.verdicts import spread

from autooffload import OffloadController, Settings
from autooffload.apply.host_memory import HostMemory
from autooffload.observe.costs import GcWatch

MODES = ("checkpointing", "always", "on", "auto")
MIB = 2**20
GIB = 2**30


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


def mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}"


def write_results(out: Path, env: dict[str, Any], rows: list, mixed: dict | None, notes: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    try:
        if rows:
            plot(out / "results.png", env, rows, mixed)
    except ImportError:
        if "results.png not written: matplotlib is not installed" not in notes:
            notes.append("results.png not written: matplotlib is not installed")
    data = dict(env, rows=rows, mixed=mixed, notes=notes)
    written.write(out, "results", data, render_markdown(env, rows, mixed, notes), indent=2)


def render_markdown(env: dict[str, Any], rows: list, mixed: dict | None, notes: list[str]) -> str:
    cuda = env["device"] == "cuda"
    plan = env["plan"]
    lines = [
        f"# autooffload benchmark: {'GPU' if cuda else 'CPU'}",
        "",
        f"- device: {env['device_name']}",
        f"- torch {env['torch']}, transformers {env['transformers']}, python {env['python']}, "
        f"autooffload {env['autooffload']} at {env['commit'] or 'an unknown commit'}",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        f"- model: Qwen3 layers, random weights, {plan['dtype']}, batch {plan['batch']}, vocabulary {plan['vocab']}, "
        f"{plan['heads']} heads of {plan['head_dim']}, intermediate 3 x hidden; a step is forward + backward",
        f"- step time: median of {plan['timed']} timed steps per mode after {plan['warmup']} warm-up step(s); "
        "modes interleaved step by step, the order rotating" + ("; CUDA events" if cuda else "; perf_counter"),
        "- spread: (slowest - fastest) / median of a mode's timed steps; a ratio closer to 1 than the spread is "
        "not a measured difference",
        f"- attention: {plan['attention']}",
        f"- `auto` settings: {plan['auto'] or 'the defaults'} (default seq_high {Settings().seq_high}, "
        f"seq_low {Settings().seq_low}, min_steps {Settings().min_steps})",
        "",
    ]
    if not cuda:
        lines += [
            "CPU run: host and device memory are the same here, so nothing is freed. The memory columns are the "
            "bytes the offload hooks packed to host memory, which is what a GPU would free. `always` on a "
            "CPU-only build is torch's `save_on_cpu(pin_memory=False)` (transformers' native offload fails there "
            "asking for pinned memory), whose pack is `tensor.cpu()`: a no-op for a CPU tensor, as autooffload's "
            "hooks are for a tensor already in host memory. What counts here: bytes counted and time ratios. CPU "
            "time is the process's CPU time over the same steps (torch runs on one thread): on a shared machine it is "
            "less disturbed by other processes than the wall-clock step time.",
            "",
        ]
    memory_head = (
        "| resident after fwd, MiB | freed, MiB | arithmetic, MiB | freed / arithmetic | peak, GiB "
        if cuda
        else "| packed to host, MiB | arithmetic, MiB | packed / arithmetic "
    )
    lines += [
        "## Per shape",
        "",
        "| layers x hidden x seq | mode | offloaded "
        + memory_head
        + "| step, ms | spread | tokens/s | time vs checkpointing |"
        + ("" if cuda else " CPU time, ms | CPU time vs checkpointing |"),
        "|---|---|---|" + "---|" * (memory_head.count("|") + (4 if cuda else 6)),
    ]
    for row in rows:
        shape = f"{row['layers']} x {row['hidden']} x {row['seq']}"
        share = "n/a" if row["freed_bytes"] is None else f"{row['freed_bytes'] / row['arithmetic_bytes']:.3f}"
        if cuda:
            peak = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / GIB:.2f}"
            memory = f"| {mib(row['resident_bytes'])} | {mib(row['freed_bytes'])} | {mib(row['arithmetic_bytes'])} "
            memory += f"| {share} | {peak} "
        else:
            memory = f"| {mib(row['packed_bytes'])} | {mib(row['arithmetic_bytes'])} | {share} "
        offloaded = "yes" if row["offloaded"] else "no"
        timing = (
            f"| {row['median_s'] * 1e3:.1f} | {row['spread']:.0%} | {row['tokens_per_s']:,.0f} | {row['ratio']:.3f} |"
        )
        if not cuda:
            timing += f" {row['cpu_median_s'] * 1e3:.1f} | {row['cpu_ratio']:.3f} |"
        lines.append(f"| {shape} | {row['label']} | {offloaded} {memory}{timing}")
    if mixed is not None:
        lines += render_mixed(mixed, cuda)
    if notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def render_mixed(mixed: dict, cuda: bool) -> list[str]:
    memory = mixed["memory_metric"]
    summary = mixed["summary"]
    lines = [
        "",
        f"## Mixed lengths: {mixed['layers']} x {mixed['hidden']}, {len(mixed['lengths'])} steps",
        "",
        f"Lengths in order: {', '.join(map(str, mixed['lengths']))}. Every mode warms up on one short and one long "
        "step, then runs the sequence with fresh state; modes interleaved step by step; single steps, not medians.",
        "",
        f"| mode | total, s | tokens/s | total vs checkpointing | short step, ms (median) | long step, ms (median) "
        f"| steps offloaded | max {memory} short, MiB | max {memory} long, MiB |"
        + (" peak, GiB |" if cuda else " total CPU time, s | CPU time vs checkpointing |"),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if cuda else "---|---|"),
    ]
    for values in summary.values():
        lines.append(
            f"| {values['label']} | {values['total_s']:.3f} | {values['tokens_per_s']:,.0f} | {values['ratio']:.3f} "
            f"| {values['short_median_s'] * 1e3:.1f} | {values['long_median_s'] * 1e3:.1f} "
            f"| {values['steps_offloaded']} / {len(mixed['lengths'])} "
            f"| {mib(values['max_memory_short'])} | {mib(values['max_memory_long'])} |"
            + (f" {values['max_peak'] / GIB:.2f} |" if cuda else cpu_totals(values, summary["checkpointing"]))
        )
    names = list(mixed["steps"])
    head = "| step | seq | " + " | ".join(f"{n}, ms" for n in names) + f" | auto offloaded | auto {memory}, MiB |"
    lines += ["", "Per step:", "", head, "|---|---|" + "---|" * (len(names) + 2)]
    for i, seq in enumerate(mixed["lengths"]):
        auto = mixed["steps"]["auto"][i]
        times = " | ".join(f"{mixed['steps'][n][i]['seconds'] * 1e3:.1f}" for n in names)
        value = auto["resident"] if cuda else auto["packed"]
        lines.append(f"| {i} | {seq} | {times} | {'yes' if auto['offloaded'] else 'no'} | {mib(value)} |")
    return lines


def cpu_totals(values: dict, base: dict) -> str:
    return f" {values['total_cpu_s']:.3f} | {values['total_cpu_s'] / base['total_cpu_s']:.3f} |"


def plot(path: Path, env: dict[str, Any], rows: list, mixed: dict | None) -> None:
    plt = written.pyplot()
    cuda = env["device"] == "cuda"
    blocks = list(dict.fromkeys((r["layers"], r["hidden"], r["seq"]) for r in rows))
    names = [m for m in MODES if any(r["mode"] == m for r in rows)]
    panels = 3 if mixed is not None else 2
    figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    width = 0.8 / max(len(names), 1)
    for offset, name in enumerate(names):
        by_block = {(r["layers"], r["hidden"], r["seq"]): r for r in rows if r["mode"] == name}
        xs = [i + (offset - (len(names) - 1) / 2) * width for i in range(len(blocks))]
        ratios = [by_block[b]["ratio"] for b in blocks]
        # Whiskers: the fastest and slowest timed step, against checkpointing's median (the noise to read through).
        base = [by_block[b]["median_s"] / by_block[b]["ratio"] for b in blocks]
        low = [r - min(by_block[b]["times_s"]) / m for r, b, m in zip(ratios, blocks, base, strict=True)]
        high = [max(by_block[b]["times_s"]) / m - r for r, b, m in zip(ratios, blocks, base, strict=True)]
        axes[0].bar(xs, ratios, width, yerr=[low, high], capsize=2, label=name)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].set_ylabel("step time / checkpointing alone")
    axes[0].set_title("step-time ratio (median; whiskers: fastest, slowest step)")
    labels = [f"{b[0]}x{b[1]}\n{b[2]} tok" for b in blocks]
    axes[0].set_xticks(range(len(blocks)), labels)
    axes[0].legend(fontsize=8)
    on_rows = {(r["layers"], r["hidden"], r["seq"]): r for r in rows if r["mode"] == "on"}
    measured = [(on_rows[b]["freed_bytes"] or 0) / MIB for b in blocks]
    arithmetic = [on_rows[b]["arithmetic_bytes"] / MIB for b in blocks]
    xs = range(len(blocks))
    axes[1].bar([x - 0.2 for x in xs], measured, 0.4, label="measured (autooffload on)")
    axes[1].bar([x + 0.2 for x in xs], arithmetic, 0.4, label="layers x seq x hidden x bytes")
    axes[1].set_xticks(range(len(blocks)), labels)
    axes[1].set_ylabel("MiB")
    axes[1].set_title("freed after forward" if cuda else "packed to host (CPU: nothing is freed)")
    axes[1].legend(fontsize=8)
    if mixed is not None:
        for name, steps in mixed["steps"].items():
            axes[2].plot([s["seconds"] * 1e3 for s in steps], marker="o", markersize=3, label=name)
        axes[2].set_xlabel("step (long sequences: " + ", ".join(
            str(i) for i, s in enumerate(mixed["lengths"]) if s == max(mixed["lengths"])) + ")")  # fmt: skip
        axes[2].set_ylabel("ms")
        axes[2].set_title("mixed lengths: time per step")
        axes[2].legend(fontsize=8)
    figure.suptitle(f"autooffload, {'GPU' if cuda else 'CPU'}: {env['device_name']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


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
