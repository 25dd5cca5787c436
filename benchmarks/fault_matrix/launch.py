"""Running cells: one process, two ranks under torchrun, or one job in a process of its own (a kill, a resume); each
batch of jobs in one launch, each job's result written by the process that ran it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .config import BATCH_TIMEOUT_S, SAVE_EVERY, TIMEOUT, Config, Fault, rank
from .training import train

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "faults.py"  # a job or a batch of them runs in the script's own process


@dataclasses.dataclass(frozen=True)
class Job:
    """One run of the matrix: ``role`` "plain" (no autooffload), "reference" (no fault) or "cell"; ``resume``: a
    checkpoint to start from; ``kill_at``: the step at whose start the last rank kills itself; ``save_every``."""

    config: Config
    fault: Fault
    role: str
    out: str
    resume: str | None = None
    kill_at: int | None = None
    save_every: int = SAVE_EVERY

    @property
    def key(self) -> str:
        return f"{self.role} {self.config.name} {self.fault.label} {self.fault.run} at {self.fault.at}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> Job:
        return Job(Config(**data["config"]), Fault(**data["fault"]), **{
            k: v for k, v in data.items() if k not in ("config", "fault")
        })  # fmt: skip


def run_job(job: Job) -> dict[str, Any]:
    result = train(job.config, job.fault, Path(job.out), autooffload=job.role != "plain", kill_at=job.kill_at,
                   resume=job.resume, save_every=job.save_every)  # fmt: skip
    return {"key": job.key, **result}


def worker(jobs_file: Path, results: Path) -> None:
    """A torchrun worker: run the jobs in order, appending each result to ``results/rank{N}.jsonl`` as it ends."""
    torch.distributed.init_process_group("gloo", timeout=TIMEOUT)
    jobs = [Job.from_json(data) for data in json.loads(jobs_file.read_text())]
    for job in jobs:
        result = run_job(job)
        with open(results / f"rank{rank()}.jsonl", "a") as file:
            file.write(json.dumps(result) + "\n")
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as tests/distributed_worker.py: no interpreter teardown (DeepSpeed's CPU ranks abort in it)


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOOFFLOAD_", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault(
        "TORCH_EXTENSIONS_DIR",
        str(
            Path.home()
            / ".cache"
            / "autooffload"
            / "torch_extensions"
            / hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
        ),
    )
    return env


def launch(command: list[str], timeout_s: int) -> tuple[int, str]:
    """Run ``command`` in its own process group; kill the group if it overruns. Returns (exit code, output tail)."""
    process = subprocess.Popen(command, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return -999, output[-3000:]
    return process.returncode, output[-3000:]


def run_ranked(jobs: list[Job], scratch: Path, timeout_s: int = BATCH_TIMEOUT_S) -> dict[str, list[dict | None]]:
    """Run ``jobs`` on two ranks (torchrun); returns, per job key, each rank's result (None: it did not finish).
    A batch that crashes or hangs is retried from the job after the one that did not finish."""
    results: dict[str, list[dict | None]] = {}
    pending = list(jobs)
    while pending:
        batch = scratch / f"batch-{time.monotonic_ns()}"
        batch.mkdir(parents=True)
        (batch / "jobs.json").write_text(json.dumps([job.to_json() for job in pending]))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(SCRIPT), "--worker", str(batch / "jobs.json"), str(batch)]  # fmt: skip
        code, output = launch(command, timeout_s)
        done = [[json.loads(line) for line in (batch / f"rank{r}.jsonl").read_text().splitlines()]
                if (batch / f"rank{r}.jsonl").exists() else [] for r in range(2)]  # fmt: skip
        finished = min(len(done[0]), len(done[1]))
        for index, job in enumerate(pending[:finished]):
            results[job.key] = [done[0][index], done[1][index]]
        if finished == len(pending):
            break
        failed = pending[finished]
        results[failed.key] = [
            done[r][finished] if len(done[r]) > finished else None for r in range(2)
        ]  # fmt: skip
        results[failed.key + " output"] = output  # type: ignore[assignment]
        if code == 0:  # every rank returned, yet a result is missing: nothing more to learn from a rerun
            break
        pending = pending[finished + 1 :]
    return results


def run_alone(jobs: list[Job], scratch: Path) -> dict[str, list[dict | None]]:
    """Run ``jobs`` in this process, one after the other; a job that raises did not finish."""
    results: dict[str, list[dict | None]] = {}
    for job in jobs:
        try:
            results[job.key] = [run_job(job)]
        except Exception as error:  # a cell that does not survive is a result, not the end of the matrix
            results[job.key] = [None]
            results[job.key + " output"] = f"{type(error).__name__}: {error}"  # type: ignore[assignment]
    return results


def run_single(job: Job, scratch: Path) -> tuple[int, dict | None]:
    """Run one job in a process of its own (a kill must not take this one with it)."""
    scratch.mkdir(parents=True, exist_ok=True)
    spec, out = scratch / f"job-{time.monotonic_ns()}.json", scratch / f"result-{time.monotonic_ns()}.json"
    spec.write_text(json.dumps(job.to_json()))
    code, _ = launch([sys.executable, str(SCRIPT), "--job", str(spec), str(out)], BATCH_TIMEOUT_S)
    return code, json.loads(out.read_text()) if out.exists() else None


# ---- the matrix -------------------------------------------------------------------------------------------
