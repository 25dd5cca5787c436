"""The memory model: a step's peak bytes as a function of its largest micro-batch's tokens, nothing offloaded.

Pure arithmetic over samples (no torch, no clock, no I/O), shared by the predictive policy and anything that
plans in bytes. Its pieces, each a method or a function here:

- the **per-token terms computable from a model's config** (:func:`logits_bytes_per_token`,
  :func:`layer_work_bytes_per_token`, :func:`optimizer_state_factor`): the controller computes them once and
  passes them in the :class:`~autooffload.decide.policy.Observation`;
- the **floor** of the slope, the checkpointed inputs alone (layers x bytes per layer input per token): bytes
  certainly held per token; the **seed**, the floor plus the logits terms plus one layer's recompute working
  set: at the start of the backward the loss's buffers, every input and the last layer's recompute are alive
  together (measured as the step's real peak, the allocator's, on a CPU: a 4-layer Qwen3 of hidden 64 grows by
  8.5 KB per token from 256 to 2048 tokens, the three terms sum to 8.4 KB; their larger alone, 6.4 KB, left
  the first long micro-batch over the budget);
- the **samples**, (tokens, peak as if nothing had been offloaded, exact), one per finished step; a sample
  that is only a lower bound (a rescued step) is not exact;
- the **inside slope**: the least-squares slope of the exact samples, at least the floor;
- the **upper line**: for a length within those seen, the highest of the lines through every sample with the
  inside slope. For a linear need it is never below the need, whatever the slope, because the line through
  the nearest sample on one side or the other is above it; so a sample is exact for its own length, and the
  slope only changes how much is planned between samples;
- the **extrapolation** beyond the longest length seen: the upper line there, plus ``(1 + margin)`` times
  the slope for every further token: the inside slope within the span the exact samples cover (beyond the
  longest by at most the distance between the shortest and the longest), the larger of it and the seed
  further out. A longer micro-batch than any seen is where an under-prediction costs an out-of-memory step,
  and the seed (the logits above all) is what a few clustered lengths may not show.

Bytes that the latest reading does not include yet (the optimizer state before the first ``optimizer.step()``)
belong in the sample: the policy adds them when it takes one.
"""

from __future__ import annotations

# A micro-batch longer than any seen is planned with this share more per extra token than the model says.
EXTRAPOLATION_MARGIN = 0.10

# Optimizer state per trainable parameter byte, by class name (torch.optim): Adam's two moments, SGD's momentum.
OPTIMIZER_STATE_FACTORS = {
    "Adam": 2.0,
    "AdamW": 2.0,
    "NAdam": 2.0,
    "RAdam": 2.0,
    "Adamax": 2.0,
    "SGD": 1.0,
    "RMSprop": 1.0,
}


def logits_bytes_per_token(vocab_size: int, dtype_bytes: int) -> float:
    """Bytes per token of the logits at the loss: the logits and their gradient in the model's dtype, and when
    that is below fp32, the fp32 upcast the loss makes and its gradient (12 x vocab for bf16)."""
    return float(vocab_size * (2 * dtype_bytes + (8 if dtype_bytes < 4 else 0)))


def layer_work_bytes_per_token(hidden: int, intermediate: int, dtype_bytes: int) -> float:
    """Bytes per token of one decoder layer's recompute working set: attention projections and MLP activations,
    estimated as (4 x hidden + 3 x intermediate) x dtype-bytes. A floor: where the config gives the layer's shape
    the controller takes the larger of this and what the layer saves kept
    (:meth:`~autooffload.decide.activations.LayerShape.bytes_per_token`), which its recompute makes again and
    its backward works on: measured as the step's real peak on a CPU (the allocator's, 4-layer Qwen3, 1024
    tokens), the working set at the end of the backward is 1.1x that and 2.2x this estimate."""
    return float((4 * hidden + 3 * intermediate) * dtype_bytes)


def optimizer_state_factor(optimizer_name: str, momentum: float | None = None) -> float | None:
    """Optimizer state bytes per trainable parameter byte for a torch.optim class name; None when unknown."""
    if optimizer_name == "SGD" and not momentum:
        return 0.0
    return OPTIMIZER_STATE_FACTORS.get(optimizer_name)


