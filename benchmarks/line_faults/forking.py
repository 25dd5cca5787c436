"""The warm parent: imports done, the heap frozen; each run forked from it, its ranks' results read back, a run past
its time killed."""

from __future__ import annotations

import gc
import json
import os
import pkgutil
import select
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .tracing import relative
from .training import CHILD, train


def warm() -> None:
    """Import what a run imports, so that no child runs an import (module-level lines are not a training step's)."""
    import transformers.trainer  # noqa: F401

    import autooffload

    for info in pkgutil.walk_packages(autooffload.__path__, "autooffload."):
        if ".integrations." in info.name:
            continue
        __import__(info.name)
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # the simulated device collects garbage each step: a child skips the parent's objects


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(log: Any) -> None:
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)


def forked(
    mode: str, world: int, ranks: tuple[int, ...], target: tuple[str, int] | None, timeout: float, **fork: Any
) -> list[dict]:
    """Run one (possibly two-rank) training from forks of this process; each rank's result, or its failure."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    children = []
    for rank in range(world):
        read, write = os.pipe()
        log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by collect, once the child is gone
        pid = os.fork()
        if pid == 0:  # the child: one run, its result down the pipe, then gone without the parent's atexit
            os.close(read)
            _child(log)
            code = 0
            try:
                with tempfile.TemporaryDirectory() as out:
                    aimed = target if rank in ranks else None
                    run = mode if aimed is not None or mode != "inject" else "ours"
                    result = train(run, world, rank, aimed, out, **fork)
                os.write(write, json.dumps(result).encode())
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os.close(write)
                os._exit(code)
        os.close(write)
        children.append((pid, read, log))
    return collect(children, timeout)


def collect(children: list[tuple[int, int, Any]], timeout: float) -> list[dict]:
    """Each child's result, read from its pipe; a child past ``timeout`` killed, its log's tail its result."""
    deadline, results = time.monotonic() + timeout, []
    chunks: dict[int, list[bytes]] = {r: [] for _, r, _ in children}
    pending = {r for _, r, _ in children}
    while pending and time.monotonic() < deadline:
        ready, _, _ = select.select(list(pending), [], [], max(0.0, deadline - time.monotonic()))
        for fd in ready:
            data = os.read(fd, 1 << 20)
            chunks[fd].append(data) if data else pending.discard(fd)
    for rank, (pid, read, log) in enumerate(children):
        if read in pending:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(read)
        text = b"".join(chunks[read])
        if text:
            results.append(json.loads(text))
        else:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            cause = "timed out" if read in pending else f"exited with status {status}"
            results.append({"rank": rank, "error": f"{cause}\n{tail}", "steps": 0, "losses": [], "warnings": []})
        log.close()
    return results


def spawner(journal: Path, timeout: float) -> Callable[[tuple[str, int]], bool]:
    """``spawn`` for :class:`~.tracing.Lines` on one process: fork at the line; the child (True) raises there and
    sends its result when its run ends (:data:`~.training.CHILD`); the parent waits for it, appends it to
    ``journal`` (JSON Lines: the line, the result, the seconds it took) and goes on (False)."""

    def spawn(line: tuple[str, int]) -> bool:
        read, write = os.pipe()
        log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by collect
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            _child(log)
            CHILD["write"] = write
            return True
        os.close(write)
        (result,) = collect([(pid, read, log)], timeout)
        entry = {"line": relative(line), "result": result, "seconds": round(time.monotonic() - started, 2)}
        with journal.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        return False

    return spawn
