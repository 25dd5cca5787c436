"""Decide: how many checkpointed layers offload their saved input for the next micro-batch.

A policy is pure: an :class:`Observation` in, a number of layers out. No torch, no clock, no I/O, so it can
be driven with plain numbers in a test or a simulation, and a user can bring their own: any object with
``decide(observation) -> int`` and, to survive a checkpoint, ``state_dict()`` / ``load_state_dict()``.
Under torch.distributed the ranks run the largest level any of them decided (distributed.py); a policy that
keeps state can follow the group with ``agreed(observation, level)``, called when that level is not its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class Observation:
    """What is known before a micro-batch's forward.

    ``step``: index of the optimizer step this micro-batch belongs to (0-based, continues across resumes).
    ``seq_len``: the micro-batch's sequence length; ``tokens``: batch x sequence.
    ``memory_fraction``: the peak of the last finished optimizer step as a fraction of device memory, or
    ``None`` when there is no reading (no GPU, no NVML, no step finished yet).
    ``layers``: how many layers are checkpointed, the most that can be offloaded.

    The rest is optional, for policies that plan in bytes (``None``: not known). ``memory_bytes`` and
    ``total_bytes``: the same reading as ``memory_fraction``, in bytes. ``bytes_per_layer``: what one
    checkpointed layer's saved input takes for this micro-batch, so what offloading one layer frees.
    ``levels``: the only numbers of layers allowed (torch.compile: each distinct level can cost a
    recompilation); ``None`` allows any from 0 to ``layers``. ``last_step_rescued``: the last step ran out of
    memory and was rerun (:mod:`autooffload.rescue`), so its reading is where the device ran out, a lower
    bound of what the step needed.
    """

    step: int
    seq_len: int
    tokens: int
    memory_fraction: float | None
    layers: int
    memory_bytes: int | None = None
    total_bytes: int | None = None
    bytes_per_layer: int | None = None
    levels: tuple[int, ...] | None = None
    last_step_rescued: bool = False


class Policy(Protocol):
    def decide(self, observation: Observation) -> int: ...


class HysteresisPolicy:
    """All-or-nothing offload with two thresholds per signal and a dwell.

    On when memory >= ``memory_high`` or the sequence length >= ``seq_high``. Off only when memory <
    ``memory_low`` (or unknown), the sequence length < ``seq_low``, and at least ``min_steps`` optimizer
    steps have passed since the last switch. Turning on is never delayed: it is the memory-safe direction.
    Between the thresholds the current state holds, so a signal hovering near one threshold cannot make
    the offload flap.
    """

    def __init__(
        self,
        memory_high: float = 0.90,
        memory_low: float = 0.80,
        seq_high: int = 32768,
        seq_low: int = 16384,
        min_steps: int = 2,
    ) -> None:
        self.memory_high = memory_high
        self.memory_low = memory_low
        self.seq_high = seq_high
        self.seq_low = seq_low
        self.min_steps = min_steps
        self.offloading = False
        self.last_switch_step: int | None = None
        self.last_reason: str | None = None  # why the last decision (autooffload.history.REASONS)

    @classmethod
    def from_settings(cls, settings: Any) -> HysteresisPolicy:
        return cls(settings.memory_high, settings.memory_low, settings.seq_high, settings.seq_low, settings.min_steps)

    def decide(self, observation: Observation) -> int:
        memory = observation.memory_fraction
        high = "memory_high" if memory is not None and memory >= self.memory_high else None
        high = "seq_high" if observation.seq_len >= self.seq_high else high
        if not self.offloading:
            if high:
                self._switch(True, observation.step)
            self.last_reason = high or "below_high"
        else:
            calm = (memory is None or memory < self.memory_low) and observation.seq_len < self.seq_low
            dwelt = self.last_switch_step is None or observation.step - self.last_switch_step >= self.min_steps
            if calm and dwelt:
                self._switch(False, observation.step)
            self.last_reason = high or ("above_low" if not calm else "dwell" if not dwelt else "below_low")
        return observation.layers if self.offloading else 0

    def agreed(self, observation: Observation, level: int) -> None:
        """The ranks run ``level`` for this observation, not what this policy decided: take it as this policy's
        own switch, so every rank's dwell counts from the same step and their states stay alike."""
        if (level > 0) != self.offloading:
            self._switch(level > 0, observation.step)

    def _switch(self, offloading: bool, step: int) -> None:
        self.offloading = offloading
        self.last_switch_step = step

    def state_dict(self) -> dict[str, Any]:
        return {"offloading": self.offloading, "last_switch_step": self.last_switch_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offloading = bool(state["offloading"])
        self.last_switch_step = state["last_switch_step"]
