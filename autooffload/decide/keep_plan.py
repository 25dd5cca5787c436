"""The keep rung's bookkeeping: how many of the last layers keep, for every forward alive, checked by the reading.

The controller asks it, per micro-batch, how many of the last checkpointed layers may run without checkpointing
(:meth:`KeepPlanner.count`), tells it what ran (:meth:`~KeepPlanner.forward`), when a backward ran
(:meth:`~KeepPlanner.backward`), what a kept layer saved (:meth:`~KeepPlanner.measured`) and, at a step's end, the
reading (:meth:`~KeepPlanner.end_step`). Three things make its plan right by construction:

- **each layer its own cost** (:class:`~autooffload.decide.activations.KeptLayerModel`, constant term included):
  keeping the last ``m`` layers adds the sum of those ``m`` layers' bytes; a layer not measured yet costs the
  most any measured layer costs at that length, scaled up by its share of matrix weights, and never less than
  its seed;
- **every forward alive before one backward** (chosen and rejected as two calls, contrastive losses, accumulation
  by hand): forwards are counted between backwards, the most alive together over the recent steps is learned,
  and a forward's plan leaves room for what the forwards before it kept and for the ones still to come; where
  more forwards are alive than the readings ever saw together (the first step with two), also for the whole
  footprint of those the prediction does not cover (their checkpointed inputs, logits and loss graph);
- **nothing kept beyond the lengths a reading covered**: a micro-batch longer than any step a reading saw keeps
  nothing (the all-recompute peak is only known up to there).

And the reading corrects it (closed loop): after every clean step that kept layers, the reading is compared
with the plan's prediction (the all-recompute peak plus the kept bytes of the forwards alive together). A miss
(the reading above it) is charged to the micro-batch that caused it, the forwards alive together that the plan
predicted highest: where those kept nothing, the all-recompute peak was short, which the policy learns from the
reading, and keep is not corrected (with gradient accumulation a long micro-batch that kept nothing otherwise
charged its miss to a short one that kept layers). A miss charged to a forward that kept adds what the reading
showed missing to every kept forward at that length and at nearby ones (half to twice the tokens), before the
next micro-batch (a constant: what the layers' counts cannot see, an attention mask the kept layers save and the
checkpointed ones only reference, lies outside any one layer); a miss where a correction already applied widens
the margin by one more margin (up to ``MISS_LIMIT``). A correction is eased half way back towards what the
readings show after every clean step that kept at its lengths without a miss, and one that no clean step tests
(it forbids keep at its lengths, so none keeps there) halves every ``CALM_STEPS`` clean steps until keep is tried
there again; the margin narrows again after ``CALM_STEPS`` clean steps without a miss: keep never stays off for
good because of one inflated sample. The reading the policy learns from is the step's less what the corrected
model says its kept layers added.

Bounded, however long the run and however many distinct lengths it meets: one measurement per layer and bucket
of sequence lengths (:func:`~autooffload.decide.activations.length_bucket`), one correction per bucket of
tokens, and a decision that sizes each layer once (O(layers), each from a fit computed once per measurement).
Pure: no torch, no clock, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from . import ladder
from .activations import KeptLayerModel, LayerShape, length_bucket

MISS_LIMIT = 4  # the margin grows to at most (1 + MISS_LIMIT) margins after repeated under-predictions
CALM_STEPS = 16  # clean steps that kept without a miss before the margin narrows by one
ALIVE_WINDOW = 16  # steps over which the most forwards alive together is remembered
REACH = 2.0  # a correction at t tokens applies from t / REACH to t x REACH tokens
# A reading above the prediction by less than this fraction of it is the prediction (a peak predicted to the byte
# in floating point, or the all-recompute fit moving by a few bytes as it learns), not an under-prediction.
MISS_TOLERANCE = 1e-3
# A correction that no clean step tested for CALM_STEPS is halved; below this many bytes it is dropped.
CORRECTION_FLOOR = 4096.0


@dataclasses.dataclass
class Forward:
    """One forward as it ran: its length, its kept layers, what the plan said they add and the all-recompute peak."""

    tokens: int
    seq: int
    keep: int
    kept_bytes: float
    plain: float | None
    footprint: float = 0.0  # what it holds until its backward with every layer recomputing, beyond the weights
    beyond: float = 0.0  # the footprints of earlier forwards alive with it that the prediction does not cover


class KeepPlanner:
    """Plans keep per micro-batch and learns from every step (see the module's docstring)."""

    def __init__(self) -> None:
        self.layers: list[KeptLayerModel] = []
        self.alive = 1  # forwards alive together before one backward: the most over the recent steps
        self.corrections: dict[int, float] = {}  # tokens -> bytes a kept forward adds beyond the layers' counts
        self._untested: dict[int, int] = {}  # tokens of a correction -> clean steps since one tested it
        self.misses = 0  # under-predictions not yet calmed: each widens the margin by one margin
        self.calm = 0
        self.longest_read_tokens = 0
        self.reading_kept_bytes = 0.0
        self._recent_alive: list[int] = []
        self._group: list[Forward] = []  # forwards since the last backward
        self._groups: list[list[Forward]] = []  # this step's closed groups
        self._version = 0  # counts changes of the layers' models: the sizes of a length are cached until one
        self._costs: tuple[int, int, int, list[float | None]] | None = None  # (version, tokens, seq, per layer)

    # ---- the model --------------------------------------------------------------------------------------

    def configure(self, weights: list[int], weight_bytes: int, seed: LayerShape | None) -> None:
        """The planned stack: each layer's matrix-weight elements, their dtype's bytes, and the config's seed.
        Measurements (and a resumed state's) stay where the number of layers is unchanged."""
        if len(weights) != len(self.layers):
            self.layers = [KeptLayerModel() for _ in weights]
        for model, count in zip(self.layers, weights, strict=True):
            model.seed, model.weights, model.weight_bytes = seed, count, weight_bytes
        self._version += 1

    @property
    def samples(self) -> dict[tuple[int, int, int], float]:
        """Every measurement: (layer, tokens, seq) -> bytes."""
        return {(i, t, s): y for i, m in enumerate(self.layers) for (t, s), y in m.samples.items()}

    def layer_costs(self, tokens: int, seq: int) -> list[float | None]:
        """What keeping each layer adds at this length, before corrections; None where nothing is known.

        A layer not measured yet costs the most any measured layer costs at this length, scaled up by its share of
        matrix weights, and never less than its seed. Computed once per length and change of the models."""
        cached = self._costs
        if cached is not None and cached[:3] == (self._version, tokens, seq):
            return cached[3]
        own = [model.predict(tokens, seq) for model in self.layers]
        pairs = zip(own, self.layers, strict=True)
        known = [(max(c - m.constant, 0.0), m.weights) for c, m in pairs if m.measured and c is not None]
        most = max((v for v, _ in known), default=None)
        most_per_weight = max((v / w for v, w in known if w), default=None)
        costs = list(own)
        for position, model in enumerate(self.layers):
            if model.measured or most is None:
                continue
            borrowed = most
            if model.weights and most_per_weight is not None:
                borrowed = max(most, model.weights * most_per_weight)
            costs[position] = max(model.constant + borrowed, own[position] or 0.0)
        self._costs = (self._version, tokens, seq, costs)
        return costs

    def layer_bytes(self, position: int, tokens: int, seq: int) -> float | None:
        """What keeping layer ``position`` adds at this length, before corrections; None when nothing is known."""
        return self.layer_costs(tokens, seq)[position]

    def extra(self, tokens: int) -> float:
        """The bytes per kept forward the readings showed missing at this length or a nearby one (0: none)."""
        return max((extra for t, extra in self.corrections.items() if _reaches(t, tokens)), default=0.0)

    def kept_bytes(self, keep: int, tokens: int, seq: int) -> float | None:
        """What keeping the last ``keep`` layers adds for one forward at this length, corrections included."""
        if keep <= 0:
            return 0.0
        values = self.layer_costs(tokens, seq)[len(self.layers) - keep :]
        if any(value is None for value in values):
            return None
        return sum(values) + self.extra(tokens)  # type: ignore[arg-type]

    def wants(self, first: int, tokens: int, seq: int) -> bool:
        """Whether a layer from ``first`` on (those not offloaded) has no measurement at this length's bucket:
        count them this time (kept or recomputing, each layer's count is what it keeps without checkpointing)."""
        return any(model.wants(tokens, seq) for model in self.layers[first:])

    def measured(self, position: int, tokens: int, seq: int, nbytes: float, cast_bytes: int = 0) -> None:
        if 0 <= position < len(self.layers):
            self.layers[position].add(tokens, seq, nbytes, cast_bytes)
            self._version += 1

    # ---- the plan -------------------------------------------------------------------------------------

    def count(
        self,
        predicted: float,
        tokens: int,
        seq: int,
        limit: float,
        margin: float,
        levels: tuple[int, ...] | None = None,
    ) -> int:
        """How many of the last layers keep for this forward. ``predicted``: the step's all-recompute peak at this
        length; ``limit``: memory_high x device memory; ``margin``: the bytes keep leaves free, before widening.

        What the forwards alive since the last backward kept is already held, and so is the whole footprint of
        those the prediction does not cover (:meth:`beyond`); this forward and the ones still expected before the
        backward (``alive`` less those run) each keep the same.
        """
        if tokens <= 0 or tokens > self.longest_read_tokens or not self.layers:
            return 0
        held = self.held()
        expected = max(self.alive - len(self._group), 1)
        extra = self.extra(tokens)
        cumulative, added = [], 0.0
        for cost in reversed(self.layer_costs(tokens, seq)):
            if cost is None:
                break
            added += cost
            cumulative.append(expected * (added + extra))
        widened = margin * (1 + self.misses)
        return ladder.keep(predicted + held, cumulative, len(self.layers), limit, widened, levels)

    def held(self) -> float:
        """What the forwards alive since the last backward hold beyond the prediction for the next one: their kept
        layers, and the footprints the prediction does not cover (:meth:`beyond`)."""
        return sum(f.kept_bytes for f in self._group) + self.beyond()

    def beyond(self) -> float:
        """The footprints of the forwards alive since the last backward that the prediction does not cover: it was
        learned from readings with at most ``alive`` forwards alive together, so with this one there are
        ``len(group) + 1 - alive`` more (the largest of the earlier ones are counted)."""
        extra = len(self._group) + 1 - self.alive
        if extra <= 0:
            return 0.0
        return sum(sorted((f.footprint for f in self._group), reverse=True)[:extra])

    def forward(self, tokens: int, seq: int, keep: int, plain: float | None, footprint: float = 0.0) -> None:
        """The forward about to run keeps the last ``keep`` layers; ``plain``: the all-recompute peak predicted;
        ``footprint``: what it holds until its backward, every layer recomputing (its checkpointed inputs, logits
        and loss graph), as the config's per-token terms estimate it."""
        kept = self.kept_bytes(keep, tokens, seq) or 0.0
        self._group.append(Forward(tokens, seq, keep, kept, plain, footprint, self.beyond()))

    def backward(self) -> None:
        """A backward ran: the forwards before it are freed."""
        if self._group:
            self._groups.append(self._group)
            self._group = []

    def rerun(self) -> None:
        """The step ran out of memory and is rerun from its start: its forwards so far are freed (the one that
        failed never reaches its backward), and the rerun runs them again."""
        self._group, self._groups = [], []

    # ---- the reading ----------------------------------------------------------------------------------

    def end_step(self, reading: float | None, clean: bool = True) -> None:
        """Close a step: learn the forwards alive together, compare the reading with the plan (``clean``: the
        reading is a sample of training alone), and set :attr:`reading_kept_bytes`."""
        groups = [*self._groups, *([self._group] if self._group else [])]
        self._groups, self._group = [], []
        if groups:
            self._recent_alive = [*self._recent_alive, max(len(g) for g in groups)][-ALIVE_WINDOW:]
            self.alive = max(self._recent_alive)
        if reading is not None and groups:
            self.longest_read_tokens = max(self.longest_read_tokens, max(f.tokens for g in groups for f in g))
        predicted = [(self._predicted(g), g) for g in groups]
        if reading is not None and clean and predicted:
            self._age_corrections(self._compare(reading, predicted))
        # The forwards the plan expected at the peak; one planned without a prediction (an offloading or a longer
        # micro-batch than any reading covered) may hold it: then what the kept ones added is not subtracted.
        peak = max(predicted, key=_highest, default=None)
        self.reading_kept_bytes = self._kept_now(peak[1]) if peak is not None and peak[0] is not None else 0.0

    @staticmethod
    def _predicted(group: list[Forward]) -> float | None:
        plains = [f.plain for f in group if f.plain is not None]
        beyond = max((f.beyond for f in group), default=0.0)
        return max(plains) + sum(f.kept_bytes for f in group) + beyond if plains else None

    def _compare(self, reading: float, predicted: list[tuple[float | None, list[Forward]]]) -> set[int]:
        """Compare a clean reading with the plan of a step; returns the corrections it tested (those reaching the
        tokens of a forward that kept). The reading is at least the peak of every group of forwards alive together:
        a miss is the group's the plan predicted highest (a group planned without a prediction, an offloading
        micro-batch, may be that one: then nothing is charged and nothing eased). Without a miss, each group that
        kept shows at most what its kept forwards needed, and the corrections reaching it ease towards that."""
        kept = [(total, g) for total, g in predicted if any(f.keep for f in g)]
        if not kept:
            return set()
        tested = {t for t in self.corrections for _, g in kept for f in g if f.keep and _reaches(t, f.tokens)}
        total, group = max(predicted, key=_highest)
        if total is None:
            return tested
        if reading > total * (1 + MISS_TOLERANCE):
            if any(f.keep for f in group):  # else the all-recompute peak was short: the policy's to learn
                tokens, forwards = max(f.tokens for f in group), sum(1 for f in group if f.keep)
                used = self.extra(tokens)
                if used > 0:
                    self.misses = min(self.misses + 1, MISS_LIMIT)
                self._correct(tokens, used + (reading - total) / forwards)
                self.calm = 0
            return tested
        self.calm += 1
        if self.misses and self.calm >= CALM_STEPS:
            self.misses, self.calm = self.misses - 1, 0
        shown: dict[int, float] = {}
        for total, g in kept:
            tokens, forwards = max(f.tokens for f in g), sum(1 for f in g if f.keep)
            needed = max(self.extra(tokens) + (reading - total) / forwards, 0.0)  # type: ignore[operator]
            for t in self.corrections:
                if _reaches(t, tokens):
                    shown[t] = max(shown.get(t, 0.0), needed)  # at most what the group needed, per kept forward
        for t, needed in shown.items():
            eased = (self.corrections[t] + min(needed, self.corrections[t])) / 2
            if eased < 1.0:
                self._drop(t)
            else:
                self.corrections[t] = eased
        return tested

    def _correct(self, tokens: int, shown: float) -> int:
        """Raise the correction at ``tokens`` (or the one in its bucket) to at least ``shown``; returns its key."""
        bucket = length_bucket(tokens)
        key = next((t for t in self.corrections if length_bucket(t) == bucket), tokens)
        self.corrections[key] = max(self.corrections.get(key, 0.0), shown)
        self._untested[key] = 0
        return key

    def _age_corrections(self, tested: set[int]) -> None:
        """A clean step ended: a correction it did not test halves every ``CALM_STEPS`` such steps, so that one
        which forbids keep at its lengths (and so is never tested there) does not forbid it for good."""
        for t in list(self.corrections):
            if t in tested:
                self._untested[t] = 0
                continue
            self._untested[t] = self._untested.get(t, 0) + 1
            if self._untested[t] >= CALM_STEPS:
                self._untested[t] = 0
                self.corrections[t] /= 2
                if self.corrections[t] < CORRECTION_FLOOR:
                    self._drop(t)

    def _drop(self, tokens: int) -> None:
        del self.corrections[tokens]
        self._untested.pop(tokens, None)

    def _kept_now(self, group: list[Forward]) -> float:
        """What the group's kept layers added, by the model as corrected now."""
        return sum(self.kept_bytes(f.keep, f.tokens, f.seq) or f.kept_bytes for f in group)

    # ---- resume ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "layers": [model.state_dict() for model in self.layers],
            "alive": self._recent_alive,
            "corrections": [[t, f, self._untested.get(t, 0)] for t, f in self.corrections.items()],
            "misses": self.misses,
            "calm": self.calm,
            "longest_read_tokens": self.longest_read_tokens,
            "reading_kept_bytes": self.reading_kept_bytes,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A state from :meth:`state_dict`, or from an earlier release: one from before per-layer models (a single
        ``samples`` list) keeps its reading's facts and measures again; one from before the buckets (a sample per
        length, a correction per length) keeps one per bucket."""
        layers = state.get("layers")
        if layers is not None:
            self.layers = [KeptLayerModel() for _ in layers]
            for model, saved in zip(self.layers, layers, strict=True):
                model.load_state_dict(saved)
        self._recent_alive = [int(n) for n in state.get("alive", [])]
        self.alive = max(self._recent_alive, default=1)
        self.corrections, self._untested = {}, {}
        for t, f, *untested in state.get("corrections", []):
            self._untested[self._correct(int(t), float(f))] = int(untested[0]) if untested else 0
        self.misses = int(state.get("misses", 0))
        self.calm = int(state.get("calm", 0))
        self.longest_read_tokens = int(state.get("longest_read_tokens", 0))
        self.reading_kept_bytes = float(state.get("reading_kept_bytes", 0.0))
        self._version += 1


def _highest(entry: tuple[float | None, list[Forward]]) -> float:
    """Orders groups by their predicted peak; one without a prediction first (it may hold the peak)."""
    return math.inf if entry[0] is None else entry[0]


def _reaches(correction_tokens: int, tokens: int) -> bool:
    """A correction at ``correction_tokens`` applies to ``tokens`` (from half to twice them: ``REACH``)."""
    return correction_tokens / REACH <= tokens <= correction_tokens * REACH
