"""Decide by prediction: how much memory the next micro-batch needs, and how few layers must offload for it.

The hysteresis policy reacts to the last step's reading, so a long micro-batch that does not fit fails in its
own forward before any reading can say so, and it then offloads every layer where a few would do. This
policy plans instead, from a model of a step's peak memory (:mod:`autooffload.decide.peak`): a constant
(weights, gradients, optimizer state) plus a term that grows with the micro-batch's tokens (every layer's
checkpointed input, the logits at the loss or the working set of the layer being recomputed), less what
offloading removes (one checkpointed input per layer).

- Learn: after every step it keeps one sample, (tokens, the peak as if nothing had been offloaded), from
  the step's reading plus the bytes its offloaded layers held plus the bytes still to come that the reading
  lacks (``pending_bytes``: the optimizer state before the first ``optimizer.step()``). A rescued step's
  reading is a lower bound: it raises the prediction, but stays out of the slope, which it would bend down.
  A reading that is not clean (an evaluation or a save ran in it) is no sample.
- Predict, before the micro-batch's forward: the memory model's upper line for a length within those seen
  (exact at a length already sampled, so fixed-length batches are planned from their own samples), its
  extrapolation with the seed slope and a margin beyond the longest length seen.
- Offload k = ceil(excess over memory_high x device memory / bytes per layer input) layers, earliest first.
  When that is more than ``layers - 1``, every layer: the last layer's input does not lower the peak at the
  start of the backward, but it does at the end of the forward, where the logits are.

Without a memory reading (no step finished yet, no GPU, no NVML) there is nothing to predict from: the
hysteresis policy decides, with its sequence-length trigger: without a GPU the two policies are the same.
With one, a reading and the config's arithmetic (the seed slope: every layer's input, the logits, one layer's
working set, with the margin) predict a micro-batch longer than any sampled, from the first sample on: the
length alone offloads nothing where they say there is room (on one H200 the sequence trigger offloaded 27 of
28 layers of a 32k-token micro-batch whose step peaked at 10.6 of 140 GiB). Only where the arithmetic is
missing (no per-token terms from the config, no layer size) is the hysteresis policy's answer, capped at
``layers - 1``, a floor for such a micro-batch until two lengths are sampled.
Pure: no torch, no clock, no I/O.
"""

from __future__ import annotations

import math
from typing import Any

