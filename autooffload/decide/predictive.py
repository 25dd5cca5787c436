"""Decide by prediction: how much memory the next micro-batch needs, and how few layers must offload for it.

The hysteresis policy reacts to the last step's reading, so a long micro-batch that does not fit fails in its
own forward before any reading can say so, and it then offloads every layer where a few would do. This
policy plans instead, from a model of a step's peak memory: a constant (weights, gradients, optimizer
state) plus a term linear in the micro-batch's tokens (every layer's checkpointed input, the working set of
the layer being recomputed, the loss), less what offloading removes (one checkpointed input per layer).

- Learn: after every step it keeps one sample, (tokens, the peak as if nothing had been offloaded), from
  the step's reading plus the bytes its offloaded layers held. The slope is the least-squares slope of the
  samples, never below the checkpointed inputs alone (layers x bytes per layer input), which is also the
  seed until two different lengths have been seen. The intercept is the highest over the samples, so the
  prediction is an upper line of what was seen: noise and fragmentation push it up, the safe direction.
  A rescued step's reading is where the device ran out, a lower bound: it raises the line, but stays out
  of the slope, which it would bend down.
- Predict, before the micro-batch's forward: peak = intercept + slope x tokens.
- Offload k = ceil(excess over memory_high x device memory / bytes per layer input) layers, earliest first.

Never the last layer, so at most ``layers - 1``: its input is the first the backward needs, so it would be
copied back at once, and the peak at the start of the backward (that input plus the recompute of its layer)
is not lowered by moving it. The all-or-nothing answers (the hysteresis policy, mode ``on``, the compile
latch, the rescue) still offload every layer: they are the blunt "as much as possible", where freeing the
last input for the loss at the end of the forward can still matter; a plan that has counted the bytes has
no reason to pay for that copy.

Without a memory reading (no step finished yet, no GPU, no NVML) there is nothing to predict from: the
hysteresis policy decides, with its sequence-length trigger: without a GPU the two policies are the same.
Until two exact samples of different lengths exist the slope is a guess, so the hysteresis policy's answer
(capped at ``layers - 1``) is also a floor then: no less safe than the threshold policy while learning.
Pure: no torch, no clock, no I/O.
"""

from __future__ import annotations

import math
from typing import Any

from .policy import HysteresisPolicy, Observation


def compile_levels(layers: int, max_switches: int) -> tuple[int, ...]:
    """The offload levels allowed under torch.compile: 0, a few spread evenly up to ``layers - 1``, and all.

    Each distinct level compiles once when first used (later uses hit dynamo's cache), and the controller
    latches offload on after ``max_switches`` recompiling switches. ``max_switches - 1`` partial levels leave
    one recompilation for the rescue's all-layers level, so planning alone never spends the budget.
    """
    top = layers - 1
    if top <= 0:
        return (0, max(layers, 0))
    count = max(1, max_switches - 1)
    partial = {math.ceil(top * i / count) for i in range(1, count + 1)}
    return tuple(sorted({0, *partial, layers}))


