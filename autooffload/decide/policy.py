"""Decide: how many checkpointed layers offload their saved input for the next micro-batch.

A policy is pure: an :class:`Observation` in, a number of layers out. No torch, no clock, no I/O, so it can
be driven with plain numbers in a test or a simulation, and a user can bring their own: any object with
``decide(observation) -> int`` and, to survive a checkpoint, ``state_dict()`` / ``load_state_dict()``.
Under torch.distributed the ranks run the largest level any of them decided (distributed.py); a policy that
keeps state can follow the group with ``agreed(observation, level)``, called when that level is not its own.
"""

from __future__ import annotations

import dataclasses
import math
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
    memory and was rerun (:mod:`autooffload.rescue`), so its reading is a lower bound of what the step needed:
    the controller raises ``memory_bytes`` (not ``memory_fraction``, which stays the reading) to at least the
    device's size, and to the reading plus the failed allocation where the error names its size.

    What the model's config and the optimizer say (:mod:`autooffload.decide.peak`): ``logits_bytes_per_token``
    (the logits at the loss) and ``layer_work_bytes_per_token`` (one layer's recompute working set), per token of
    the micro-batch; ``pending_bytes``: bytes the next steps will hold that the last reading does not include
    (the optimizer state before the first ``optimizer.step()``). ``last_step_clean``: False when an evaluation
    or a checkpoint save ran between the last two readings, so the reading may hold more than training needs
    and is no sample of it.
    ``host_layers``: the most layers whose saved inputs fit the host memory budget for this micro-batch (the
    controller caps every answer at it; ``None``: no cap known).
    ``layer_bytes``: where the layers' saved inputs differ in size (an encoder-decoder's two stacks, each with
    its own length and width; a layer that runs several times per forward), what each layer's take for this
    micro-batch, in the order they offload: the largest first, so level ``k`` frees the first ``k``
    (:meth:`freed`). ``None``: every layer takes ``bytes_per_layer``, which is then the mean otherwise.
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
    logits_bytes_per_token: float | None = None
    layer_work_bytes_per_token: float | None = None
    pending_bytes: int = 0
    last_step_clean: bool = True
    host_layers: int | None = None
    layer_bytes: tuple[int, ...] | None = None

    def freed(self, level: int) -> int:
        """Bytes that offloading ``level`` layers takes off the device for this micro-batch (0 where unknown)."""
        if self.layer_bytes is not None:
            return sum(self.layer_bytes[: max(level, 0)])
        return max(level, 0) * (self.bytes_per_layer or 0)

    def fewest_layers(self, excess: float) -> int:
        """The fewest layers whose offload frees at least ``excess`` bytes (``layers`` where none do)."""
        if self.layer_bytes is None:
            per_layer = self.bytes_per_layer
            return min(math.ceil(excess / per_layer), self.layers) if per_layer else self.layers
        freed = 0
        for level, nbytes in enumerate(self.layer_bytes, start=1):
            freed += nbytes
            if freed >= excess:
                return level
        return self.layers


class Policy(Protocol):
    def decide(self, observation: Observation) -> int: ...


class HysteresisPolicy:
    """All-or-nothing offload with two thresholds per signal and a dwell.

    On when memory >= ``memory_high`` or the sequence length >= ``seq_high``. Off only when memory <
    ``memory_low`` (or unknown), the sequence length < ``seq_low``, and at least ``min_steps`` optimizer
    steps have passed since the last switch. Turning on is never delayed: it is the memory-safe direction.
    Between the thresholds the current state holds, so a signal hovering near one threshold cannot make
    the offload flap.

    The memory compared with the thresholds is what the last step needed without offload: its reading plus
    what its offloaded layers held (and any ``pending_bytes``), when the observation has them in bytes. The
    reading after offload alone would fall below ``memory_low`` because of the offload itself, switch it off,
    and the next step would switch it on again. A reading that is not clean (an evaluation or a save ran in
    it) leaves the last clean one in force.
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
        self._step: int | None = None
        self._held = 0  # the most bytes this step's offloaded layers held, over its micro-batches
        self._need: float | None = None  # the last clean step's need without offload, a fraction of the device
        self.last_reason: str | None = None  # why the last decision (autooffload.history.REASONS)

    @classmethod
    def from_settings(cls, settings: Any) -> HysteresisPolicy:
        return cls(settings.memory_high, settings.memory_low, settings.seq_high, settings.seq_low, settings.min_steps)

    def decide(self, observation: Observation) -> int:
        memory = self._memory_need(observation)
        level = self._decide(observation, memory)
        self._held = max(self._held, observation.freed(level))
        return level

    def _memory_need(self, observation: Observation) -> float | None:
        """What the last step needed without offload, as a fraction of the device; computed once per step."""
        if observation.step == self._step:
            return self._need
        held = self._held if self._step is not None and observation.step == self._step + 1 else 0
        self._step, self._held = observation.step, 0
        if not observation.last_step_clean:
            return self._need
        o = observation
        if o.memory_bytes is not None and o.total_bytes:
            self._need = (o.memory_bytes + held + o.pending_bytes) / o.total_bytes
        else:
            self._need = o.memory_fraction
        return self._need

    def _decide(self, observation: Observation, memory: float | None) -> int:
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
        self._held = max(self._held, observation.freed(level))

    def _switch(self, offloading: bool, step: int) -> None:
        self.offloading = offloading
        self.last_switch_step = step

    def state_dict(self) -> dict[str, Any]:
        return {
            "offloading": self.offloading,
            "last_switch_step": self.last_switch_step,
            "step": self._step,
            "held": self._held,
            "need": self._need,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offloading = bool(state["offloading"])
        self.last_switch_step = state["last_switch_step"]
        self._step = state.get("step")
        self._held = int(state.get("held") or 0)
        self._need = state.get("need")
