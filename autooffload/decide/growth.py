"""What keeping layers adds to a step's real peak: the step read in segments, once per length.

A kept layer holds what it saves from its forward until the backward reaches it, but a step's peak is one moment,
and a kept layer's bytes count there only if they are still alive then. Measured on torch's CPU allocator (the
ladder's 4-layer Qwen3 at 256 tokens): with every layer recomputing the step peaks in the backward of its first
layer (every gradient gathered, that layer's recompute and its backward's buffers), 3.1 MB above the forward's end;
keeping the last layer adds nothing to the step's peak, though it saves 3.0 MB: while the backward runs that
layer, its activations stand where its recompute's would, and by the first layer's backward they are freed. Each
further kept layer adds what it saves (it is alive at the forward's end). With two forwards before one backward,
the backward runs the later forward's layers first, the earlier forward's kept layers alive throughout: keeping
one layer in each adds one layer's bytes, not two. On the hybrid Jamba stack the Mamba layers' backward (the
reference kernels) holds 16 MB of buffers, so that an attention layer and a Mamba layer kept (14 MB) add nothing.
The sum of what kept layers save is the most they can add, and it is what the keep model planned from.

So the keep model's measuring micro-batch also marks the step (:mod:`autooffload.apply.keep`): where each forward
begins, where the backward reaches each of its layers, and where it leaves the first one; the probe reports the
most the allocator held in each segment between two marks. In a segment, forward ``f``'s kept layers below
``alive[f]`` are alive (all of them from its forward's start, those below ``j`` once the backward reached layer
``j``, none once it left the first layer or before its forward began). A :class:`Profile` holds, per segment, its
alive layers and its headroom: how far the segment peaked below the group's peak with every layer recomputing
(what the measured step's own kept layers held there taken out). What a plan's kept layers add to the group's
peak is then

    growth = max(0, max over segments of (the plan's kept bytes alive in it - its headroom))

exact where the segments' contents do not change with the plan, and each kept layer's bytes are its own
(``kept[f][i]``: what layer ``i`` kept by forward ``f`` holds, its corrections included). A segment's headroom
shrinks in proportion for a micro-batch with fewer tokens than the profile's. Pure: no torch, no clock, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

FORWARD, LAYER, BELOW = "forward", "layer", "below"  # the marks' kinds (autooffload.apply.keep makes them)


@dataclasses.dataclass(frozen=True)
class Profile:
    """One group of forwards alive together, read at one length with every layer recomputing: per segment, its
    ``headroom`` below the group's peak and, per forward of the group, ``alive``: its kept layers below this index
    hold their bytes there. ``tokens``: the group's micro-batch tokens when it was read."""

    tokens: int
    headroom: tuple[float, ...]
    alive: tuple[tuple[int, ...], ...]

    @property
    def forwards(self) -> int:
        return len(self.alive[0]) if self.alive else 0

    def growth(self, kept: Sequence[Sequence[float]], tokens: int) -> float:
        """What keeping adds to the group's peak: ``kept[f][i]``, the bytes layer ``i`` holds kept by forward ``f``
        (0 where it recomputes; the kept layers are each forward's last ones); ``tokens``: the micro-batch's."""
        prefixes = [_prefix(layers) for layers in kept]
        scale = min(1.0, tokens / self.tokens) if self.tokens > 0 else 1.0
        most = 0.0
        for headroom, alive in zip(self.headroom, self.alive, strict=True):
            held = sum(prefix[min(index, len(prefix) - 1)] for prefix, index in zip(prefixes, alive, strict=True))
            most = max(most, held - headroom * scale)
        return most

    def growths(
        self, earlier: Sequence[Sequence[float]], costs: Sequence[float], most: int, extra: float, tokens: int
    ) -> list[float]:
        """:meth:`growth` of the plans in which the forwards after ``earlier`` (their kept bytes per layer, as there)
        each keep the last ``m`` layers, for ``m`` from 1 to ``most``: ``costs[i]``, what layer ``i`` holds kept;
        ``extra``, a forward's correction. One pass over the segments per ``m``: O(layers x segments) a decision."""
        prefix, earlier_prefixes = _prefix(costs), [_prefix(layers) for layers in earlier]
        held = [
            sum(p[min(a, len(p) - 1)] for p, a in zip(earlier_prefixes, alive, strict=False)) for alive in self.alive
        ]
        scale = min(1.0, tokens / self.tokens) if self.tokens > 0 else 1.0
        results = []
        for keep in range(1, most + 1):
            first, best = len(costs) - keep, 0.0
            for base, headroom, alive in zip(held, self.headroom, self.alive, strict=True):
                own = sum(prefix[a] - prefix[first] + extra for a in alive[len(earlier) :] if a > first)
                best = max(best, base + own - headroom * scale)
            results.append(best)
        return results

    def state(self) -> list[Any]:
        return [self.tokens, list(self.headroom), [list(row) for row in self.alive]]

    @classmethod
    def from_state(cls, state: Sequence[Any]) -> Profile:
        tokens, headroom, alive = state
        return cls(int(tokens), tuple(float(h) for h in headroom), tuple(tuple(int(i) for i in row) for row in alive))


