"""The keep rung's bookkeeping: how many of the last layers keep, for every forward alive, checked by the reading.

The controller asks it, per micro-batch, how many of the last checkpointed layers may run without checkpointing
(:meth:`KeepPlanner.count`), tells it what ran (:meth:`~KeepPlanner.forward`), when a backward ran
(:meth:`~KeepPlanner.backward`), what a kept layer saved (:meth:`~KeepPlanner.measured`) and, at a step's end, the
reading (:meth:`~KeepPlanner.end_step`). What makes its plan right by construction:

- **each layer its own cost** (:class:`~autooffload.decide.activations.KeptLayerModel`); a layer not measured yet
  costs the most any measured layer costs at that length, scaled up by its share of matrix weights;
- **what the kept layers add to the real peak**: read off the step's segments at that length
  (:mod:`~autooffload.decide.growth`), or with a probe that reads none the sum of what they save less what whole
  steps' readings showed it exceeds by (:mod:`~.read_growth`; not under compile: the sum there);
- **every forward alive before one backward**: forwards are counted between backwards, the most alive together
  over the recent steps is learned, and a forward's plan leaves room for the ones before it and still to come
  (where more are alive than any reading saw, for their whole footprint);
- **nothing kept beyond the lengths a reading covered** (the all-recompute peak is only known up to there).

And the reading corrects it (closed loop): after every clean step that kept layers, the reading is compared with
the prediction (the all-recompute peak plus what the kept layers of the forwards alive together add). A miss is
charged to the forwards the plan predicted highest; where those kept nothing the all-recompute peak was short,
which the policy learns. A profile or whole readings a miss came from are dropped first; what the sum of the saved
bytes still misses is corrected (:mod:`~autooffload.decide.corrections`). The policy learns from the reading less
what the kept layers added.

Bounded: one measurement per layer and bucket of lengths (:func:`~autooffload.decide.activations.length_bucket`),
one correction per bucket of tokens, O(layers) a decision. Pure: no torch, no clock, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from . import ladder
from .activations import KeptLayerModel, LayerShape, length_bucket, stack_costs
from .corrections import CALM_STEPS, MISS_LIMIT, Corrections
from .growth import Profile, Profiles, read_profile
from .read_growth import ReadGrowths

__all__ = ["CALM_STEPS", "MISS_LIMIT", "Forward", "KeepPlanner"]

ALIVE_WINDOW = 16  # steps over which the most forwards alive together is remembered
# A reading above the prediction by less than this fraction of it is the prediction (floating point, the
# all-recompute fit moving by a few bytes as it learns), not an under-prediction.
MISS_TOLERANCE = 1e-3


@dataclasses.dataclass
class Forward:
    """One forward as it ran: its length, its kept layers, what the plan said they add and the all-recompute peak."""

    tokens: int
    seq: int
    keep: int
    plain: float | None
    footprint: float = 0.0  # what it holds until its backward with every layer recomputing, beyond the weights
    beyond: float = 0.0  # the footprints of earlier forwards alive with it that the prediction does not cover
    key: object = None  # how its marks name it (the controller's micro-batch)
    measured: bool = False  # it counted its layers and marked the step (a profile's segments)
    growth: float = 0.0  # what the plan said its group's kept layers add to the peak, with it the last forward


class KeepPlanner:
    """Plans keep per micro-batch and learns from every step (see the module's docstring)."""

    def __init__(self) -> None:
        self.layers: list[KeptLayerModel] = []
        self.alive = 1  # forwards alive together before one backward: the most over the recent steps
        self.closed_loop = Corrections()  # what the readings showed missing, and the margin's width
        self.longest_read_tokens = 0
        self.reading_kept_bytes = 0.0
        self._recent_alive: list[int] = []
        self._group: list[Forward] = []  # forwards since the last backward
        self._groups: list[list[Forward]] = []  # this step's closed groups
        self._version = 0  # counts changes of the layers' models: the sizes of a length are cached until one
        self._costs: tuple[int, int, int, list[float | None]] | None = None  # (version, tokens, seq, per layer)
        self.profiles = Profiles()  # the steps' segments, per bucket of lengths and forwards alive together
        self.segmented = True  # the probe reads segments (until a marked step shows it does not)
        self.compiled = False  # under torch.compile the profiles are not read (the measured step is not the timed one)
        self.read_growths = ReadGrowths()  # eagerly without segments: what whole steps' readings showed

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
        """What keeping each layer adds at this length, before corrections (:func:`~.activations.stack_costs`);
        computed once per length and change of the models."""
        cached = self._costs
        if cached is not None and cached[:3] == (self._version, tokens, seq):
            return cached[3]
        costs = stack_costs(self.layers, tokens, seq)
        self._costs = (self._version, tokens, seq, costs)
        return costs

    def layer_bytes(self, position: int, tokens: int, seq: int) -> float | None:
        """What keeping layer ``position`` adds at this length, before corrections; None when nothing is known."""
        return self.layer_costs(tokens, seq)[position]

    @property
    def corrections(self) -> dict[int, float]:
        """Tokens -> bytes a kept forward adds beyond the layers' counts, as the readings showed."""
        return self.closed_loop.by_tokens

    @property
    def misses(self) -> int:
        return self.closed_loop.misses

    def extra(self, tokens: int) -> float:
        """The bytes per kept forward the readings showed missing at this length or a nearby one (0: none)."""
        return self.closed_loop.extra(tokens)

    def kept_bytes(self, keep: int, tokens: int, seq: int) -> float | None:
        """What keeping the last ``keep`` layers adds for one forward at this length, corrections included."""
        if keep <= 0:
            return 0.0
        values = self.layer_costs(tokens, seq)[len(self.layers) - keep :]
        if any(value is None for value in values):
            return None
        return sum(values) + self.extra(tokens)  # type: ignore[arg-type]

    def wants(self, first: int, tokens: int, seq: int) -> bool:
        """Whether a layer from ``first`` on (those not offloaded) has no measurement at this length's bucket: count
        them this time (each layer's count, kept or recomputing, is what it keeps without checkpointing)."""
        return any(model.wants(tokens, seq) for model in self.layers[first:])

    def measured(self, position: int, tokens: int, seq: int, nbytes: float, cast_bytes: int = 0) -> None:
        if 0 <= position < len(self.layers):
            self.layers[position].add(tokens, seq, nbytes, cast_bytes)
            self._version += 1

    # ---- the plan -------------------------------------------------------------------------------------

    def count(
        self, predicted: float, tokens: int, seq: int, limit: float, margin: float,
        levels: tuple[int, ...] | None = None, widen_by: float | None = None,
    ) -> int:  # fmt: skip
        """How many of the last layers keep for this forward. ``predicted``: the step's all-recompute peak at this
        length; ``limit``: memory_high x device memory; ``margin``: the bytes keep leaves free, before widening;
        ``widen_by``: the bytes each miss not yet calmed adds to it (``margin`` where not given). What the forwards
        since the last backward kept is held, and the footprints the prediction does not cover (:meth:`beyond`);
        this forward and the ones still expected before the backward each keep the same."""
        if tokens <= 0 or tokens > self.longest_read_tokens or not self.layers:
            return 0
        earlier = [(f.keep, f.tokens, f.seq) for f in self._group]
        expected = max(self.alive - len(self._group), 1)
        costs, extra = self.layer_costs(tokens, seq), self.extra(tokens)
        most = next((m for m in range(len(costs)) if costs[-1 - m] is None), len(costs))  # layers with a cost
        planned = [*earlier, *[(1, tokens, seq)] * expected]
        profile = self._profile(planned)
        kept = [self._kept_layers(*forward) for forward in earlier]
        if profile is not None:
            cumulative = profile.growths(kept, [c or 0.0 for c in costs], most, extra, tokens)
        else:  # the sum of what the kept layers save (the earlier ones' too: alive through this one's backward)
            held, added, cumulative = sum(map(sum, kept)), 0.0, []
            for cost in reversed(costs[len(costs) - most :]):
                added += cost  # type: ignore[operator]
                cumulative.append(held + expected * (added + extra))
            if (key := self._key(planned, whole=True)) is not None:  # less what whole steps' readings showed
                keeps, tokens_most = [f[0] for f in earlier], max(t for _, t, _ in planned)
                cumulative = self.read_growths.tightened(key, keeps, expected, cumulative, tokens_most, self._plan_sum)
        widened = margin + (margin if widen_by is None else widen_by) * self.misses
        return ladder.keep(predicted + self.beyond(), cumulative, len(self.layers), limit, widened, levels)

    def growth(self, forwards: list[tuple[int, int, int]]) -> float:
        """What the kept layers of ``forwards`` alive together, each ``(keep, tokens, seq)``, add to their peak: off
        their profile where one was read, else the sum of what they save, less what whole readings showed."""
        kept = [self._kept_layers(keep, tokens, seq) for keep, tokens, seq in forwards]
        profile, tokens = self._profile(forwards), max(tokens for _, tokens, _ in forwards)
        if profile is not None:
            return profile.growth(kept, tokens)
        key, keeps = self._key(forwards, whole=True), [f[0] for f in forwards]
        excess = self.read_growths.excess(key, keeps, tokens, self._plan_sum) if key is not None else 0.0
        return max(sum(map(sum, kept)) - excess, 0.0)

    def _kept_layers(self, keep: int, tokens: int, seq: int, extra: bool = True) -> list[float]:
        """Per layer, what it holds kept by a forward that keeps the last ``keep`` layers (0 where it recomputes); the
        forward's correction (``extra``) on its lowest kept layer, alive whenever any of them is."""
        layers = len(self.layers)
        keep = max(0, min(keep, layers))
        values = [0.0] * layers
        if keep:
            costs = self.layer_costs(tokens, seq)
            for position in range(layers - keep, layers):
                values[position] = costs[position] or 0.0
            values[layers - keep] += self.extra(tokens) if extra else 0.0
        return values

    def _key(self, forwards: list[tuple[int, int, int]], whole: bool = False) -> Any:
        """The key of :attr:`profiles` where steps are read in segments, else (``whole``) of :attr:`read_growths`."""
        buckets = {length_bucket(seq) for _, _, seq in forwards}  # under compile: neither (docs/keep-model.md)
        usable = len(buckets) == 1 and not self.compiled and self.segmented != whole
        return (buckets.pop(), len(forwards)) if usable else None

    def _plan_sum(self, keeps: Sequence[int], tokens: int, seq: int) -> float:  # what a plan's kept layers save
        return sum(sum(self._kept_layers(keep, tokens, seq)) for keep in keeps)

    def _profile(self, forwards: list[tuple[int, int, int]]) -> Profile | None:
        key = self._key(forwards)
        return self.profiles.get(key) if key is not None else None

    def wants_profile(self, tokens: int, seq: int) -> bool:
        """Whether this forward should mark the step: its length has no profile for the forwards alive together, or
        an earlier forward of its group marks (a group's profile needs every forward's marks)."""
        marks = self.segmented and not self.compiled and tokens > 0 and bool(self.layers)
        return marks and (any(f.measured for f in self._group) or self.profiles.wants((length_bucket(seq), self.alive)))

    def held(self, tokens: int, seq: int) -> float:
        """What the forwards since the last backward hold beyond the prediction for the next one, keeping nothing: their
        kept layers' growth in the group it joins, and :meth:`beyond`."""
        return self.growth([*((f.keep, f.tokens, f.seq) for f in self._group), (0, tokens, seq)]) + self.beyond()

    def beyond(self) -> float:
        """The footprints of the forwards alive since the last backward that the prediction (learned with at most
        ``alive`` forwards alive together) does not cover: the largest ``len(group) + 1 - alive`` of them."""
        extra = len(self._group) + 1 - self.alive
        if extra <= 0:
            return 0.0
        return sum(sorted((f.footprint for f in self._group), reverse=True)[:extra])

    def forward(
        self,
        tokens: int,
        seq: int,
        keep: int,
        plain: float | None,
        footprint: float = 0.0,
        key: object = None,
        measured: bool = False,
    ) -> None:
        """The forward about to run keeps the last ``keep`` layers; ``plain``: the all-recompute peak predicted;
        ``footprint``: what it holds until its backward, every layer recomputing (its checkpointed inputs, logits
        and loss graph), as the config's per-token terms estimate it; ``key``: how its marks name it; ``measured``:
        it counts its layers and marks the step."""
        growth = self.growth([*[(f.keep, f.tokens, f.seq) for f in self._group], (keep, tokens, seq)])
        beyond = self.beyond()
        self._group.append(Forward(tokens, seq, keep, plain, footprint, beyond, key, measured, growth))

    def backward(self) -> None:
        """A backward ran: the forwards before it are freed."""
        if self._group:
            self._groups.append(self._group)
            self._group = []

    def rerun(self) -> None:
        """The step ran out of memory and is rerun from its start: its forwards so far are freed."""
        self._group, self._groups = [], []

    # ---- the reading ----------------------------------------------------------------------------------

    def end_step(
        self, reading: float | None, clean: bool = True, segments: list[tuple[Any, float]] | None = None
    ) -> None:
        """Close a step: learn the forwards alive together, compare the reading with the plan (``clean``: a sample
        of training alone), read the whole step or the profiles of the groups that marked it (``segments``: the
        probe's, :func:`~autooffload.decide.growth.read_profile`), and set :attr:`reading_kept_bytes`."""
        groups = [*self._groups, *([self._group] if self._group else [])]
        self._groups, self._group = [], []
        if groups:
            self._recent_alive = [*self._recent_alive, max(len(g) for g in groups)][-ALIVE_WINDOW:]
            self.alive = max(self._recent_alive)
        if reading is not None and groups:
            self.longest_read_tokens = max(self.longest_read_tokens, max(f.tokens for g in groups for f in g))
        predicted = [(self._predicted(g), g) for g in groups]
        total, group = max(predicted, key=_highest, default=(None, []))  # the forwards at the peak
        if reading is not None and clean and predicted:
            self.closed_loop.age(self._compare(reading, predicted))
            self._read_whole(reading, total, group)
        if self.segmented and not self.compiled and any(f.measured for g in groups for f in g):
            self.segmented = segments is not None  # None: the probe reads no segments
            for group in groups if segments is not None and clean else ():
                self._read_profile(group, segments)
        # One planned without a prediction may hold the peak: then nothing kept is subtracted.
        self.reading_kept_bytes = self.growth([(f.keep, f.tokens, f.seq) for f in group]) if total is not None else 0.0

    def _read_profile(self, group: list[Forward], segments: list[tuple[Any, float]]) -> None:
        """A group whose every forward marked the step: its profile, at its length and number of forwards."""
        forwards = [(f.keep, f.tokens, f.seq) for f in group]
        key = self._key(forwards)
        if key is None or not any(f.measured for f in group) or not self.profiles.wants(key):
            return
        self.profiles.tried(key)
        kept = [self._kept_layers(f.keep, f.tokens, f.seq, extra=False) for f in group]
        tokens = max(f.tokens for f in group)
        profile = read_profile(segments, [f.key for f in group], len(self.layers), kept, tokens)
        if profile is not None and all(f.measured for f in group):
            self.profiles.add(key, profile)

    @staticmethod
    def _predicted(group: list[Forward], growth: float | None = None) -> float | None:
        plains = [f.plain for f in group if f.plain is not None]
        beyond = max((f.beyond for f in group), default=0.0)
        return max(plains) + (group[-1].growth if growth is None else growth) + beyond if plains else None

    def _compare(self, reading: float, predicted: list[tuple[float | None, list[Forward]]]) -> set[int]:
        """Compare a clean reading with the plan of a step; returns the corrections it tested (those reaching the
        tokens of a forward that kept). A miss is the group's the plan predicted highest (one planned without a
        prediction, an offloading micro-batch, may be that one: then nothing is charged or eased). Without a miss,
        each group that kept shows at most what its kept forwards needed; the corrections reaching it ease to that."""
        kept = [(total, g) for total, g in predicted if any(f.keep for f in g)]
        if not kept:
            return set()
        tested = {t for _, g in kept for f in g if f.keep for t in self.closed_loop.reaching(f.tokens)}
        total, group = max(predicted, key=_highest)
        if total is None:
            return tested
        if reading > total * (1 + MISS_TOLERANCE):
            forwards_kept = [(f.keep, f.tokens, f.seq) for f in group]
            if any(f.keep for f in group) and self._distrust(forwards_kept):  # the sum of what they save plans there
                total = self._predicted(group, sum(map(sum, (self._kept_layers(*f) for f in forwards_kept))))
                if total is None or reading <= total * (1 + MISS_TOLERANCE):
                    return tested
            if any(f.keep for f in group):  # else the all-recompute peak was short: the policy's to learn
                tokens, forwards = max(f.tokens for f in group), sum(1 for f in group if f.keep)
                self.closed_loop.missed(tokens, (reading - total) / forwards)
            return tested
        needed: dict[int, float] = {}
        for total, g in kept:
            tokens, forwards = max(f.tokens for f in g), sum(1 for f in g if f.keep)
            need = max(self.extra(tokens) + (reading - total) / forwards, 0.0)  # type: ignore[operator]
            for t in self.closed_loop.reaching(tokens):
                needed[t] = max(needed.get(t, 0.0), need)  # at most what the group needed, per kept forward
        self.closed_loop.clean(needed)
        return tested

    def _distrust(self, forwards: list[tuple[int, int, int]]) -> bool:
        """A reading above the plan of ``forwards``: drop the profile or whole steps' readings it stood on, if any."""
        if (key := self._key(forwards)) is not None:
            return self.profiles.distrust(key)
        whole, keeps, tokens = self._key(forwards, whole=True), [f[0] for f in forwards], max(f[1] for f in forwards)
        return whole is not None and self.read_growths.missed(whole, keeps, tokens, self._plan_sum)

    def _read_whole(self, reading: float, total: float | None, group: list[Forward]) -> None:
        """What the kept layers of the group predicted highest added to a clean step read whole, against their sum;
        where each forward was planned on a prediction (no offload, nothing beyond it) and counted nothing."""
        forwards = [(f.keep, f.tokens, f.seq) for f in group]
        key, unplanned = self._key(forwards, whole=True), any(f.measured or f.plain is None or f.beyond for f in group)
        if key is None or total is None or unplanned or reading > total * (1 + MISS_TOLERANCE):
            return
        bound = sum(map(sum, (self._kept_layers(*f) for f in forwards)))
        added = max(reading - (total - group[-1].growth), 0.0)
        tokens, seq = min(f.tokens for f in group), min(f.seq for f in group)
        self.read_growths.add(key, [f.keep for f in group], tokens, seq, added, bound)

    # ---- resume ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "layers": [model.state_dict() for model in self.layers],
            "alive": self._recent_alive,
            **self.closed_loop.state_dict(),
            "longest_read_tokens": self.longest_read_tokens,
            "reading_kept_bytes": self.reading_kept_bytes,
            "profiles": self.profiles.state_dict(),
            "segmented": self.segmented,
            "read_growths": self.read_growths.state_dict(),
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
        self.closed_loop = Corrections()
        self.closed_loop.load_state_dict(state)
        self.longest_read_tokens = int(state.get("longest_read_tokens", 0))
        self.reading_kept_bytes = float(state.get("reading_kept_bytes", 0.0))
        self.profiles.load_state_dict(state.get("profiles") or {})
        self.segmented = self.segmented and bool(state.get("segmented", True))
        self.read_growths.load_state_dict(state.get("read_growths") or {})
        self._version += 1


def _highest(entry: tuple[float | None, list[Forward]]) -> float:
    """Orders groups by their predicted peak; one without a prediction first (it may hold the peak)."""
    return math.inf if entry[0] is None else entry[0]
