"""Observe: the most memory torch's CPU allocator held over a window, the backward's transient buffers included.

What a device must hold at a step's fullest is not what the forward saved: the backward allocates the
gradients, the recomputed layer's activations, each operation's gradient buffers and, inside kernels, their
workspaces, and frees them as it goes. A count of saved tensors misses all of it (on the ladder's models the
real peak is 1.3-2x the saved bytes). :class:`AllocationPeak` reads it from the allocator itself: torch reports
every allocation and free of its CPU allocator to the profiler when the profiler records memory, so the running
sum of those reports over a window, at its highest, is the window's peak above what was held when it began.
That is exactly what ``torch.profiler.profile(profile_memory=True)`` shows (tests/test_simulated.py holds the
two to each other); here the profiler's C++ events are read directly, without building its Python event
tree (a few milliseconds a step instead of tens). torch's allocator prints one line per process the first time a
block allocated before a window is freed inside one ("Memory block of unknown size ..."): a C++ log line this
module cannot silence without silencing all of torch's (docs/troubleshooting.md says how).

Costs and limits: while a window is open the profiler records every operation (measured: 15-20% slower on the
ladder's 4-layer model on a CPU); a profiler already running in the thread (yours) cannot share it, so
:meth:`AllocationPeak.start` then returns False and nothing is counted; only the thread that opened a window
is counted (the CPU's backward runs in the caller's thread); a block allocated before any window and freed
inside one lowers nothing (its size is unknown to the report), so the peak errs high by such blocks, while one
allocated inside an earlier window and freed inside this one lowers it (the report knows it): collect garbage
before opening a window (:class:`~autooffload.observe.simulated.SimulatedDevice` does).

Marks split a window into segments (:meth:`AllocationPeak.mark`): each is a record-function event in the same
stream as the allocations, so the most held between two marks is known to the event, for the keep model's reading
of where a step peaks (:mod:`autooffload.decide.growth`).
"""

from __future__ import annotations

import heapq
from typing import Any

import torch


def _config() -> Any:
    from torch._C._profiler import _ExperimentalConfig
    from torch.autograd import ProfilerConfig, ProfilerState

    # CPU state, memory on; no shapes, stacks, flops or module names: the least the profiler can record.
    return ProfilerConfig(ProfilerState.CPU, False, True, False, False, False, _ExperimentalConfig())


def available() -> bool:
    """Whether this torch has the profiler entry points the count needs."""
    autograd = torch.autograd
    return hasattr(autograd, "_enable_profiler_legacy") and hasattr(autograd, "_disable_profiler_legacy")


MARK = "autooffload::mark"


def _counted(event: Any, marked: bool) -> bool:
    kind = event.kind()
    return kind == "memory_alloc" or (marked and kind == "push" and event.name() == MARK)


class AllocationPeak:
    """Opens and closes windows over which the CPU allocator's peak is counted (module docs).

    ``start()`` opens one (False where it cannot: a profiler already runs, or this torch lacks the entry
    points); ``stop()`` closes it and returns the most bytes held above the start at any moment in it, and
    ``last_end``: what was still held above the start at its end (both None when no window was open).
    ``mark(label)`` inside a window starts a segment; ``segments``, after ``stop()``: per segment in time order,
    ``(label, most bytes held above the window's start in it)``, the first labelled None (None: no mark).
    """

    def __init__(self) -> None:
        self.active = False
        self.last_end: int | None = None
        self.segments: list[tuple[Any, int]] | None = None
        self._labels: list[Any] = []

    @torch.compiler.disable
    def mark(self, label: Any) -> None:
        if not self.active:
            return
        self._labels.append(label)
        handle = torch.ops.profiler._record_function_enter_new(MARK, None)
        torch.ops.profiler._record_function_exit._RecordFunction(handle)

    def start(self) -> bool:
        if self.active:
            return True
        if not available() or torch.autograd._profiler_enabled():
            return False
        try:
            torch.autograd._enable_profiler_legacy(_config())
        except RuntimeError:  # "Profiler is already enabled on this thread": someone else's
            return False
        try:  # where this fails, the profiler is not left running under a window that thinks itself closed
            self._labels, self.segments = [], None
            self.active = True
        except BaseException:
            torch.autograd._disable_profiler_legacy()
            raise
        return True

    def stop(self) -> int | None:
        if not self.active:
            return None
        self.active = False
        events = torch.autograd._disable_profiler_legacy()
        return self._peak(events)

    def _peak(self, threads: list[list[Any]]) -> int:
        marked = bool(self._labels)
        events = [[e for e in thread if _counted(e, marked)] for thread in threads]
        held = peak = 0
        labels, segments = iter(self._labels), [[None, 0]]
        for event in heapq.merge(*events, key=lambda e: e.start_us()):
            if event.kind() == "push":
                segments.append([next(labels, None), held])
                continue
            held += event.cpu_memory_usage()
            peak = max(peak, held)
            segments[-1][1] = max(segments[-1][1], held)
        self.last_end = held
        self.segments = [(label, most) for label, most in segments] if marked else None
        self._labels = []
        return peak

    def close(self) -> None:
        """Close a window left open (the watched model is let go of), discarding its count."""
        if self.active:
            self.stop()
