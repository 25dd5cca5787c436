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

The parts, in order of value: ``mixed`` (``benchmarks/mixed.py``), ``seed`` (the setup transformers' ``offload=True``
was published with, ``auto`` beside it), ``engines``, ``pinning`` (``benchmarks/host_pinning.py``), ``ladder``
(``benchmarks/ladder.py --engine stream``), ``memory_model`` (the predicted peak against the real one); what each
measures and how long it takes: docs/benchmarks.md, the GPU check.

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
from gpu_parts import emit, gib  # noqa: E402
from gpu_parts.memory import part_memory_model, part_pinning, part_probe, part_smoke  # noqa: E402
from gpu_parts.speed import part_engines, part_ladder, part_mixed, part_seed  # noqa: E402

PARTS = ("mixed", "seed", "engines", "pinning", "ladder", "memory_model", "probe", "smoke")
DEFAULT_PARTS = PARTS[:6]
BUDGETS_S = {
    "mixed": 135, "seed": 45, "engines": 65, "pinning": 45, "ladder": 55, "memory_model": 25, "probe": 25, "smoke": 55,
}  # fmt: skip
TOTAL_S = 450.0  # the parts' budgets and their start-ups: under 8 minutes on one H100 or H200
START_UP_S = 40  # importing torch and transformers, building the model: outside a part's own clock
MIN_PART_S = 20
QUICK_PART_S = 600  # --quick checks the script, not the clock: no part is cut short for time


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
            out.append(f"- {engine} freed {gib(freed['freed'])} of {gib(freed['expected'])}"
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
    from harness.environment import releases

    found: dict[str, Any] = {"device": device, **releases()}
    for name in ("accelerate", "deepspeed", "pynvml"):
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
