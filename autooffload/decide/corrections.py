"""The keep model's closed loop: what the readings showed missing, per bucket of tokens, and how wide the margin is.

After every clean step that kept layers, the keep planner (:mod:`autooffload.decide.keep_plan`) compares the
reading with its prediction. A miss charged to forwards that kept adds what the reading showed missing to every
kept forward at that length and at nearby ones (half to twice the tokens), before the next micro-batch (a constant:
what the layers' counts cannot see, an attention mask the kept layers save and the checkpointed ones only
reference, lies outside any one layer); a miss where a correction already applied widens the margin by
``ladder.KEEP_MARGIN`` of the device, whatever ``keep_margin`` is (up to ``MISS_LIMIT`` times). A correction is
eased half way back towards what the readings show after every
clean step that kept at its lengths without a miss, and one that no clean step tests (it forbids keep at its
lengths, so none keeps there) halves every ``CALM_STEPS`` clean steps until keep is tried there again; the margin
narrows again after ``CALM_STEPS`` clean steps without a miss: keep never stays off for good because of one
inflated sample. One correction per bucket of tokens, however many lengths a run meets. Pure: no torch, no clock,
no I/O.
"""

from __future__ import annotations

from typing import Any

from .activations import length_bucket

MISS_LIMIT = 4  # the margin widens at most this many times after repeated under-predictions
CALM_STEPS = 16  # clean steps that kept without a miss before the margin narrows by one
REACH = 2.0  # a correction at t tokens applies from t / REACH to t x REACH tokens
# A correction that no clean step tested for CALM_STEPS is halved; below this many bytes it is dropped.
CORRECTION_FLOOR = 4096.0


class Corrections:
    """``by_tokens``: tokens -> bytes a kept forward adds beyond the layers' counts; ``misses``: under-predictions not
    yet calmed, each widening the margin (:meth:`~autooffload.decide.keep_plan.KeepPlanner.count`)."""

    def __init__(self) -> None:
        self.by_tokens: dict[int, float] = {}
        self.untested: dict[int, int] = {}  # tokens of a correction -> clean steps since one tested it
        self.misses = 0
        self.calm = 0

    def extra(self, tokens: int) -> float:
        """The bytes per kept forward the readings showed missing at this length or a nearby one (0: none)."""
        return max((extra for t, extra in self.by_tokens.items() if reaches(t, tokens)), default=0.0)

    def reaching(self, tokens: int) -> list[int]:
        return [t for t in self.by_tokens if reaches(t, tokens)]

    def missed(self, tokens: int, missing: float) -> None:
        """A reading above the prediction by ``missing`` per kept forward at ``tokens``: the correction there rises
        by it, and where one already applied, the margin widens."""
        used = self.extra(tokens)
        if used > 0:
            self.misses = min(self.misses + 1, MISS_LIMIT)
        self.correct(tokens, used + missing)
        self.calm = 0

    def clean(self, needed: dict[int, float]) -> None:
        """A clean step without a miss; ``needed``: per correction it tested, the most a kept forward needed."""
        self.calm += 1
        if self.misses and self.calm >= CALM_STEPS:
            self.misses, self.calm = self.misses - 1, 0
        for t, need in needed.items():
            eased = (self.by_tokens[t] + min(need, self.by_tokens[t])) / 2
            if eased < 1.0:
                self.drop(t)
            else:
                self.by_tokens[t] = eased

    def correct(self, tokens: int, shown: float) -> int:
        """Raise the correction at ``tokens`` (or the one in its bucket) to at least ``shown``; returns its key."""
        bucket = length_bucket(tokens)
        key = next((t for t in self.by_tokens if length_bucket(t) == bucket), tokens)
        self.by_tokens[key] = max(self.by_tokens.get(key, 0.0), shown)
        self.untested[key] = 0
        return key

    def age(self, tested: set[int]) -> None:
        """A clean step ended: a correction it did not test halves every ``CALM_STEPS`` such steps, so that one
        which forbids keep at its lengths (and so is never tested there) does not forbid it for good."""
        for t in list(self.by_tokens):
            if t in tested:
                self.untested[t] = 0
                continue
            self.untested[t] = self.untested.get(t, 0) + 1
            if self.untested[t] >= CALM_STEPS:
                self.untested[t] = 0
                self.by_tokens[t] /= 2
                if self.by_tokens[t] < CORRECTION_FLOOR:
                    self.drop(t)

    def drop(self, tokens: int) -> None:
        del self.by_tokens[tokens]
        self.untested.pop(tokens, None)

    def state_dict(self) -> dict[str, Any]:
        return {
            "corrections": [[t, f, self.untested.get(t, 0)] for t, f in self.by_tokens.items()],
            "misses": self.misses,
            "calm": self.calm,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Also a state saved with a correction per length: one per bucket stays."""
        self.by_tokens, self.untested = {}, {}
        for t, f, *untested in state.get("corrections", []):
            self.untested[self.correct(int(t), float(f))] = int(untested[0]) if untested else 0
        self.misses = int(state.get("misses", 0))
        self.calm = int(state.get("calm", 0))


def reaches(correction_tokens: int, tokens: int) -> bool:
    """A correction at ``correction_tokens`` applies to ``tokens`` (from half to twice them: ``REACH``)."""
    return correction_tokens / REACH <= tokens <= correction_tokens * REACH
