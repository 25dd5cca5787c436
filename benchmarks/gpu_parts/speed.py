"""The parts that time: the mixed trace, the seed's own setup, the engines, the ladder."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_parts import FREED_TOLERANCE, emit

# ---- 3. engines -----------------------------------------------------------------------------------------


def part_engines(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    import engine_check
    import torch

    target = engine_check.Device(device)
    if quick:
        grad_config, shape, vocab, measured = (*engine_check.QUICK_GRAD_CONFIGS["tiny"][:-1], 2), (2, 64, 128), 256, 1
    else:
        grad_config, shape, vocab, measured = (*engine_check.GRAD_CONFIGS["tiny"][:-1], 10), (36, 4096, 16384), 32768, 3
    gradients = engine_check.gradient_check("tiny", grad_config, torch.bfloat16, target)
    emit(f"engines: gradients sync={gradients['sync']['pass']} stream={gradients['stream']['pass']}")
    timing = engine_check.time_shape(shape, vocab, measured, target)
    layers, _, _ = shape
    layer_bytes = timing["layer_input_bytes"]
    verdicts = {"gradients_match_plain": gradients["sync"]["pass"] and gradients["stream"]["pass"]}
    freed = {}
    for engine, moved_layers in (("sync", layers), ("stream", layers - 1)):
        expected = moved_layers * layer_bytes
        measured_freed = timing[f"{engine}_freed"]
        freed[engine] = {"freed": measured_freed, "expected": expected}
        if measured_freed is not None:
            freed[engine]["ratio"] = measured_freed / expected
            verdicts[f"{engine}_freed_within_0.5pct"] = abs(measured_freed / expected - 1) <= FREED_TOLERANCE
    if target.cuda:
        stream, sync = timing["stream_overhead"], timing["sync_overhead"]
        verdicts["stream_overhead_under_1pct"] = stream < 0.01
        verdicts["stream_overhead_at_most_quarter_of_sync"] = stream <= max(sync, 0.0) / 4
    emit(f"engines: sync overhead {timing['sync_overhead']:+.2%}, stream {timing['stream_overhead']:+.2%}")
    return {"gradients": gradients, "timing": timing, "freed": freed, "verdicts": verdicts}


# ---- 2. the mixed trace ---------------------------------------------------------------------------------


def part_mixed(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    """``benchmarks/mixed.py`` with room and under a budget; its verdicts on a GPU (a CPU's times are noise)."""
    import mixed
    import torch

    if device == "cpu":
        torch.set_num_threads(1)
    passes = 2 if quick else 3
    with tempfile.TemporaryDirectory() as scratch:
        report = mixed.measure(
            Path(scratch), device, quick, passes, ["room", "budget"], budget_s * 0.9, ["(gpu_check)"]
        )
    for variant, result in report["results"].items():
        for name, row in result["modes"].items():
            emit(f"mixed: {variant}: {name}: {row['median_s']:.3f} s per pass, over budget {row['steps_over_budget']}")
    verdicts = {k: v for k, v in report.get("verdicts", {}).items() if v is not None} if device == "cuda" else {}
    return {"mixed": report, "verdicts": verdicts}


# ---- 2. the seed's own setup ----------------------------------------------------------------------------


SEED_MODES = ("plain", "offload=True", "auto", "auto/stream", "auto/stream/keep")


def decoder_loss(model: Any, ids: Any) -> Any:
    """The step of the seed's setup: the decoder's output, no output head (see :func:`part_seed`)."""
    return model.model(input_ids=ids).last_hidden_state.float().square().mean()


SEED_PUBLISHED_GB = {"plain": 11.13, "offload=True": 10.16}


def part_seed(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    """Qwen3-1.7B's config (28 x 2048, intermediate 6144, 16 heads of 128, 8 KV heads, vocabulary 151,936, tied
    embeddings), bf16, one sequence of 32k tokens, forward and backward: the peak and the step of plain
    checkpointing, transformers' ``offload=True`` and autooffload beside them (one warm-up and two timed steps
    each, interleaved). The loss is taken on the decoder's output (``model.model``, a mean square), not on 32k x
    151,936 logits: the published run's memory resident after the forward (4,112 MB plain at this shape) has no
    room for them (10 GB in bf16), so its step had no full output head either."""
    import torch
    from harness.models import StepProbe, qwen3, step_ids
    from harness.rounds import rotated
    from harness.trace_modes import HIGH, Mode, run_step

    from autooffload.observe.costs import GcWatch

    if quick:
        config, seq = (2, 64, 128, 4, 2, 16, 256), 128
    else:
        config, seq = (28, 2048, 6144, 16, 8, 128, 151936), 32768
    model = qwen3(*config, torch.bfloat16, torch.device(device))
    total = torch.cuda.get_device_properties(0).total_memory if device.startswith("cuda") else 64 * 2**30
    probe = StepProbe(total, separate_host=device == "cpu")
    modes = [Mode(name, model, device, probe, None) for name in SEED_MODES]
    watch = GcWatch()
    rows: dict[str, list[dict[str, Any]]] = {mode.name: [] for mode in modes}
    started = time.perf_counter()
    for round_ in range(3):
        if round_ == 2 and (time.perf_counter() - started) * 1.5 > budget_s:
            break
        for mode in rotated(modes, round_):
            ids = step_ids(round_, 1, seq, config[-1], torch.device(device))
            row = run_step(mode, ids, device == "cpu", watch, decoder_loss)
            row["round"] = round_
            rows[mode.name].append(row)
    for mode in modes:
        mode.close()
    summary = {}
    for name, steps in rows.items():
        timed = [s for s in steps if s["round"] > 0]
        summary[name] = dict(
            median_s=statistics.median(s["seconds"] for s in timed),
            peak_gb=max((s["peak"] or 0) for s in steps) / 1e9,
            offloaded=sorted({s["offloaded"] for s in steps}),
            published_gb=SEED_PUBLISHED_GB.get(name),
        )
        emit(f"seed: {name}: {summary[name]['median_s']:.3f} s, peak {summary[name]['peak_gb']:.2f} GB")
    verdicts = {}
    if device.startswith("cuda"):
        plain, native, auto = summary["plain"], summary["offload=True"], summary["auto"]
        verdicts["offload_true_lowers_the_peak"] = native["peak_gb"] < plain["peak_gb"]
        verdicts["auto_faster_than_offload_true"] = auto["median_s"] < native["median_s"]
        verdicts["auto_under_memory_high"] = auto["peak_gb"] * 1e9 <= HIGH * total
    shape = dict(
        zip(("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"), config, strict=True)
    )
    return {"shape": {**shape, "seq": seq, "dtype": "bf16"}, "modes": summary, "steps": rows, "verdicts": verdicts}


# ---- 5. the ladder -------------------------------------------------------------------------------------


def part_ladder(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    """``benchmarks/ladder.py --engine stream``: no checkpointing, plain, ``recompute=always`` and ``auto`` side by
    side on its three scenarios, under a budget from the allocator; its own targets are the verdicts."""
    import tempfile

    import ladder

    with tempfile.TemporaryDirectory() as scratch:
        args = ["--out", scratch, "--device", "cuda" if device.startswith("cuda") else "cpu", "--engine", "stream"]
        ladder.main([*args, "--quick"] if quick else [*args, "--rounds", "2"])
        report = json.loads((Path(scratch) / "ladder.json").read_text())
    verdicts = {}
    for result in report["results"]:
        verdicts[f"scenario_{result['scenario']}_safe"] = bool(result["safe"])
        if not quick:
            verdicts[f"scenario_{result['scenario']}_target_met"] = bool(result["met"])
    emit("ladder: " + ", ".join(f"{k} {v}" for k, v in verdicts.items()))
    return {"ladder": report, "verdicts": verdicts}
