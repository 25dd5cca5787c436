"""What kept layers added to whole steps' readings, where a step cannot be read in segments.

The keep model reads what kept layers add to a step's real peak off the step's segments (:mod:`.growth`). Two
kinds of step have none: a compiled one (its marks would break the graph, and the measuring micro-batch runs its
layers outside it, so that step is not the one that is timed) and one whose probe reads no segments. There the
plan stood on the sum of what the kept layers save, the most they can add: on the ladder's scenarios (e) and (f)
under torch.compile, the reading of a step that kept half the layers of two forwards, or a quarter of a hybrid
Jamba stack, was far below that sum.

So the reading of a whole step is used: after a clean step whose forwards alive together kept layers at one
length, planned on the sum ``B`` and predicted to peak at ``plain + B``, the reading showed what they added,
``G = reading - plain``, and ``B - G`` of the sum was not needed. A later plan that keeps, in each of as many
forwards, at least those layers adds at most ``G`` plus what its further layers save: its sum less the same
``B - G`` (scaled down for a micro-batch with fewer tokens). A plan that keeps fewer layers is planned on the sum,
as before: what a kept layer adds is not known to shrink with fewer of them kept. So the plan climbs, one allowed
keep count at a time, each step on a bound that holds, and never above what the saved bytes allow beyond a
reading. A reading above a plan made this way (a miss) drops the key's readings for good, as a profile's.

One key per bucket of lengths and number of forwards alive together, a few plans each. Pure: no torch, no clock,
no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PLANS_PER_KEY = 8  # the plans remembered at one key (the newest); under compile the keep counts allowed are few

Key = tuple[int, int]  # (bucket of lengths, forwards alive together)


class ReadGrowths:
    """Per key, per plan (each forward's kept count), the sum's excess the reading showed: ``(tokens, excess)``."""

    def __init__(self) -> None:
        self.read: dict[Key, dict[tuple[int, ...], tuple[int, float]]] = {}
        self.distrusted: set[Key] = set()

    def excess(self, key: Key, keeps: Sequence[int], tokens: int) -> float:
        """How much of its sum a plan keeping ``keeps`` (per forward) at ``tokens`` cannot add: the most of the
        readings of plans whose kept layers it holds too, each scaled down for fewer tokens than it was read at."""
        most = 0.0
        for read_keeps, (read_tokens, excess) in self.read.get(key, {}).items():
            if len(read_keeps) == len(keeps) and all(k >= r for k, r in zip(keeps, read_keeps, strict=True)):
                most = max(most, excess * min(1.0, tokens / read_tokens if read_tokens > 0 else 1.0))
        return most

    def tightened(
        self, key: Key, earlier: Sequence[int], expected: int, cumulative: Sequence[float], tokens: int
    ) -> list[float]:
        """``cumulative[m - 1]``: the sum of a plan in which the forwards after ``earlier`` (their kept counts) each
        keep the last ``m`` layers; less, for each, its :meth:`excess`."""
        keeps = list(earlier)
        return [c - self.excess(key, [*keeps, *[m] * expected], tokens) for m, c in enumerate(cumulative, 1)]

    def add(self, key: Key, keeps: Sequence[int], tokens: int, excess: float) -> None:
        if key in self.distrusted or excess <= 0 or not any(keeps):
            return
        plans = self.read.setdefault(key, {})
        plans.pop(tuple(keeps), None)
        plans[tuple(keeps)] = (tokens, excess)
        while len(plans) > PLANS_PER_KEY:
            plans.pop(next(iter(plans)))

    def distrust(self, key: Key) -> bool:
        """A reading above a plan that stood on this key's readings: they are not used again. Whether any were."""
        if self.read.pop(key, None) is None:
            return False
        self.distrusted.add(key)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "read": [
                [*key, list(keeps), tokens, excess]
                for key, p in self.read.items()
                for keeps, (tokens, excess) in p.items()
            ],
            "distrusted": [list(key) for key in self.distrusted],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.read, self.distrusted = {}, {(int(b), int(f)) for b, f in state.get("distrusted", [])}
        for bucket, forwards, keeps, tokens, excess in state.get("read", []):
            self.read.setdefault((int(bucket), int(forwards)), {})[tuple(int(k) for k in keeps)] = (
                int(tokens),
                float(excess),
            )
