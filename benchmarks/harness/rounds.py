"""The timing loop. Modes run on one model in one process, interleaved step by step with the order rotating, so that
a machine whose load drifts moves every mode alike; a round is one pass over a trace of lengths, every mode once per
length. A step's time is CUDA events on a GPU and the process's CPU time on a CPU (a shared machine's other load
moves it far less than the wall clock); Python's full collections run between steps, not in them."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch

M = TypeVar("M")


def rotated(modes: Sequence[M], offset: int) -> list[M]:
    """Every mode once, starting at ``offset`` (mod their number)."""
    return [modes[(offset + j) % len(modes)] for j in range(len(modes))]


def interleaved(rounds: int | range, lengths: Sequence[int], modes: Sequence[M]) -> Iterator[tuple[int, int, int, M]]:
    """``(round, index, length, mode)`` for each step of ``rounds`` rounds of the trace ``lengths``, modes interleaved
    step by step, the order rotating by one per round and per step."""
    for round_ in range(rounds) if isinstance(rounds, int) else rounds:
        for i, seq in enumerate(lengths):
            for mode in rotated(modes, round_ + i):
                yield round_, i, seq, mode


@contextlib.contextmanager
def whole_heap_collections_outside() -> Iterator[None]:
    """A timed step with Python's young collections as in any run, and the whole heap collected before it instead
    of inside it. A full collection walks every object the process holds (all the modes' models, dynamo's caches):
    0.24-0.37 s with four modes here, more with every mode's graphs. It lands in whichever mode's step crosses the
    threshold: on the Jamba scenario one step in a few rounds ran 2x, from plain's, every other layer's or
    autooffload's step alike (the reason ``timeit`` turns the collector off while it times). Python 3.11-3.13 only
    start a full collection past the third threshold; an incremental collector may not."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(*thresholds[:2], 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


@contextlib.contextmanager
def warm_heap_frozen() -> Iterator[None]:
    """What the warm-ups built stays: each step's collection before it walks only what came since."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class StepClock:
    """One step's clock: on a GPU, CUDA events and ``max_memory_allocated`` over the step (``peak``); on the CPU, the
    process's CPU time (``seconds``) and the wall clock (``wall``)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.seconds = self.wall = 0.0
        self.peak: int | None = None

    def __enter__(self) -> StepClock:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._events[0].record()
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            self._events[1].record()
            torch.cuda.synchronize()
            self.seconds = self._events[0].elapsed_time(self._events[1]) / 1e3
            self.peak = int(torch.cuda.max_memory_allocated())
        else:
            self.seconds = time.process_time() - self._cpu
        self.wall = time.perf_counter() - self._wall


class OverBudget(Exception):
    """A part that would end past the run's time budget: skipped, and said in the results."""


class Clock:
    """A run's time budget: a part whose estimate would take it past the budget raises :class:`OverBudget`."""

    def __init__(self, budget_s: float) -> None:
        self.began = time.monotonic()
        self.budget_s = budget_s

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def check(self, what: str, estimate_s: float) -> None:
        if self.elapsed + estimate_s > self.budget_s:
            raise OverBudget(
                f"{what} skipped: about {estimate_s:.0f} s more would pass the {self.budget_s:.0f} s budget "
                f"({self.elapsed:.0f} s spent)"
            )
