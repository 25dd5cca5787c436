"""Decide the ladder: per micro-batch, which checkpointed layers keep, recompute or offload.

Three rungs per checkpointed layer, from fastest to leanest:

- **keep**: run without checkpointing; its activations stay until the backward, nothing is recomputed;
- **recompute**: plain checkpointing; only its input stays, the forward runs again in the backward;
- **offload**: checkpointing with its input in host memory.

The plan (offload ``k``, keep ``m``) puts the first ``k`` layers on offload (their inputs live longest), the
last ``m`` on keep (their activations are the first the backward frees, and the last layer's recompute is
what the backward starts with) and the rest on recompute. It starts from the predicted peak with every layer
recomputing: over the limit, offload the fewest layers that bring it under, and keep none; under it, keep as
many layers as fit below the limit less a margin, offload none (what keeping the last ``m`` layers adds
is given per ``m``: layers differ, and every forward alive before the backward keeps its own). Keeping
trades the most memory for the least time (one layer's activations against one layer's forward), so it is
only worth it where nothing must be offloaded. Without a prediction (no memory reading yet, no GPU) nothing
is kept. Pure: no torch, no clock, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

# What keep leaves free below memory_high by default (the keep_margin setting), as a share of the device: room for
# what the prediction misses (fragmentation, a kept layer's transient buffers). Each miss not yet calmed widens the
# margin by this much, whatever keep_margin is: a narrow margin set by hand still widens where readings miss.
KEEP_MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class Rungs:
    """A plan for one micro-batch: the first ``offload`` layers offload, the last ``keep`` layers keep."""

    offload: int
    keep: int


def plan(
    predicted: float | None,
    kept_bytes: float | Sequence[float] | None,
    offloaded_bytes: float | None,
    layers: int,
    limit: float | None,
    margin: float = 0.0,
    keep_levels: tuple[int, ...] | None = None,
) -> Rungs:
    """The plan for a micro-batch.

    ``predicted``: the step's peak in bytes with every checkpointed layer recomputing; ``kept_bytes``: what
    keeping one layer adds, or per ``m`` what keeping the last ``m`` adds (``kept_bytes[m - 1]``);
    ``offloaded_bytes``: what offloading one layer frees; ``limit``: memory_high x device memory;
    ``margin``: bytes keep must leave free below ``limit``; ``keep_levels``: the only numbers of kept layers
    allowed (torch.compile), rounded down to. Offload stops at ``layers - 1``: the last layer's input comes
    straight back for its recompute, so moving it does not lower the peak.
    """
    if predicted is None or limit is None or layers <= 0:
        return Rungs(0, 0)
    excess = predicted - limit
    if excess > 0:
        most = max(layers - 1, 0)
        offload = min(math.ceil(excess / offloaded_bytes), most) if offloaded_bytes else most
        return Rungs(offload, 0)
    return Rungs(0, keep(predicted, kept_bytes, layers, limit, margin, keep_levels))


def keep(
    predicted: float,
    kept_bytes: float | Sequence[float] | None,
    layers: int,
    limit: float,
    margin: float = 0.0,
    keep_levels: tuple[int, ...] | None = None,
) -> int:
    """How many layers may keep: the most whose added bytes fit under ``limit - margin``. ``kept_bytes``: one
    layer's bytes (every layer alike), or the bytes of keeping the last 1, 2, ... layers."""
    room = limit - margin - predicted
    if room <= 0 or kept_bytes is None:
        return 0
    if isinstance(kept_bytes, Sequence):  # not always growing with m (read off a step): each allowed m that fits
        fits = [m for m, added in enumerate(kept_bytes[:layers], 1) if added <= room]
        return max((m for m in fits if not keep_levels or m in keep_levels), default=0)
    count = layers if kept_bytes <= 0 else min(int(room // kept_bytes), layers)
    if keep_levels:
        count = max((level for level in keep_levels if level <= count), default=0)
    return max(count, 0)


def keep_levels(layers: int, max_switches: int) -> tuple[int, ...]:
    """The numbers of kept layers allowed under torch.compile: 0, a few spread evenly, and all of them.

    Each distinct plan compiles once (later uses hit dynamo's cache); ``max_switches - 1`` values besides 0
    keep the distinct keep plans within the recompilation budget the offload levels live under too.
    """
    if layers <= 0:
        return (0,)
    count = max(1, max_switches - 1)
    return tuple(sorted({0, *(layers * i // count for i in range(1, count + 1))}))