def _prefix(layers: Sequence[float]) -> list[float]:
    """``prefix[a]``: the bytes of the layers below index ``a``."""
    sums = [0.0]
    for value in layers:
        sums.append(sums[-1] + value)
    return sums


def read_profile(
    segments: Sequence[tuple[Any, float]],
    keys: Sequence[object],
    layers: int,
    kept: Sequence[Sequence[float]],
    tokens: int,
) -> Profile | None:
    """The profile at ``tokens`` of the group whose forwards carry ``keys`` (in forward order) in their marks, from
    a step's ``segments``: ``(label, peak)`` in time order, ``label`` the mark that opened it (None before the first),
    ``peak`` the most the allocator held in it (on any common base). ``kept[f][i]``: what layer ``i`` of forward
    ``f`` kept in that step (0 where it recomputed), taken out of the segments it is alive in. None where a forward
    of the group made no mark (its segments would hide in the others') or the group has no segment.

    The group's segments run from its first mark until every forward left its first layer; the segments after
    that (the rest of the step: the optimizer's, another group's) keep nothing alive and are left out. Where no
    mark says a forward left its first layer (its input needs no gradient), the group's last segment is left out
    too: it may hold the optimizer's step. Leaving segments out can only shrink headrooms."""
    if not keys or layers <= 0:
        return None
    alive, started, done = [0] * len(keys), [False] * len(keys), [False] * len(keys)
    rows: list[tuple[float, tuple[int, ...]]] = []
    inside = False
    for label, peak in segments:
        forward = _forward_of(label, keys)
        if forward is None:
            if inside and label is not None:
                break  # another group's mark: this group's backward is over
        else:
            inside = True
            kind = label[0]
            if kind == FORWARD:
                alive[forward], started[forward] = layers, True
            elif kind == LAYER and len(label) > 2 and isinstance(label[2], int):
                alive[forward] = max(0, min(alive[forward], label[2]))
            elif kind == BELOW:
                alive[forward], done[forward] = 0, True
        if not inside:
            continue
        if all(done):
            break
        rows.append((float(peak), tuple(alive)))
    if not all(started):
        return None
    if not all(done) and rows:
        rows.pop()
    if not rows:
        return None
    prefixes = [_prefix(layer_bytes) for layer_bytes in kept]
    plain = [peak - sum(p[min(i, len(p) - 1)] for p, i in zip(prefixes, row, strict=True)) for peak, row in rows]
    top = max(plain)
    return Profile(tokens, tuple(top - value for value in plain), tuple(row for _, row in rows))


def _forward_of(label: Any, keys: Sequence[object]) -> int | None:
    if not isinstance(label, tuple) or len(label) < 2:
        return None
    return next((f for f, key in enumerate(keys) if label[1] is key), None)


TRIES = 2  # marked steps at a key that gave no profile (segments not counted, a forward unmarked) before it rests


class Profiles:
    """The profiles read so far: one per bucket of sequence lengths and number of forwards alive together. One that a
    reading proved short (a step that kept peaked above what it said) is dropped and not read again at its key:
    the sum of what the kept layers save plans there, as before any profile. A key whose marked steps gave no
    profile ``TRIES`` times is not marked again (each marked micro-batch counts its layers, which costs time)."""

    def __init__(self) -> None:
        self.read: dict[tuple[int, int], Profile] = {}
        self.distrusted: set[tuple[int, int]] = set()
        self.tries: dict[tuple[int, int], int] = {}

    def get(self, key: tuple[int, int]) -> Profile | None:
        return self.read.get(key)

    def wants(self, key: tuple[int, int]) -> bool:
        return key not in self.read and key not in self.distrusted and self.tries.get(key, 0) < TRIES

    def tried(self, key: tuple[int, int]) -> None:
        self.tries[key] = self.tries.get(key, 0) + 1

    def add(self, key: tuple[int, int], profile: Profile) -> None:
        if key not in self.distrusted:
            self.read[key] = profile

    def distrust(self, key: tuple[int, int]) -> bool:
        """A reading above a plan at this key: its profile, if one was read, is dropped for good. Whether one was."""
        if self.read.pop(key, None) is None:
            return False
        self.distrusted.add(key)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "read": [[bucket, forwards, profile.state()] for (bucket, forwards), profile in self.read.items()],
            "distrusted": [list(key) for key in self.distrusted],
            "tries": [[*key, n] for key, n in self.tries.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.read = {(int(b), int(f)): Profile.from_state(p) for b, f, p in state.get("read", [])}
        self.distrusted = {(int(b), int(f)) for b, f in state.get("distrusted", [])}
        self.tries = {(int(b), int(f)): int(n) for b, f, n in state.get("tries", [])}
