"""Every GPU claim of autooffload, measured in one call: the script to run first whenever a GPU is lent.

    PYTHONPATH=. python benchmarks/gpu_check.py --out $OUT/check                 # one CUDA GPU, under 8 minutes
    PYTHONPATH=. python benchmarks/gpu_check.py --out /tmp/check --device cpu --quick      # the same code, a minute

GPU time is rare and brief, so one call must bring back everything and a call cut short must keep what
finished. The parts run in order of value, each in its own process (a crash or an out-of-memory error in
one cannot take the others down, and each starts with an empty device) with its own time budget inside the
total (``--budget-s``, default 450 s). After every part ``gpu_check.json`` (every finished part's results) and
``gpu_check.md`` (the figures and one verdict per target) are rewritten in ``--out``, and ``gpu_check.log`` holds
everything the parts printed: three files, well inside what a device call brings back. The verdicts are what
the rule for the defaults reads (docs/engines.md, docs/ladder.md).

1. ``mixed``: ``benchmarks/mixed.py``, the trace that decides: plain, transformers' ``offload=True``, torchtune's
   ``OffloadActivations`` (where installed), ``on`` with each engine, ``auto`` with today's defaults, with
   ``stream``, and with ``stream`` and ``recompute="auto"``; Qwen3-1.7B layers, a warm-up pass and three
   interleaved timed passes, with room and under a budget where the long micro-batches must offload some layers.
2. ``seed``: the setup transformers' ``offload=True`` was published with (Qwen3-1.7B's config, bf16, one
   sequence of 32k tokens; peak 11.13 -> 10.16 GB on one H100), with ``auto`` beside it.
3. ``engines``: the offload engines at a Qwen3-8B layer shape (36 layers x hidden 4096 x 16k tokens, bf16, batch
   1): bytes freed after the forward against the arithmetic (``sync``: every layer input; ``stream``: all but the
   last), and median step time against plain checkpointing; a short bf16 gradient check against plain first.
4. ``pinning``: ``benchmarks/host_pinning.py`` under ``OMP_NUM_THREADS=1`` (as torchrun runs each rank) and with
   torch's default threads: the ways to get pinned memory, and a step that needs new buffers, pinned in it or
   ahead on threads.
5. ``ladder``: ``benchmarks/ladder.py --engine stream`` (no checkpointing, plain, ``recompute=always`` and
   ``auto`` side by side, under a budget from the allocator), scenarios (a)-(c): its targets, and whether a kept
   layer ever broke the budget.
6. ``memory_model``: the predictive policy's predicted peak before every step against the allocator's real peak
   of that step, on a trace of lengths it has partly not seen.

Not run unless named in ``--parts`` (measured on the first H200 and unchanged since): ``probe`` (NVML, the caching
allocator and ``mem_get_info`` side by side while memory fills, frees and refills) and ``smoke`` (the FSDP2 part of
``benchmarks/multi_gpu_smoke.py`` on one GPU).

A part that needs a package the machine lacks says so and is skipped; the others run. Exit status 0 when every
verdict that was reached passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
for path in (str(ROOT), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

PARTS = ("mixed", "seed", "engines", "pinning", "ladder", "memory_model", "probe", "smoke")
DEFAULT_PARTS = PARTS[:6]
BUDGETS_S = {
    "mixed": 135, "seed": 45, "engines": 65, "pinning": 45, "ladder": 55, "memory_model": 25, "probe": 25, "smoke": 55,
}  # fmt: skip
TOTAL_S = 450.0  # the parts' budgets and their start-ups: under 8 minutes on one H100 or H200
START_UP_S = 40  # importing torch and transformers, building the model: outside a part's own clock
MIN_PART_S = 20
QUICK_PART_S = 600  # --quick checks the script, not the clock: no part is cut short for time
FREED_TOLERANCE = 0.005
UNDER_PREDICTION_TOLERANCE = 0.02
OVER_PREDICTION_LIMIT = 0.25
IN_SPAN_TOLERANCE = 0.05  # a length within those sampled: the replay of the first H200 run is within 1%


def emit(line: str) -> None:
    print(f"gpu_check: {line}", flush=True)


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
    import engine_check
    import mixed
    import torch
    from harness.models import StepProbe
    from harness.rounds import rotated

    if quick:
        config, seq = (2, 64, 128, 4, 2, 16, 256), 128
    else:
        config, seq = (28, 2048, 6144, 16, 8, 128, 151936), 32768
    model = engine_check.qwen3(*config, torch.bfloat16, torch.device(device))
    total = torch.cuda.get_device_properties(0).total_memory if device.startswith("cuda") else 64 * 2**30
    probe = StepProbe(total, separate_host=device == "cpu")
    modes = [mixed.Mode(name, model, device, probe, None) for name in SEED_MODES]
    watch = mixed.GcWatch()
    rows: dict[str, list[dict[str, Any]]] = {mode.name: [] for mode in modes}
    started = time.perf_counter()
    for round_ in range(3):
        if round_ == 2 and (time.perf_counter() - started) * 1.5 > budget_s:
            break
        for mode in rotated(modes, round_):
            ids = engine_check.tokens(round_, 1, seq, config[-1], torch.device(device))
            row = mixed.run_step(mode, ids, device == "cpu", watch, decoder_loss)
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
        verdicts["auto_under_memory_high"] = auto["peak_gb"] * 1e9 <= mixed.HIGH * total
    shape = dict(
        zip(("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"), config, strict=True)
    )
    return {"shape": {**shape, "seq": seq, "dtype": "bf16"}, "modes": summary, "steps": rows, "verdicts": verdicts}


# ---- 6. the predictive memory model ---------------------------------------------------------------------


class SyntheticProbe:
    """``--device cpu`` only: a reading linear in the step's tokens, so that the comparison runs on a CPU.
    Its numbers mean nothing; on a GPU the real probe (NVML and the caching allocator) reads the device."""

    def __init__(self) -> None:
        self.tokens = 0

    def read(self):
        from autooffload import MemoryReading

        return MemoryReading(2**30 + self.tokens * 2**20, 80 * 2**30)


def predicted_peak(policy: Any, tokens: int, bytes_per_layer: int | None) -> float | None:
    """What the policy predicts for a step of ``tokens`` offloading nothing; None where it cannot say."""
    predict = getattr(policy, "predict", None)
    if predict is None:
        return None
    try:
        return predict(tokens, bytes_per_layer)
    except TypeError:
        return predict(tokens)


def part_memory_model(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    import engine_check
    import torch

    from autooffload import OffloadController, PredictivePolicy, Settings

    cuda = device.startswith("cuda")
    if quick:
        shape, lengths = (2, 64, 128, 4, 2, 16, 256), [32, 64, 128, 32, 96, 160]
    else:
        shape, lengths = (16, 1024, 3072, 16, 8, 64, 32768), [2048, 4096, 8192, 2048, 16384, 4096, 24576, 32768]
    model = engine_check.qwen3(*shape, torch.bfloat16, torch.device(device))
    probe = "auto" if cuda else SyntheticProbe()
    controller = OffloadController(Settings(policy="predictive"), probe=probe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    controller.attach(model, compiled=False, optimizer=optimizer)
    rows = []
    started = time.perf_counter()
    for step, seq in enumerate(lengths):
        if time.perf_counter() - started > budget_s:
            rows.append({"step": step, "seq": seq, "skipped": "time budget"})
            break
        per_layer = round(controller.sizes.token_bytes * seq) if controller.sizes.token_bytes else None
        predicted = predicted_peak(controller.policy, seq, per_layer)
        ids = engine_check.tokens(step, 1, seq, shape[-1], torch.device(device))
        if isinstance(probe, SyntheticProbe):
            probe.tokens = seq
        began = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        level = controller.switch.offloaded if controller.switch is not None else 0
        controller.end_step()
        reading = controller.memory.last.bytes
        as_if_plain = None if reading is None else reading + level * (per_layer or 0)
        row = {"step": step, "seq": seq, "predicted": predicted, "reading": reading, "offloaded_layers": level}
        row.update(as_if_plain=as_if_plain, seconds=round(seconds, 3))
        if predicted and as_if_plain:
            row["real_over_predicted"] = as_if_plain / predicted
        rows.append(row)
        emit(f"memory_model: step {step} seq {seq}: predicted {_gib(predicted)}, real {_gib(as_if_plain)}")
    compared = [row["real_over_predicted"] for row in rows if "real_over_predicted" in row]
    in_span = [
        row["real_over_predicted"]
        for i, row in enumerate(rows)
        if "real_over_predicted" in row
        and min(r["seq"] for r in rows[:i]) <= row["seq"] <= max(r["seq"] for r in rows[:i])
    ]
    verdicts = {}
    if compared and cuda:
        verdicts["never_under_predicted_by_2pct"] = max(compared) <= 1 + UNDER_PREDICTION_TOLERANCE
        verdicts["over_prediction_at_most_25pct"] = min(compared) >= 1 / (1 + OVER_PREDICTION_LIMIT)
        if in_span:
            verdicts["in_span_within_5pct"] = all(abs(1 / ratio - 1) <= IN_SPAN_TOLERANCE for ratio in in_span)
    result = {"probe": "NVML + allocator" if cuda else "synthetic (cpu)", "rows": rows, "verdicts": verdicts}
    result["policy"] = type(controller.policy).__name__
    if isinstance(controller.policy, PredictivePolicy):
        result["samples"] = [list(sample) for sample in controller.policy.samples]
    return result


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f} GiB"


# ---- 4. pinning ------------------------------------------------------------------------------------------


def part_pinning(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    """``benchmarks/host_pinning.py`` twice, each in its own process: under ``OMP_NUM_THREADS=1`` and with torch's
    default threads. The verdict: pinning ahead on two threads makes the step that needs new buffers faster than
    pinning in it (the default), with either setting: the rule for turning it on by default (docs/host-memory.md)."""
    script = HERE / "host_pinning.py"
    args = ["--device", "cuda" if device.startswith("cuda") else "cpu"]
    args += ["--sizes-mib", "8", "--layers", "4", "--layer-mib", "4", "--layer-ms", "2"] if quick else []
    args += [] if quick else ["--sizes-mib", "256,1024", "--repeats", "1"]  # the step is what decides; 12 s a run
    reports, verdicts = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for label, threads in (("omp1", "1"), ("threads", None)):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            env.pop("OMP_NUM_THREADS", None)
            env.update({"OMP_NUM_THREADS": threads} if threads else {})
            command = [sys.executable, str(script), "--out", scratch, "--name", label, *args]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=max(budget_s / 2, 10))
            if done.returncode != 0:
                reports[label] = {"error": (done.stdout + done.stderr)[-2000:]}
                continue
            reports[label] = report = json.loads((Path(scratch) / f"{label}.json").read_text())
            steps = {row["way"]: row for row in report["step"]}
            for row in report["step"]:
                emit(f"pinning ({label}): {row['way']}: {row['step_s']:.3f} s, waited {row['pin_wait_s']:.3f} s")
            if device.startswith("cuda"):
                verdicts[f"ahead_faster_than_in_step_{label}"] = (
                    steps["ahead, 2 threads"]["step_s"] < steps["in step"]["step_s"]
                )
    return {"runs": reports, "verdicts": verdicts}


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


# ---- 7. the probe ---------------------------------------------------------------------------------------


def memory_readers(device: str) -> dict[str, Callable[[], int]]:
    """Every reading of used device memory this machine offers, in bytes."""
    import torch

    if not device.startswith("cuda"):
        import psutil

        return {"process_rss": lambda: psutil.Process().memory_info().rss}
    from autooffload import NvmlProbe

    index = torch.device(device).index or 0
    probe = NvmlProbe(torch.device("cuda", index))
    nvml, handle = probe._nvml, probe._handles[index]  # no handle where NVML cannot name the device (MIG)

    def mem_get_info_used() -> int:
        free, total = torch.cuda.mem_get_info(index)
        return total - free

    readers = {
        "probe_step_peak": lambda: probe.read().used_bytes,
        "allocated": lambda: torch.cuda.memory_allocated(index),
        "reserved": lambda: torch.cuda.memory_reserved(index),
        "mem_get_info_used": mem_get_info_used,
    }
    if handle is not None:
        readers["nvml_used"] = lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
    return readers


def part_probe(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    import torch

    readers = memory_readers(device)
    size = 2**20 if quick else 8 * 2**30
    phases = []

    def snapshot(label: str) -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        phases.append({"phase": label, **{name: read() for name, read in readers.items()}})
        emit(f"probe: {label}: " + ", ".join(f"{k} {_gib(v)}" for k, v in phases[-1].items() if k != "phase"))

    snapshot("baseline")
    block = torch.ones(size // 4, dtype=torch.float32, device=device)
    snapshot("filled")
    del block
    snapshot("freed")
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    snapshot("cache emptied")
    block = torch.ones(size // 8, dtype=torch.float32, device=device)
    snapshot("refilled half")
    del block
    verdicts = {}
    if "probe_step_peak" in readers:
        by = {phase["phase"]: phase for phase in phases}
        # The step peak reset by each reading: "freed" still holds the peak of the "filled" interval.
        verdicts["probe_falls_after_free"] = (
            by["cache emptied"]["probe_step_peak"] < by["filled"]["probe_step_peak"] - size / 2
        )
        verdicts["probe_sees_refill"] = (
            by["refilled half"]["probe_step_peak"] >= by["cache emptied"]["probe_step_peak"] + size / 4
        )
    offsets = [p["nvml_used"] - p["mem_get_info_used"] for p in phases if "nvml_used" in p and "mem_get_info_used" in p]
    if offsets:
        # NVML's "used" counts memory the driver holds that cudaMemGetInfo leaves out (0.6 GiB on the first H200
        # run): a constant offset, which the policy's fractions absorb; what matters is that both move together.
        verdicts["mem_get_info_tracks_nvml_within_1pct_of_fill"] = max(offsets) - min(offsets) <= 0.01 * size
    return {"bytes_filled": size, "phases": phases, "nvml_minus_mem_get_info": offsets, "verdicts": verdicts}


# ---- 8. the distributed smoke test, one GPU ---------------------------------------------------------------


def part_smoke(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    import tempfile

    import multi_gpu_smoke

    multi_gpu_smoke.PART_TIMEOUT_S = max(int(budget_s), 10)
    with tempfile.TemporaryDirectory() as scratch:
        result = multi_gpu_smoke.run_part("fsdp2", "cuda" if device.startswith("cuda") else "cpu", Path(scratch))
    return {"fsdp2": result, "verdicts": {"fsdp2_bytes_match_arithmetic": bool(result.get("ok"))}}


RUNNERS: dict[str, Callable[[str, bool, float], dict[str, Any]]] = {
    "mixed": part_mixed,
    "seed": part_seed,
    "engines": part_engines,
    "pinning": part_pinning,
    "ladder": part_ladder,
    "memory_model": part_memory_model,
    "probe": part_probe,
    "smoke": part_smoke,
}


def run_inside(part: str, device: str, quick: bool, budget_s: float, out: Path) -> int:
    """One part, in the child process: its result (or why it did not finish) goes to ``<part>.json``."""
    import torch

    warnings.simplefilter("ignore")
    started = time.perf_counter()
    try:
        if part != "probe":
            import transformers

            transformers.logging.set_verbosity_error()
        result = RUNNERS[part](device, quick, budget_s)
    except ImportError as error:
        result = {"skipped": f"missing package: {error.name or error}"}
    except torch.cuda.OutOfMemoryError as error:
        result = {"error": f"out of device memory: {str(error).splitlines()[0]}"}
    except Exception as error:  # reported, so that the other parts and the summary still come back
        result = {"error": f"{type(error).__name__}: {error}"}
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    (out / f"{part}.json").write_text(json.dumps(result, indent=2, default=str))
    return 0 if "error" not in result else 1


# ---- the parent: budgets, processes, summary ------------------------------------------------------------


def run_part(part: str, options: argparse.Namespace, budget_s: float, log_path: Path) -> dict[str, Any]:
    """``part`` in its own process group, killed if it outlives its budget plus start-up; its output is
    appended to the log, and its ``gpu_check:`` lines are echoed here."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("CUDA_LAUNCH_BLOCKING", None)  # the engines' races must be able to happen
    scratch = Path(getattr(options, "scratch", None) or options.out)
    command = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--out", str(scratch)]
    command += ["--device", options.device, "--budget-s", f"{budget_s:.0f}"] + (["--quick"] if options.quick else [])
    result_file = scratch / f"{part}.json"
    result_file.unlink(missing_ok=True)
    timeout = budget_s + START_UP_S
    started = time.perf_counter()
    with log_path.open("a") as log:
        log.write(f"==== {part}\n")
        log.flush()
        offset = log.tell()
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            returncode, timed_out = process.wait(), True
    with log_path.open() as log:
        log.seek(offset)
        for line in log:
            if line.startswith("gpu_check:"):
                print(line, end="", flush=True)
    if result_file.exists():
        result = json.loads(result_file.read_text())
    else:
        reason = f"killed after {timeout:.0f} s" if timed_out else f"exit status {returncode}, no result"
        result = {"error": reason}
        result_file.write_text(json.dumps(result, indent=2))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def summary(results: dict[str, dict[str, Any]], environment: dict[str, Any]) -> str:
    lines = ["# autooffload GPU check", "", _environment_line(environment), ""]
    lines += ["| part | status | seconds | verdicts |", "|---|---|---|---|"]
    for part in PARTS:
        result = results.get(part)
        if result is None:
            lines.append(f"| {part} | not run | | |")
            continue
        status = result.get("skipped") or result.get("error") or "done"
        verdicts = ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in result.get("verdicts", {}).items())
        lines.append(f"| {part} | {status} | {result.get('wall_s', '')} | {verdicts or '-'} |")
    lines += ["", "## Figures", "", *figures(results), "", "## Verdicts", ""]
    for part, result in results.items():
        for name, ok in result.get("verdicts", {}).items():
            lines.append(f"- {part}.{name}: {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines) + "\n"


def _environment_line(environment: dict[str, Any]) -> str:
    return ", ".join(f"{key} {value}" for key, value in environment.items())


def figures(results: dict[str, dict[str, Any]]) -> list[str]:
    """The numbers a reader wants without opening the JSON."""
    out = []
    engines = results.get("engines", {})
    timing = engines.get("timing")
    if timing:
        s, plain = timing["shape"], timing["blocks"]["plain"]["median_s"]
        out.append(
            f"- engines at {s['layers']}x{s['hidden']}x{s['seq']}: plain {plain:.3f} s; "
            f"sync overhead {timing['sync_overhead']:+.2%}, stream {timing['stream_overhead']:+.2%}"
        )
        for engine, freed in engines.get("freed", {}).items():
            ratio = freed.get("ratio")
            out.append(f"- {engine} freed {_gib(freed['freed'])} of {_gib(freed['expected'])}"
                       + (f" ({ratio:.4f})" if ratio is not None else ""))  # fmt: skip
    mixed = results.get("mixed", {}).get("mixed")
    for variant, result in (mixed or {}).get("results", {}).items():
        base = result["modes"]["plain"]["median_s"]
        rows = ", ".join(
            f"{name} {m['median_s']:.3f} s ({m['median_s'] / base:.3f}, spread {m['spread'] or 0:.1%}, "
            f"over {m['steps_over_budget']})"
            for name, m in result["modes"].items()
        )
        out.append(f"- mixed, {variant}, {result['timed_passes']} timed passes of {result['lengths']}: {rows}")
    seed = results.get("seed", {}).get("modes")
    if seed:
        rows = ", ".join(f"{name} {m['median_s']:.3f} s, {m['peak_gb']:.2f} GB" for name, m in seed.items())
        out.append(f"- seed setup (published: plain 11.13 GB, offload=True 10.16 GB): {rows}")
    for label, run in results.get("pinning", {}).get("runs", {}).items():
        steps = ", ".join(f"{r['way']} {r['step_s']:.3f} s" for r in run.get("step", []))
        out.append(f"- pinning ({label}): {steps or run.get('error', '')[:200]}")
    model = results.get("memory_model", {})
    ratios = [row["real_over_predicted"] for row in model.get("rows", []) if "real_over_predicted" in row]
    if ratios:
        out.append(f"- memory model ({model['probe']}): real/predicted from {min(ratios):.3f} to {max(ratios):.3f}")
    return out or ["- none yet"]


def environment(device: str) -> dict[str, Any]:
    import torch

    found: dict[str, Any] = {"device": device, "torch": torch.__version__}
    for name in ("transformers", "accelerate", "deepspeed", "pynvml"):
        try:
            module = __import__(name)
            found[name] = getattr(module, "__version__", "present")
        except ImportError:
            found[name] = "absent"
    if device.startswith("cuda") and torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
    from harness.forms import torchtune_offloading

    tune, source = torchtune_offloading()
    found["torchtune"] = source.split(" (")[0] if tune is not None else "absent"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a check of the script, in seconds")
    parser.add_argument("--budget-s", type=float, default=TOTAL_S, help=f"the whole call's budget ({TOTAL_S:.0f} s)")
    parser.add_argument(
        "--parts",
        default=",".join(DEFAULT_PARTS),
        help=f"comma-separated subset of {','.join(PARTS)} (default: the first six)",
    )
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    if options.part is not None:
        return run_inside(options.part, options.device, options.quick, options.budget_s, options.out)

    import torch

    if options.device.startswith("cuda") and not torch.cuda.is_available():
        emit("no CUDA device; use --device cpu --quick for a dry run")
        return 2
    chosen = [part for part in options.parts.split(",") if part]
    unknown = sorted(set(chosen) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    env = environment(options.device)
    emit(_environment_line(env))
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    scale = options.budget_s / TOTAL_S
    log = options.out / "gpu_check.log"
    log.write_text("")
    scratch = tempfile.TemporaryDirectory()  # the parts' own files: $OUT keeps three
    options.scratch = scratch.name
    for part in PARTS:
        if part not in chosen:
            continue
        left = options.budget_s - (time.perf_counter() - started) - START_UP_S
        budget = QUICK_PART_S if options.quick else min(BUDGETS_S[part] * scale, left)
        if budget < MIN_PART_S and not options.quick:
            results[part] = {"skipped": f"no time left ({left:.0f} s)"}
        else:
            emit(f"{part}: start, budget {budget:.0f} s")
            results[part] = run_part(part, options, budget, log)
        (options.out / "gpu_check.json").write_text(
            json.dumps({"environment": env, "parts": results}, indent=2, default=str)
        )
        (options.out / "gpu_check.md").write_text(summary(results, env))
    scratch.cleanup()
    text = summary(results, env)
    print(text)
    verdicts = [ok for result in results.values() for ok in result.get("verdicts", {}).values()]
    errors = [part for part, result in results.items() if "error" in result]
    return 0 if all(verdicts) and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