from .peak import PeakModel, slope_terms
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
        self.model = PeakModel(window)
        self.fallback = HysteresisPolicy(memory_high, memory_low, seq_high, seq_low, min_steps)
        self.total_bytes: int | None = None
        self.layers = 0
        self.token_terms: tuple[float | None, float | None] = (None, None)  # logits, layer work per token
        self._step: int | None = None
        self._pending: list[tuple[int, int, int, int]] = []  # tokens, layers offloaded, bytes per layer, freed
        self.last_reason: str | None = None  # why the last decision (autooffload.history.REASONS)

    @classmethod
    def from_settings(cls, settings: Any) -> PredictivePolicy:
        return cls(settings.memory_high, settings.memory_low, settings.seq_high, settings.seq_low, settings.min_steps)

    @property
    def samples(self) -> list[tuple[int, float, bool]]:
        return self.model.samples

    def decide(self, observation: Observation) -> int:
        self._learn(observation)
        level = self.plan(observation)
        self.last_reason = "predicted_excess" if level else "predicted_fits"
        if level is None:
            level = self.fallback.decide(observation)
            self.last_reason = self.fallback.last_reason
        elif not self.fitted and observation.tokens > (self.model.longest or 0) and not _seeded(observation):
            floor = min(self.fallback.decide(observation), observation.layers - 1)
            if floor > level:
                level, self.last_reason = floor, self.fallback.last_reason
        self._pending.append((observation.tokens, level, observation.bytes_per_layer or 0, observation.freed(level)))
        return level

    def agreed(self, observation: Observation, level: int) -> None:
        """The ranks run ``level``, not what this policy decided (:mod:`autooffload.distributed`): learn from
        the level that ran, and keep the fallback's dwell counting from the group's switch."""
        if self._pending:
            tokens, _, per_layer, _ = self._pending[-1]
            freed = observation.freed(level) if observation.layer_bytes is not None else level * per_layer
            self._pending[-1] = (tokens, level, per_layer, freed)
        self.fallback.agreed(observation, level)

    @property
    def fitted(self) -> bool:
        """Two exact samples of different lengths: the slope is measured, not guessed."""
        return self.model.fitted

    def predict(
        self, tokens: int, bytes_per_layer: int | None = None, observation: Observation | None = None
    ) -> float | None:
        """Peak bytes of a step whose largest micro-batch has ``tokens`` and offloads nothing; None before a sample.

        ``observation`` supplies the seed's logits and working-set terms; without it, those of the last one seen.
        """
        o = observation
        logits, work = (o.logits_bytes_per_token, o.layer_work_bytes_per_token) if o else self.token_terms
        floor, seed = slope_terms(self.layers, tokens, bytes_per_layer, logits, work)
        return self.model.predict(tokens, floor, seed)

    def slope(self, floor: float = 0.0) -> float:
        """Bytes per token: the least-squares slope of the exact samples, at least ``floor``."""
        return self.model.slope(floor)

    def plan(self, observation: Observation) -> int | None:
        """Layers to offload for this micro-batch; None when there is nothing to predict from."""
        total = self.total_bytes
        if total is None or observation.tokens <= 0:
            return None
        predicted = self.predict(observation.tokens, observation.bytes_per_layer, observation)
        if predicted is None:
            return None
        excess = predicted - self.memory_high * total
        if excess <= 0:
            return 0
        level = observation.fewest_layers(excess)
        if observation.levels:
            level = min((allowed for allowed in observation.levels if allowed >= level), default=observation.layers)
        return level

    def _learn(self, observation: Observation) -> None:
        if observation.total_bytes:
            self.total_bytes = observation.total_bytes
        self.layers = observation.layers
        self.token_terms = (observation.logits_bytes_per_token, observation.layer_work_bytes_per_token)
        if observation.step == self._step:
            return
        if (
            self._pending
            and self._step == observation.step - 1
            and observation.memory_bytes is not None
            and observation.last_step_clean
        ):
            reading = observation.memory_bytes + observation.pending_bytes
            self._add_sample(reading, exact=not observation.last_step_rescued)
        self._pending = []
        self._step = observation.step

    def _add_sample(self, reading: int, exact: bool) -> None:
        # The step's reading is the peak of its micro-batches: attribute it to the one predicted highest. Every
        # offloaded layer counts as freed: at the end of the forward even the last one is, and counting it where
        # it was not makes the sample larger, the safe direction.
        known = [entry for entry in self._pending if entry[0] > 0]
        if not known:
            return

        def plain_less_offloaded(entry: tuple[int, int, int, int]) -> float:
            tokens, _, per_layer, freed = entry
            floor, _ = slope_terms(self.layers, tokens, per_layer)
            return self.model.slope(floor) * tokens - freed

        tokens, level, per_layer, freed = max(known, key=plain_less_offloaded)
        if level and not per_layer:
            return
        self.model.add(tokens, reading + freed, exact)

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
        self.model.samples = [(int(t), float(y), bool(exact)) for t, y, exact in state["samples"]]
        self.total_bytes = state["total_bytes"]
        self.layers = int(state["layers"])
        self._step = state["step"]
        self._pending = [
            (int(entry[0]), int(entry[1]), int(entry[2]), int(entry[3] if len(entry) > 3 else entry[1] * entry[2]))
            for entry in state["pending"]
        ]
        self.fallback.load_state_dict(state["fallback"])


def _seeded(observation: Observation) -> bool:
    """Whether the arithmetic can extrapolate beyond the lengths sampled: a layer's input size and the config's
    per-token terms (the seed slope of :mod:`autooffload.decide.peak`)."""
    terms = (observation.logits_bytes_per_token, observation.layer_work_bytes_per_token)
    return bool(observation.bytes_per_layer) and any(term is not None for term in terms)


def make_policy(settings: Any) -> HysteresisPolicy | PredictivePolicy:
    """The policy that ``settings.policy`` names."""
    if settings.policy == "predictive":
        return PredictivePolicy.from_settings(settings)
    return HysteresisPolicy.from_settings(settings)