class PredictivePolicy:
    """Offload, per micro-batch, the fewest layers that keep the predicted peak under ``memory_high``.

    ``window``: how many recent steps the fit remembers. The hysteresis settings are those of the fallback
    used while there is no memory reading.
    """

    def __init__(
        self,
        memory_high: float = 0.90,
        memory_low: float = 0.80,
        seq_high: int = 32768,
        seq_low: int = 16384,
        min_steps: int = 2,
        window: int = 256,
    ) -> None:
        self.memory_high = memory_high
        self.window = window
        self.fallback = HysteresisPolicy(memory_high, memory_low, seq_high, seq_low, min_steps)
        self.samples: list[tuple[int, float, bool]] = []  # tokens, peak as if nothing offloaded, exact
        self.total_bytes: int | None = None
        self.layers = 0
        self._step: int | None = None
        self._pending: list[tuple[int, int, int]] = []  # tokens, layers offloaded, bytes per layer
        self.last_reason: str | None = None  # why the last decision (autooffload.history.REASONS)

    @classmethod
    def from_settings(cls, settings: Any) -> PredictivePolicy:
        return cls(settings.memory_high, settings.memory_low, settings.seq_high, settings.seq_low, settings.min_steps)

    def decide(self, observation: Observation) -> int:
        self._learn(observation)
        level = self.plan(observation)
        self.last_reason = "predicted_excess" if level else "predicted_fits"
        if level is None:
            level = self.fallback.decide(observation)
            self.last_reason = self.fallback.last_reason
        elif not self.fitted:
            floor = min(self.fallback.decide(observation), observation.layers - 1)
            if floor > level:
                level, self.last_reason = floor, self.fallback.last_reason
        self._pending.append((observation.tokens, level, observation.bytes_per_layer or 0))
        return level

    def agreed(self, observation: Observation, level: int) -> None:
        """The ranks run ``level``, not what this policy decided (:mod:`autooffload.distributed`): learn from
        the level that ran, and keep the fallback's dwell counting from the group's switch."""
        if self._pending:
            tokens, _, per_layer = self._pending[-1]
            self._pending[-1] = (tokens, level, per_layer)
        self.fallback.agreed(observation, level)

    @property
    def fitted(self) -> bool:
        """Two exact samples of different lengths: the slope is measured, not guessed."""
        return len({t for t, _, exact in self.samples if exact}) >= 2

    def predict(self, tokens: int, bytes_per_layer: int | None = None) -> float | None:
        """Peak bytes of a step whose largest micro-batch has ``tokens`` and offloads nothing; None before a sample."""
        if not self.samples:
            return None
        slope = self.slope(self._seed(tokens, bytes_per_layer))
        return max(y - slope * t for t, y, _ in self.samples) + slope * tokens

    def slope(self, seed: float = 0.0) -> float:
        """Bytes per token: the least-squares slope of the exact samples, at least ``seed``."""
        points = [(t, y) for t, y, exact in self.samples if exact]
        n = len(points)
        mean_t = sum(t for t, _ in points) / n if n else 0.0
        mean_y = sum(y for _, y in points) / n if n else 0.0
        var = sum((t - mean_t) ** 2 for t, _ in points)
        if var <= 0:
            return seed
        cov = sum((t - mean_t) * (y - mean_y) for t, y in points)
        return max(cov / var, seed)

    def plan(self, observation: Observation) -> int | None:
        """Layers to offload for this micro-batch; None when there is nothing to predict from."""
        total = self.total_bytes
        if total is None or observation.tokens <= 0:
            return None
        predicted = self.predict(observation.tokens, observation.bytes_per_layer)
        if predicted is None:
            return None
        excess = predicted - self.memory_high * total
        if excess <= 0:
            return 0
        most = max(observation.layers - 1, 0)
        per_layer = observation.bytes_per_layer
        level = min(math.ceil(excess / per_layer), most) if per_layer else most
        if observation.levels:
            level = min((allowed for allowed in observation.levels if allowed >= level), default=observation.layers)
        return level

    def _seed(self, tokens: int, bytes_per_layer: int | None) -> float:
        if not bytes_per_layer or tokens <= 0:
            return 0.0
        return self.layers * bytes_per_layer / tokens

    def _learn(self, observation: Observation) -> None:
        if observation.total_bytes:
            self.total_bytes = observation.total_bytes
        self.layers = observation.layers
        if observation.step == self._step:
            return
        if self._pending and self._step == observation.step - 1 and observation.memory_bytes is not None:
            self._add_sample(observation.memory_bytes, exact=not observation.last_step_rescued)
        self._pending = []
        self._step = observation.step

    def _add_sample(self, reading: int, exact: bool) -> None:
        # The step's reading is the peak of its micro-batches: attribute it to the one predicted highest. The
        # last layer's input does not lower the peak (see above), so it does not count as freed.
        known = [(t, min(k, max(self.layers - 1, 0)), b) for t, k, b in self._pending if t > 0]
        if not known:
            return

        def plain_less_offloaded(entry: tuple[int, int, int]) -> float:
            tokens, level, per_layer = entry
            return self.slope(self._seed(tokens, per_layer)) * tokens - level * per_layer

        tokens, level, per_layer = max(known, key=plain_less_offloaded)
        if level and not per_layer:
            return
        self.samples.append((tokens, float(reading + level * per_layer), exact))
        del self.samples[: -self.window]

    def state_dict(self) -> dict[str, Any]:
        return {
            "samples": [list(sample) for sample in self.samples],
            "total_bytes": self.total_bytes,
            "layers": self.layers,
            "step": self._step,
            "pending": [list(entry) for entry in self._pending],
            "fallback": self.fallback.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples = [(int(t), float(y), bool(exact)) for t, y, exact in state["samples"]]
        self.total_bytes = state["total_bytes"]
        self.layers = int(state["layers"])
        self._step = state["step"]
        self._pending = [(int(t), int(k), int(b)) for t, k, b in state["pending"]]
        self.fallback.load_state_dict(state["fallback"])


def make_policy(settings: Any) -> HysteresisPolicy | PredictivePolicy:
    """The policy that ``settings.policy`` names."""
    if settings.policy == "predictive":
        return PredictivePolicy.from_settings(settings)
    return HysteresisPolicy.from_settings(settings)
