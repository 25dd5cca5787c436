"""Medians, spreads and the verdicts read from rounds. A round runs every mode step by step, interleaved, so what
moves a whole round (the shared machine's other load, its clock) moves every mode alike: the ratio of two modes in
the same round cancels it, where each mode's own spread holds it twice. A mode is faster than another only where it
is in every round."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def spread(values: Sequence[float]) -> float:
    """(slowest - fastest) / median: a ratio closer to 1 than this is not a measured difference."""
    return (max(values) - min(values)) / statistics.median(values)


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """A's round totals over B's, round by round."""
    return [x / y for x, y in zip(a, b, strict=True)]


def faster_in_every_round(a: Sequence[float], b: Sequence[float]) -> bool | None:
    """A below B in every round (the whole range of the ratios under 1); None where there are no rounds."""
    found = ratios(a, b)
    return (max(found) < 1) if found else None


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """A against B round by round: the median ratio, its range, the rounds A was faster in, and whether the ratio is
    on one side of 1 in every round (``beyond`` the rounds' noise)."""
    found = ratios(a, b)
    low, high = min(found), max(found)
    return dict(
        median=statistics.median(found),
        low=low,
        high=high,
        faster_rounds=sum(r < 1 for r in found),
        rounds=len(found),
        beyond=high < 1 or low > 1,
    )


def within_spread(value: float, reference: float, reference_spread: float) -> bool:
    """``value`` no further from ``reference`` than the reference's own spread."""
    return abs(value - reference) <= reference_spread * reference


def negated(value: bool | None) -> bool | None:
    return None if value is None else not value


def shown(value: bool | None) -> str:
    return "not measured" if value is None else ("PASS" if value else "FAIL")


def ratio_range(found: Sequence[float]) -> str:
    """``median [lowest, highest]`` of per-round ratios, or ``-``."""
    if not found:
        return "-"
    return f"{statistics.median(found):.3f} [{min(found):.3f}, {max(found):.3f}]"


def slope(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of ``(x, y)`` points (0 where every x is the same): whether a series grows."""
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0


def per_call(seconds: Sequence[float], unit: str = "ms") -> dict[str, float]:
    """How a per-call cost is reported: the median, the mean, the 90th percentile (the nearest rank below) and the
    slowest of ``seconds``, in ``unit`` (``ms`` or ``us``), keyed ``median_ms``, ``mean_ms``, ``p90_ms``, ``max_ms``."""
    scale = {"ms": 1e3, "us": 1e6}[unit]
    ordered = sorted(seconds)
    found = dict(
        median=statistics.median(ordered),
        mean=statistics.fmean(ordered),
        p90=ordered[int(0.9 * (len(ordered) - 1))],
        max=ordered[-1],
    )
    return {f"{key}_{unit}": scale * value for key, value in found.items()}
