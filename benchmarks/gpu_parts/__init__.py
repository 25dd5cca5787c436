"""The GPU check's parts (benchmarks/gpu_check.py runs each in a process of its own and says what each measures):
``speed`` (the mixed trace, the seed's setup, the engines, the ladder) and ``memory`` (the predictive memory model,
pinning, the probe, the distributed smoke test). A part is ``part_<name>(device, quick, budget_s) -> dict``."""

from __future__ import annotations

FREED_TOLERANCE = 0.005
UNDER_PREDICTION_TOLERANCE = 0.02
OVER_PREDICTION_LIMIT = 0.25
IN_SPAN_TOLERANCE = 0.05  # a length within those sampled: the replay of the first H200 run is within 1%


def emit(line: str) -> None:
    print(f"gpu_check: {line}", flush=True)


def gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f} GiB"
