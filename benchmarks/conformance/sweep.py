"""The sweep: the (type, mapping) pairs of the installed transformers (:func:`model_types`), each judged in a forked
process of its own with a timeout (:func:`sweep`)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from .rows import UPSTREAM, check_type
from .tiny import MAPPINGS


def model_types(mappings: list[str]) -> list[tuple[str, str]]:
    """(type, mapping) for every type of the named mappings of the installed transformers (a type in both the
    causal-LM and the image-text mapping runs once, as a causal LM; an encoder-decoder type that also has a
    causal-LM class, its decoder alone, runs in both)."""
    from transformers.models.auto import modeling_auto

    pairs: list[tuple[str, str]] = []
    for mapping in mappings:
        for model_type in getattr(modeling_auto, MAPPINGS[mapping][0], {}):
            if mapping == "image-text" and (model_type, "causal") in pairs:
                continue
            pairs.append((model_type, mapping))
    return pairs


def _child_row(model_type: str, mapping: str, path: Path) -> None:
    """In a forked child: judge one type, write its row to ``path``, and leave without cleanup."""
    try:
        if mapping == "testers":
            from .testers import check_tester

            row = check_tester(model_type)
        else:
            row = check_type(model_type, mapping)
    except BaseException as error:  # anything the sweep itself hits is that type's crash
        row = {"type": model_type, "mapping": mapping, "verdict": "crash", "reason": f"{type(error).__name__}: {error}"}
    path.write_text(json.dumps(row, default=str))
    os._exit(0)


def sweep(pairs: list[tuple[str, str]], timeout: float, jobs: int, scratch: Path) -> Any:
    """Yield one row per (type, mapping), each judged in a process of its own, ``jobs`` at a time: a fork of
    this process (torch and transformers already imported, which saves seconds per type), killed after
    ``timeout`` seconds. A child that dies or hangs is that type's crash; the sweep goes on."""
    import signal

    import torch  # noqa: F401 - imported once here, shared by every fork
    import transformers

    if any(mapping == "testers" for _, mapping in pairs):  # the test tree's common modules, imported once
        from . import testers

        with contextlib.suppress(Exception):  # each row says why not
            testers.prepare(testers.tree_path(testers.TESTERS["tree"]))
            __import__("tests.test_modeling_common")
    if UPSTREAM["run"]:  # transformers' own test, read and compiled once, shared too
        from . import upstream

        with contextlib.suppress(upstream.SdistUnavailable):  # each row says so
            UPSTREAM["sdist"] = str(upstream.sdist_path(transformers.__version__, UPSTREAM["sdist"]))
            upstream.load_check(UPSTREAM["sdist"])

    scratch.mkdir(parents=True, exist_ok=True)
    waiting, running = list(pairs), {}
    while waiting or running:
        while waiting and len(running) < jobs:
            model_type, mapping = waiting.pop(0)
            path = scratch / f"{model_type}.{mapping}.json"
            path.unlink(missing_ok=True)
            pid = os.fork()
            if pid == 0:
                _child_row(model_type, mapping, path)
            running[pid] = (model_type, mapping, path, time.perf_counter())
        time.sleep(0.2)
        for pid, (model_type, mapping, path, start) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            elapsed = time.perf_counter() - start
            if done == 0 and elapsed < timeout:
                continue
            if done == 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            del running[pid]
            if done and path.exists():
                row = json.loads(path.read_text())
            elif done:
                row = {"verdict": "crash", "reason": f"child died ({_status(status)})"}
            else:
                row = {"verdict": "crash", "reason": f"timeout after {timeout:.0f} s"}
            row.update(type=model_type, mapping=mapping, wall_seconds=round(elapsed, 1))
            yield row


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit {os.WEXITSTATUS(status)}"