class PeakModel:
    """Samples of a step's peak with nothing offloaded, and the prediction for a micro-batch's tokens.

    ``window``: how many recent samples are kept. ``margin``: the share added per token beyond the longest
    length seen. What a prediction reads of the samples (the fit, the longest and the exact span, the upper line
    for a slope) is computed once per change of the samples, not per prediction: a decision costs the same
    however long the run.
    """

    def __init__(self, window: int = 256, margin: float = EXTRAPOLATION_MARGIN) -> None:
        self.window = window
        self.margin = margin
        self.samples = []

    @property
    def samples(self) -> list[tuple[int, float, bool]]:
        """(tokens, peak as if nothing offloaded, exact), oldest first; assign a new list to replace them."""
        return self._samples

    @samples.setter
    def samples(self, samples: list[tuple[int, float, bool]]) -> None:
        self._samples = samples
        self._changed()

    def add(self, tokens: int, plain_bytes: float, exact: bool) -> None:
        self._samples.append((tokens, float(plain_bytes), exact))
        del self._samples[: -self.window]
        self._changed()

    def _changed(self) -> None:
        self._summary: tuple[float | None, int | None, int | None, int | None, int] | None = None
        self._lines: dict[float, float] = {}

    def _summarised(self) -> tuple[float | None, int | None, int | None, int | None, int]:
        """(least-squares slope of the exact samples or None, longest, shortest and longest exact, exact lengths)."""
        if self._summary is None:
            points = [(t, y) for t, y, exact in self._samples if exact]
            n = len(points)
            mean_t = sum(t for t, _ in points) / n if n else 0.0
            mean_y = sum(y for _, y in points) / n if n else 0.0
            var = sum((t - mean_t) ** 2 for t, _ in points)
            fitted = sum((t - mean_t) * (y - mean_y) for t, y in points) / var if var > 0 else None
            exact = [t for t, _ in points]
            longest = max((t for t, _, _ in self._samples), default=None)
            self._summary = (fitted, longest, min(exact, default=None), max(exact, default=None), len(set(exact)))
        return self._summary

    @property
    def fitted(self) -> bool:
        """Two exact samples of different lengths: the slope is measured, not guessed."""
        return self._summarised()[4] >= 2

    @property
    def longest(self) -> int | None:
        return self._summarised()[1]

    def slope(self, floor: float = 0.0) -> float:
        """The inside slope, bytes per token: least squares over the exact samples, at least ``floor``."""
        fitted = self._summarised()[0]
        return floor if fitted is None else max(fitted, floor)

    def upper_line(self, tokens: int, slope: float) -> float:
        """The highest of the lines of ``slope`` through the samples, at ``tokens``."""
        offset = self._lines.get(slope)
        if offset is None:
            if len(self._lines) > 16:
                self._lines.clear()
            offset = self._lines[slope] = max(y - slope * t for t, y, _ in self._samples)
        return offset + slope * tokens

    def predict(self, tokens: int, floor: float = 0.0, seed: float = 0.0) -> float | None:
        """Peak bytes of a step whose largest micro-batch has ``tokens`` and offloads nothing; None before a sample.

        ``floor`` and ``seed`` are bytes per token (see the module docstring).
        """
        longest = self.longest
        if longest is None:
            return None
        inside = self.slope(floor)
        if tokens <= longest:
            return self.upper_line(tokens, inside)
        beyond = (1 + self.margin) * (inside if self.trusted(tokens) else max(inside, seed, floor))
        return self.upper_line(longest, inside) + beyond * (tokens - longest)

    def trusted(self, tokens: int) -> bool:
        """Whether the fitted slope may extrapolate to ``tokens``: no further beyond the longest exact sample than
        the exact samples span. Clustered lengths measure a slope poorly, and a far length needs the seed."""
        _, _, shortest, longest, _ = self._summarised()
        return self.fitted and tokens - longest <= longest - shortest  # type: ignore[operator]


def slope_terms(
    layers: int,
    tokens: int,
    bytes_per_layer: int | None,
    logits_per_token: float | None = None,
    work_per_token: float | None = None,
) -> tuple[float, float]:
    """(floor, seed) in bytes per token for a micro-batch of ``tokens`` whose layer inputs take
    ``bytes_per_layer`` each; both 0 when the layer inputs are unknown."""
    if not bytes_per_layer or tokens <= 0:
        return 0.0, (logits_per_token or 0.0) + (work_per_token or 0.0)
    floor = layers * bytes_per_layer / tokens
    return floor, floor + (logits_per_token or 0.0) + (work_per_token or 0.0)
