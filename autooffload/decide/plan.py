"""Decide: what one micro-batch's plan is made from, and what it is.

The planner (:mod:`~autooffload.decide.planner`) takes plain values: the micro-batch (:class:`Batch`), its layers'
sizes (:class:`Sizes`) and the last reading (:class:`LastReading`), each a small protocol the observing side's
dataclasses meet, and returns a :class:`Plan`. The functions here are the pieces of a plan that need no state: why
a level was fixed or chosen, what the policy predicts, and how many layers the host budget holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol

Agree = Callable[[int, int, int, int], tuple[int, int]]  # (level, host cap, keep, layers) -> the group's (level, keep)


class Batch(Protocol):
    """The micro-batch (:class:`~autooffload.observe.inputs.MicroBatch`): its longest length and its tokens."""

    @property
    def seq_len(self) -> int: ...
    @property
    def tokens(self) -> int: ...


class Sizes(Protocol):
    """Its layers' saved inputs (:class:`~autooffload.observe.sizes.Sized`), in offload order."""

    @property
    def layer_bytes(self) -> tuple[int, ...] | None: ...
    @property
    def bytes_per_layer(self) -> int | None: ...
    @property
    def token_bytes(self) -> float | None: ...


class LastReading(Protocol):
    """The last step's reading (:class:`~autooffload.observe.memory.Reading`)."""

    @property
    def fraction(self) -> float | None: ...
    @property
    def bytes(self) -> int | None: ...
    @property
    def total(self) -> int | None: ...
    @property
    def rescued(self) -> bool: ...
    @property
    def clean(self) -> bool: ...
    @property
    def pending_bytes(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Plan:
    """One micro-batch's plan: the first ``level`` layers of the offload order offload, the last ``keep`` keep,
    the rest recompute; ``measure``: count what the layers that do not offload keep (the keep planner asks).
    ``reason``: why the level (:data:`autooffload.history.REASONS`); ``switched``: the level differs from the one
    installed, past the run's first micro-batch; ``asked``: the level before this rank's host cap ``cap`` lowered
    it (None: not capped); ``predicted``: the policy's predicted peak with nothing offloaded (None: it has none)."""

    level: int
    keep: int = 0
    measure: bool = False
    reason: str | None = None
    switched: bool = False
    asked: int | None = None
    cap: int | None = None
    predicted: float | None = None


def fixed_reason(latched: bool, rescuing: bool, mode: str) -> str:
    """The reason for a level the settings or the run's state fix, in order of precedence."""
    if rescuing:
        return "rescue"
    if latched:
        return "compile_latch"
    return "mode_on" if mode == "on" else "mode_off"


def policy_reason(policy: Any) -> str:
    """The policy's ``last_reason`` where it gives one (optional for a user's policy), else ``"policy"``."""
    reason = getattr(policy, "last_reason", None)
    return reason if isinstance(reason, str) and reason else "policy"


def predicted_peak(policy: Any, tokens: int, per_layer: int | None) -> float | None:
    """The policy's predicted peak bytes for ``tokens`` with nothing offloaded, ``per_layer`` bytes of saved input
    each; None where it has no ``predict``, cannot predict yet, or its ``predict`` fails (a user's policy may have
    another signature)."""
    predict = getattr(policy, "predict", None)
    if not callable(predict) or tokens <= 0:
        return None
    try:
        value = predict(tokens, per_layer)
    except Exception:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def host_cap(
    budget: int | None,
    layers: int,
    layer_bytes: tuple[int, ...] | None,
    per_token: float | None,
    tokens: int,
    page: int,
) -> int | None:
    """The most layers whose saved inputs fit a host budget of ``budget`` bytes, each buffer rounded up to whole
    pages; None where the budget or the sizes are not known yet."""
    if budget is None or not per_token or tokens <= 0:
        return None
    if layer_bytes is None:
        return min(layers, budget // _pages(round(per_token * tokens), page))
    cap, held = 0, 0
    for nbytes in layer_bytes:
        held += _pages(nbytes, page)
        if held > budget:
            break
        cap += 1
    return cap


def _pages(nbytes: int, page: int) -> int:
    return -(-max(nbytes, 1) // page) * page
