"""The fault matrix: a failure at every guarded entry point and every place inside a step, in every window of a
training step, and the other faults a training job meets.

    python benchmarks/faults.py --out DIR              # the whole matrix (about an hour on two CPU cores)
    python benchmarks/faults.py --out DIR --quick      # a slice of it (what tests/test_faults.py runs)

Each cell trains a tiny random model through the real Trainer (4 layers, hidden 64, gradient accumulation 2,
6 optimizer steps of mixed lengths, an evaluation and a checkpoint save every 3 steps) with
``autooffload.attach(trainer)``, mode ``auto`` and a :class:`~autooffload.SimulatedDevice` small enough that the
long micro-batches offload and (``recompute="auto"``) the short ones keep; then injects one fault. Axes:

- **topology**: one process; two ranks under DDP over gloo (``torchrun``); two ranks under DeepSpeed ZeRO-3
  through Trainer (the entry points it reaches: no rescue there);
- **model**: a Qwen3; a T5 (encoder-decoder); a Qwen3 whose loss comes from ``model.model(...)`` (TRL's fused
  loss: the top model's forward never runs, or runs without tokens through a wrapper, the call redirected);
- **engine** ``sync``/``stream``, **policy** ``predictive``/``hysteresis``, **recompute** ``always``/``auto``
  (every combination on one process, for the Qwen3);
- **faults**: an exception at every guarded entry point (``autooffload.guard.ENTRY_POINTS``) and every place of
  autooffload's code inside a step (``autooffload.guard.IN_STEP``), enumerated from the registries (a new one is
  covered without editing this file), once in each **window** of the run the fault-free run called it in
  (:class:`Moment`: the run's first micro-batch, a non-last and the last micro-batch of an accumulation, each's
  forward and backward, an evaluation, outside a micro-batch), raised before the entry's body (and after it: after
  the pre-forward hook's body is after the agreement), on rank 1, rank 0 or both (:func:`plans` says which
  configuration gets which); a probe that raises an NVML error, or that returns ``None``, a fraction above 1 or
  NaN, or whose ``reset()`` raises; host buffers that cannot be allocated or pinned, and host memory running out
  mid-step; a process killed with SIGKILL between two steps, then resumed from the last Trainer checkpoint. An
  entry point reached only in a resumed run (a load) runs resumed from the fault-free run's checkpoint; one reached
  only by an out-of-memory step (the rescue) runs with one injected.

Per cell: **survived** (every rank finished every step, no hang, no crash), **identical** (per micro-batch losses
and final parameters bit-identical, fp32 on the CPU, to the same configuration's fault-free run, itself equal to
plain checkpointing), **warned** (the failing rank warned once, naming the entry point or place and the cause; the
other rank once, naming the rank that gave up), **detached** (no hook, owner or host buffer of autooffload left on
the model, its checkpoint functions plain), **same collectives** (the ranks made the same sequence of Python-level
collectives, and autooffload no more than without the fault), **raised** (the fault struck once, in the window
planned), and for the kill, **resumed exactly** (the resumed run's losses and parameters those of the
uninterrupted run). It writes ``faults.json`` (every cell) and ``faults.md`` (the tables) under ``--out``.

The matrix's parts are the package ``benchmarks/fault_matrix/`` (``config``, ``inject``, ``training``, ``launch``,
``matrix``, ``report``, importing downwards only); this script runs it, and each job of it in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not an installed autooffload

from benchmarks.fault_matrix import config, inject, launch, matrix, report, training  # noqa: E402
from benchmarks.fault_matrix.config import TOPOLOGIES  # noqa: E402
from benchmarks.fault_matrix.launch import Job, run_job, worker  # noqa: E402
from benchmarks.fault_matrix.matrix import run_topology  # noqa: E402
from benchmarks.fault_matrix.report import CHECKS, table, write  # noqa: E402


def __getattr__(name: str) -> Any:
    """``faults.train``, ``from benchmarks.faults import Config``: the matrix's parts lived in this file, and are found
    in its package by the same names."""
    for module in (config, inject, training, launch, matrix, report):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="one configuration per topology")
    parser.add_argument("--topology", nargs="+", choices=TOPOLOGIES, default=list(TOPOLOGIES))
    parser.add_argument("--only", nargs="+", help="these entry points and faults (names as in the table)")
    parser.add_argument("--no-kill", action="store_true", help="leave out the SIGKILL cells")
    parser.add_argument("--work", type=Path, help="where the runs' checkpoints go (default: a temporary folder)")
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--job", nargs=2, type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if options.worker:
        worker(*options.worker)
        return 0
    if options.job:
        result = run_job(Job.from_json(json.loads(options.job[0].read_text())))
        options.job[1].write_text(json.dumps(result))
        return 0
    if options.out is None:
        parser.error("--out is required")
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    work = options.work or Path(tempfile.mkdtemp(prefix="autooffload-faults-"))
    started = time.time()

    def log(line: str) -> None:
        print(f"[{time.time() - started:7.0f} s] {line}", flush=True)

    verdicts: list[dict] = []
    only = tuple(options.only) if options.only else None
    for topology in options.topology:
        if topology == "zero3" and not deepspeed_available():
            log("zero3: DeepSpeed is not installed; skipped")
            continue
        verdicts += run_topology(topology, work, options.quick, only, log, kill=not options.no_kill)
        write(out, verdicts, options, time.time() - started)
    if options.work is None:
        shutil.rmtree(work, ignore_errors=True)
    print(table(verdicts))
    return 0 if all(all(v.get(k, True) for k in CHECKS) for v in verdicts if not v.get("unreached")) else 1


def deepspeed_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


if __name__ == "__main__":
    sys.exit(main())
