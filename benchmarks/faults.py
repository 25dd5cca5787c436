"""The fault matrix: a failure at every guarded entry point and every place inside a step, in every window of a
training step, and the other faults a training job meets.

    python benchmarks/faults.py --out DIR              # the whole matrix (about an hour on two CPU cores)
    python benchmarks/faults.py --out DIR --quick      # a slice of it (what tests/test_faults.py runs)

Each cell trains a tiny random model through the real Trainer with ``autooffload.attach(trainer)`` and a
:class:`~autooffload.SimulatedDevice` small enough that long micro-batches offload and short ones keep, then injects
one fault; the faults are enumerated from ``autooffload.guard``'s registries, so a new entry point is covered without
editing this file. The axes (topology, model, engine, policy, recompute, fault, window, rank) and what each verdict
of a cell means (survived, identical, warned, detached, same collectives, raised, resumed exactly):
benchmarks/README.md and docs/faults.md. It writes ``faults.json`` (every cell) and ``faults.md`` (the tables).

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
