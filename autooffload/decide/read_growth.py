"""What kept layers added to whole steps' readings, where a step is not read in segments.

The keep model reads what kept layers add to a step's real peak off the step's segments (:mod:`.growth`). A probe
that reads no segments (a model on several devices: nothing is marked) left the plan on the sum of what the kept
layers save, the most they can add eagerly: a kept layer holds at most what it saves, and the last one kept stands
where its recompute would (one layer's bytes of room unused per forward, on the ladder's models).

So the reading of a whole step is used: after a clean step whose forwards alive together kept layers at one
length, planned on the sum ``B`` and predicted to peak at ``plain + B``, the reading showed what they added,
``G = reading - plain``, and ``B - G`` of the sum was not needed. A later plan that keeps, in each of as many
forwards, at least those layers adds at most ``G`` plus what its further layers save: its sum less the same
``B - G``, ``B`` on the layers' costs now at the reading's length (a cost that falls later shrinks it), scaled down
for a group whose most tokens are fewer. Never at more tokens than the reading's: a peak that does not grow with
tokens (the optimizer's step) can hide the kept layers of a small micro-batch, and not of a larger one. A plan that
keeps fewer layers is planned on the sum, as before: what a kept layer adds is not known to shrink with fewer of
them kept. So the plan climbs, one keep count at a time, each on a bound that holds. A reading above a plan that
stood on them (a miss; one planned on the sum is the corrections') drops the key's readings, which the next steps
read again; a second miss at a key drops them for good (one noisy reading does not end it, a wrong bound does).

Not under torch.compile: there a kept layer's count (its frame compiled alone) does not bound what it holds in the
whole compiled step. On the ladder's scenario (e) compiled with inductor, keeping the last two layers of both
forwards and then all four added 10.1 MB where the two further layers count 6.8 MB: the partitioner of a graph with
no checkpoint left saves more; the climb read 1.016 of the budget in a warm-up step.

One key per bucket of lengths and number of forwards alive together, a few plans each. Pure: no torch, no clock, no
I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

PLANS_PER_KEY = 8  # the plans remembered at one key (the newest)
MISSES = 2  # misses at a key before its readings are dropped for good

Key = tuple[int, int]  # (bucket of lengths, forwards alive together)
Bound = Callable[[Sequence[int], int, int], float]  # a plan's sum (its kept counts per forward, tokens, seq), now


class ReadGrowths:
    """Per key, per plan read (each forward's kept count): ``(tokens, seq, growth)``, what its kept layers added."""

    def __init__(self) -> None:
        self.read: dict[Key, dict[tuple[int, ...], tuple[int, int, float]]] = {}
        self.misses: dict[Key, int] = {}

    @property
    def distrusted(self) -> set[Key]:
        return {key for key, n in self.misses.items() if n >= MISSES}

    def tightened(
        self, key: Key, earlier: Sequence[int], expected: int, cumulative: Sequence[float], tokens: int, bound: Bound
    ) -> list[float]:
        """``cumulative[m - 1]``: the sum of a plan in which the forwards after ``earlier`` (their kept counts) each
        keep the last ``m`` layers, ``tokens`` the group's most; less, for each, its :meth:`excess`."""
        read = self._excesses(key, tokens, bound)
        return [c - _most(read, [*earlier, *[m] * expected]) for m, c in enumerate(cumulative, 1)]

    def excess(self, key: Key, keeps: Sequence[int], tokens: int, bound: Bound) -> float:
        """How much of its sum a plan keeping ``keeps`` (per forward; ``tokens``: the group's most) cannot add: the
        most of the readings of plans whose kept layers it holds too, at as many tokens or more (scaled down)."""
        return _most(self._excesses(key, tokens, bound), keeps)

    def _excesses(self, key: Key, tokens: int, bound: Bound) -> list[tuple[tuple[int, ...], float]]:
        return [
            (keeps, max(bound(keeps, read, seq) - growth, 0.0) * tokens / read)
            for keeps, (read, seq, growth) in self.read.get(key, {}).items()
            if 0 < tokens <= read
        ]

    def add(self, key: Key, keeps: Sequence[int], tokens: int, seq: int, growth: float, bound: float) -> None:
        """A clean step at ``key``: its forwards kept ``keeps`` layers, which save ``bound`` and added ``growth``
        (``tokens``: the group's fewest). Of two readings of one plan the one at more tokens stays."""
        if key in self.distrusted or growth >= bound or not any(keeps) or tokens <= 0:
            return
        plans = self.read.setdefault(key, {})
        if tokens >= plans.get(tuple(keeps), (0, 0, 0.0))[0]:
            plans.pop(tuple(keeps), None)
            plans[tuple(keeps)] = (tokens, seq, growth)
        while len(plans) > PLANS_PER_KEY:
            plans.pop(next(iter(plans)))

    def missed(self, key: Key, keeps: Sequence[int], tokens: int, bound: Bound) -> bool:
        """A reading above the plan of ``keeps``: where it stood on this key's readings (its :meth:`excess`), they are
        dropped (for good at the second such miss). Whether it did (else its miss is for the corrections)."""
        if not self.excess(key, keeps, tokens, bound):
            return False
        self.read.pop(key, None)
        self.misses[key] = self.misses.get(key, 0) + 1
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "read": [[*key, list(keeps), *entry] for key, plans in self.read.items() for keeps, entry in plans.items()],
            "misses": [[*key, n] for key, n in self.misses.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A state from :meth:`state_dict`; an entry of another shape (none shipped) is left out: read again."""
        self.read, self.misses = {}, {}
        for entry in state.get("misses", []):
            if len(entry) == 3:
                self.misses[(int(entry[0]), int(entry[1]))] = int(entry[2])
        for entry in state.get("read", []):
            if len(entry) == 6 and isinstance(entry[2], list):
                bucket, forwards, keeps, tokens, seq, growth = entry
                plans = self.read.setdefault((int(bucket), int(forwards)), {})
                plans[tuple(int(k) for k in keeps)] = (int(tokens), int(seq), float(growth))


def _most(read: list[tuple[tuple[int, ...], float]], keeps: Sequence[int]) -> float:
    """The largest excess of a read plan whose kept layers ``keeps`` holds too, in as many forwards."""
    fits = [e for r, e in read if len(r) == len(keeps) and all(k >= n for k, n in zip(keeps, r, strict=True))]
    return max(fits, default=0.0)
