"""bench.py's report: results.md (the table per shape and the mixed-length run), results.json and results.png. The
columns and how to read them: benchmarks/README.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import results as written

from autooffload import Settings

MIB = 2**20
GIB = 2**30


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
    names = list(dict.fromkeys(r["mode"] for r in rows))
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
