"""The GPU check of the offload engines, in one call: are ``stream``'s gradients right, is it faster than ``sync``?

Run from the repository root on one GPU (about 4-6 minutes on an H200)::

    PYTHONPATH=. python benchmarks/engine_check.py --out DIR

1. Gradients. A tiny and a mid-size random Qwen3, in fp32 and bf16, trained for many steps on fresh random
   tokens. Every step runs the same batch through plain checkpointing (twice: the second run is the noise
   floor of the device's own nondeterminism), ``sync`` and ``stream`` on identical weights, and reports the
   relative error of each gradient against the first plain run. Offload moves bytes and nothing else, so any
   error above the noise floor is a bug (a stream race shows up as large errors or NaN). No synchronisation
   between forward and backward, and ``CUDA_LAUNCH_BLOCKING`` is removed from the environment, so the races
   the engine must prevent can happen.
2. Step time and memory. Layers x hidden x tokens of 8x1024x8k, 16x1024x16k, 28x2048x32k and 28x2048x64k
   (Qwen3-0.6B/1.7B proportions, bf16, batch 1): median step time (forward + backward) of plain
   checkpointing, ``sync`` and ``stream``; device memory held after the forward and the step's peak.
   Targets at 28x2048x32k: ``stream``'s overhead under 3% and at most a quarter of ``sync``'s; it frees what
   ``sync`` frees less one layer input (by design the last layer's input stays on the device).

Writes ``engine_check.json`` and ``engine_check.md`` to ``--out`` after every section, so a run cut short
still leaves its results. Sections that would overrun ``--budget-s`` are skipped and say so.
``--device cpu --quick`` runs everything small on the CPU (streams are no-ops there), to check the script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.environment import cpu_model, releases
from harness.models import qwen3, step_ids
from harness.verdicts import shown

from autooffload import AutoOffloadWarning, OffloadController, Settings
from autooffload.apply.host_memory import host_memory

ENGINES = ("sync", "stream")
TIMING_SHAPES = [(8, 1024, 8192), (16, 1024, 16384), (28, 2048, 32768), (28, 2048, 65536)]
QUICK_SHAPES = [(2, 64, 128), (3, 64, 256)]
GRAD_CONFIGS = {
    # name: (layers, hidden, intermediate, heads, kv heads, head dim, vocab, batch, seq, steps)
    "tiny": (4, 128, 384, 4, 2, 32, 1024, 4, 512, 40),
    "mid": (12, 1024, 3072, 16, 8, 64, 32768, 2, 4096, 15),
}
QUICK_GRAD_CONFIGS = {"tiny": (3, 64, 128, 4, 2, 16, 256, 2, 64, 3), "mid": (4, 128, 256, 4, 2, 32, 512, 1, 128, 2)}


class Device:
    """Synchronise, time and read memory on the device under test; memory reads are None on the CPU."""

    def __init__(self, name: str) -> None:
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.cuda else None

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def describe(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.cuda else cpu_model()


def offload(model: torch.nn.Module, engine: str) -> OffloadController:
    controller = OffloadController(Settings(mode="on", engine=engine), probe=None)
    controller.attach(model, compiled=False)
    return controller


def forward_backward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().float().flatten() for p in model.parameters()])


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    if not torch.isfinite(value).all():
        return math.inf
    return (value - reference).norm().item() / max(reference.norm().item(), 1e-30)


# ---- 1. gradients -----------------------------------------------------------------------------------


def gradient_check(name: str, config: tuple, dtype: torch.dtype, device: Device) -> dict[str, Any]:
    layers, hidden, intermediate, heads, kv_heads, head_dim, vocab, batch, seq, steps = config
    shape = (layers, hidden, intermediate, heads, kv_heads, head_dim, vocab)
    plain = qwen3(*shape, dtype, device.device)
    models = {engine: qwen3(*shape, dtype, device.device) for engine in ENGINES}
    controllers = {engine: offload(models[engine], engine) for engine in ENGINES}
    errors: dict[str, list[float]] = {key: [] for key in ("plain_repeat", *ENGINES)}
    loss_errors: dict[str, list[float]] = {engine: [] for engine in ENGINES}
    exact = dict.fromkeys(errors, 0)
    moved = {engine: [] for engine in ENGINES}
    for step in range(steps):
        ids = step_ids(step, batch, seq, vocab, device.device)
        loss = forward_backward(plain, ids)
        reference = flat_grads(plain)
        runs = {"plain_repeat": (forward_backward(plain, ids), flat_grads(plain))}
        for engine in ENGINES:
            runs[engine] = (forward_backward(models[engine], ids), flat_grads(models[engine]))
            controllers[engine].end_step()
            moved[engine].append(controllers[engine].last_step_bytes)
        for key, (run_loss, grads) in runs.items():
            errors[key].append(relative_error(grads, reference))
            exact[key] += int(torch.equal(grads, reference))
            if key in loss_errors:
                loss_errors[key].append(abs(run_loss.float().item() - loss.float().item()))
        with torch.no_grad():
            for p in plain.parameters():
                p.add_(p.grad, alpha=-1e-3)
            for model in models.values():
                for target, source in zip(model.parameters(), plain.parameters(), strict=True):
                    target.copy_(source)
    del plain, models, controllers
    noise = max(errors["plain_repeat"])
    tolerance = max(10 * noise, 1e-6)
    layer_bytes = batch * seq * hidden * torch.finfo(dtype).bits // 8
    result = {
        "config": name,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": dict(layers=layers, hidden=hidden, batch=batch, seq=seq, vocab=vocab),
        "steps": steps,
        "noise_floor": noise,
        "tolerance": tolerance,
    }
    for engine in ENGINES:
        expected = (layers - (engine == "stream")) * layer_bytes
        result[engine] = {
            "max_relative_error": max(errors[engine]),
            "mean_relative_error": statistics.fmean(errors[engine]),
            "bitwise_equal_steps": exact[engine],
            "max_loss_difference": max(loss_errors[engine]),
            "bytes_per_step": sorted(set(moved[engine])),
            "expected_bytes_per_step": expected,
            "pass": max(errors[engine]) <= tolerance and set(moved[engine]) == {expected},
        }
    result["plain_repeat_bitwise_equal_steps"] = exact["plain_repeat"]
    return result


# ---- 2. step time and memory ------------------------------------------------------------------------


def step_cost(layers: int, hidden: int, seq: int) -> float:
    """Relative cost of a step: the matmuls and the attention of one forward, per layer."""
    return layers * seq * (24 * hidden * hidden + 4 * seq * hidden)


def time_shape(shape: tuple, vocab: int, measured: int, device: Device) -> dict[str, Any]:
    layers, hidden, seq = shape
    heads, kv_heads, head_dim = (hidden // 128, 8, 128) if hidden >= 1024 else (4, 2, hidden // 4)  # Qwen3 8B: 32 x 128
    model = qwen3(layers, hidden, 3 * hidden, heads, kv_heads, head_dim, vocab, torch.bfloat16, device.device)
    layer_bytes = seq * hidden * 2
    blocks: dict[str, Any] = {}
    for block in ("plain", "stream", "sync", "plain_again"):
        engine = block if block in ENGINES else None
        controller = offload(model, engine) if engine else None
        ids = step_ids(0, 1, seq, vocab, device.device)
        device.sync()
        device.reset_peak()
        base = device.allocated()
        loss = model(input_ids=ids, labels=ids).loss
        device.sync()
        after_forward = device.allocated()
        loss.backward()
        del loss
        device.sync()
        peak = device.peak()
        times = []
        for step in range(1 + measured):
            ids = step_ids(1 + step, 1, seq, vocab, device.device)
            device.sync()
            start = time.perf_counter()
            forward_backward(model, ids)
            device.sync()
            if step > 0:
                times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        blocks[block] = {
            "median_s": statistics.median(times),
            "times_s": times,
            "held_after_forward": None if base is None else after_forward - base,
            "peak": None if base is None else peak - base,
        }
        if controller is not None:
            controller.detach(restore=True)
    del model
    plain = statistics.fmean([blocks["plain"]["median_s"], blocks["plain_again"]["median_s"]])
    result: dict[str, Any] = {
        "shape": dict(layers=layers, hidden=hidden, seq=seq, batch=1, vocab=vocab, dtype="bfloat16"),
        "layer_input_bytes": layer_bytes,
        "plain_drift": abs(blocks["plain"]["median_s"] - blocks["plain_again"]["median_s"]) / plain,
        "blocks": blocks,
    }
    for engine in ENGINES:
        result[f"{engine}_overhead"] = blocks[engine]["median_s"] / plain - 1
        held = blocks[engine]["held_after_forward"]
        result[f"{engine}_freed"] = None if held is None else blocks["plain"]["held_after_forward"] - held
    if result["sync_freed"] is not None:
        result["expected_sync_freed"] = layers * layer_bytes
        result["stream_freed_plus_one_layer_minus_sync_freed"] = (
            result["stream_freed"] + layer_bytes - result["sync_freed"]
        )
    return result


# ---- report ---------------------------------------------------------------------------------------------


def verdicts(report: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    grads = report["gradients"]
    if grads:
        out["gradients_match"] = all(r[engine]["pass"] for r in grads for engine in ENGINES)
    target = next((t for t in report["timing"] if t.get("shape", {}).get("seq") == 32768), None)
    if target is not None and "stream_overhead" in target and report["device"]["type"] == "cuda":
        stream, sync = target["stream_overhead"], target["sync_overhead"]
        out["stream_overhead_under_3pct"] = stream < 0.03
        out["stream_overhead_at_most_quarter_of_sync"] = stream <= sync / 4
        out["memory_freed_as_sync_less_one_layer"] = abs(target["stream_freed_plus_one_layer_minus_sync_freed"]) < 2**20
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = ["# autooffload engine check", ""]
    env = report["environment"]
    lines.append(
        f"{report['device']['name']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"CUDA_LAUNCH_BLOCKING was {env['cuda_launch_blocking_given']!r} (removed); host memory "
        f"{env['host_available_gib']:.0f}/{env['host_total_gib']:.0f} GiB available; {report['elapsed_s']:.0f} s."
    )
    lines += ["", "## Gradients against plain checkpointing", ""]
    lines.append("| config | dtype | steps | noise floor | engine | max rel. error | bitwise equal | bytes/step | ok |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in report["gradients"]:
        for engine in ENGINES:
            e = r[engine]
            lines.append(
                f"| {r['config']} {r['shape']['layers']}x{r['shape']['hidden']}, {r['shape']['batch']}x"
                f"{r['shape']['seq']} | {r['dtype']} | {r['steps']} | {r['noise_floor']:.2e} | {engine} | "
                f"{e['max_relative_error']:.2e} | {e['bitwise_equal_steps']}/{r['steps']} | "
                f"{', '.join(f'{b:,}' for b in e['bytes_per_step'])} (expected {e['expected_bytes_per_step']:,}) | "
                f"{'yes' if e['pass'] else 'NO'} |"
            )
    lines += ["", "## Step time and memory (bf16, batch 1)", ""]
    lines.append(
        "| layers x hidden x seq | plain s | sync overhead | stream overhead | sync freed | stream freed | "
        "peak plain / sync / stream | plain drift |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for t in report["timing"]:
        if "skipped" in t:
            lines.append(f"| {t['label']} | skipped: {t['skipped']} | | | | | | |")
            continue
        s, b = t["shape"], t["blocks"]

        def gib(value):
            return "n/a" if value is None else f"{value / 2**30:.2f} GiB"

        lines.append(
            f"| {s['layers']}x{s['hidden']}x{s['seq']} | {b['plain']['median_s']:.3f} | {t['sync_overhead']:+.2%} | "
            f"{t['stream_overhead']:+.2%} | {gib(t['sync_freed'])} | {gib(t['stream_freed'])} | "
            f"{gib(b['plain']['peak'])} / {gib(b['sync']['peak'])} / {gib(b['stream']['peak'])} | "
            f"{t['plain_drift']:.2%} |"
        )
    lines += ["", "## Verdicts", ""]
    lines += [f"- {name}: {shown(ok)}" for name, ok in report["verdicts"].items()] or ["- none"]
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out: Path, started: float, caught: list) -> None:
    report["elapsed_s"] = time.perf_counter() - started
    report["verdicts"] = verdicts(report)
    report["autooffload_warnings"] = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    (out / "engine_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "engine_check.md").write_text(markdown(report))


def main(argv: list[str] | None = None) -> int:
    launch_blocking = os.environ.pop("CUDA_LAUNCH_BLOCKING", None)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes and few steps (a check of the script)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip what would run past this many seconds")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary of the timing models (default 32768)")
    options = parser.parse_args(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", AutoOffloadWarning)
        report = run(options, launch_blocking, caught)
    print(markdown(report))
    return 0 if all(report["verdicts"].values()) else 1


def run(options: argparse.Namespace, launch_blocking: str | None, caught: list) -> dict[str, Any]:
    import transformers

    started = time.perf_counter()
    transformers.logging.set_verbosity_error()
    device = Device(options.device)
    vocab = options.vocab or (512 if options.quick else 32768)
    available, total = host_memory()
    report: dict[str, Any] = {
        "device": {"type": device.device.type, "name": device.describe()},
        "environment": {
            **releases(),
            "cuda_launch_blocking_given": launch_blocking,
            "host_available_gib": available / 2**30,
            "host_total_gib": total / 2**30,
        },
        "gradients": [],
        "timing": [],
    }
    for name, config in (QUICK_GRAD_CONFIGS if options.quick else GRAD_CONFIGS).items():
        for dtype in (torch.float32, torch.bfloat16):
            report["gradients"].append(gradient_check(name, config, dtype, device))
            write(report, options.out, started, caught)
            print(f"gradients {name} {dtype}: {[report['gradients'][-1][e]['pass'] for e in ENGINES]}", flush=True)
    last: tuple[float, float] | None = None  # (seconds, cost) of the last shape timed
    for shape in QUICK_SHAPES if options.quick else TIMING_SHAPES:
        label = "x".join(map(str, shape))
        measured = 2 if options.quick else (5 if shape[2] <= 16384 else 4 if shape[2] <= 32768 else 3)
        elapsed = time.perf_counter() - started
        if last is not None:
            estimate = last[0] * step_cost(*shape) / last[1] * 4 * (2 + measured)
            if elapsed + estimate > options.budget_s:
                report["timing"].append({"label": label, "skipped": f"estimated {estimate:.0f} s past the budget"})
                continue
        try:
            result = time_shape(shape, vocab, measured, device)
        except torch.cuda.OutOfMemoryError as error:
            result = {"label": label, "skipped": f"out of memory: {str(error).splitlines()[0]}"}
            torch.cuda.empty_cache()
        else:
            last = (result["blocks"]["plain"]["median_s"], step_cost(*shape))
        report["timing"].append(result)
        write(report, options.out, started, caught)
        print(f"timing {label}: done", flush=True)
    write(report, options.out, started, caught)
    return report


if __name__ == "__main__":
    sys.exit(main())
