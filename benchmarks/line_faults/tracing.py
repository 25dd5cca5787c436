"""The trace function: every line of autooffload's that runs, recorded, or one line made to raise."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = str(ROOT / "autooffload") + os.sep
MOMENT: dict[str, Any] = {}  # where the run is: the step, the micro-batch, evaluating; read when the fault fires


class InjectedLineFault(RuntimeError):
    """What the trace function raises at the line under test."""


# ---- tracing ---------------------------------------------------------------------------------------------------


class Lines:
    """Record every line of autooffload's that runs (``target`` None), or raise at ``target`` once.

    ``fork_at`` (recording): lines at whose first arrival ``spawn(line)`` forks the process; in the child (where it
    returns True) the line raises there and the run goes on, so that the child is the run with that line's fault,
    without running again what came before it; the parent waits for it and goes on without a fault."""

    def __init__(
        self,
        target: tuple[str, int] | None = None,
        fork_at: set[tuple[str, int]] | None = None,
        spawn: Callable[[tuple[str, int]], bool] | None = None,
    ) -> None:
        self.target, self.seen, self.fired, self.where = target, set(), False, None
        self.fork_at, self.spawn = fork_at or set(), spawn
        self._ours: dict[Any, bool] = {}

    def _wanted(self, code: Any) -> bool:
        wanted = self._ours.get(code)
        if wanted is None:
            wanted = code.co_filename.startswith(PACKAGE)
            if wanted and self.target is not None:
                wanted = code.co_filename == self.target[0] and any(
                    line == self.target[1] for _, _, line in code.co_lines()
                )
            self._ours[code] = wanted
        return wanted

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if self.fired or not self._wanted(frame.f_code):
            return None
        return self._line

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event != "line":
            return self._line
        if self.target is None:
            line = (frame.f_code.co_filename, frame.f_lineno)
            if line in self.seen:
                return self._line
            self.seen.add(line)
            main = threading.current_thread() is threading.main_thread()
            if line not in self.fork_at or self.spawn is None or not main or not self.spawn(line):
                return self._line
            self.target = line
        if self.fired or frame.f_lineno != self.target[1]:
            return self._line
        import torch

        backward = torch._C._current_graph_task_id() != -1
        self.fired, self.where = True, {**MOMENT, "backward": backward, "function": frame.f_code.co_qualname}
        raise InjectedLineFault(f"injected at {relative(self.target)}")

    def __enter__(self) -> Lines:
        threading.settrace(self)
        sys.settrace(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]


def relative(line: tuple[str, int]) -> str:
    return f"{os.path.relpath(line[0], ROOT)}:{line[1]}"


def absolute(key: str) -> tuple[str, int]:
    path, line = key.rsplit(":", 1)
    return str(ROOT / path), int(line)
