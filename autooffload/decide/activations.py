"""What a checkpointed layer holds for its backward when it runs without checkpointing: the memory model of keep.

Recomputing a layer keeps only its input until the backward; keeping it (no checkpoint, no recompute) keeps
everything its operations save for their gradients: normalised activations, projections, the MLP's
intermediates, the attention's softmax statistics, and with eager attention (or dropout) the attention
probabilities, a term in ``seq^2``; under autocast also the low-precision casts of its weights (a
matmul saves the cast weight for the input's gradient), a constant that does not shrink with the tokens.
What keeping a layer adds to the step's memory is that, less the input the checkpoint would have held anyway.

One :class:`KeptLayerModel` per layer (layers differ: a hybrid stack's state-space and attention layers, dense
and MoE layers, a wider last MLP): ``bytes = constant + a x tokens + b x tokens x seq``. The constant is known
by construction: the layer's matrix weights x the autocast dtype's bytes when a measurement ran under autocast
(0 without), and before any measurement the cast to 2 bytes of fp32 weights (the usual mixed-precision recipe;
an over-estimate otherwise). The rest is measured, not guessed: the controller counts, once per length and
layer, what the kept layer saved (saved-tensor hooks that count and pass tensors through, each storage once,
parameters and the call's inputs excluded) and fits ``a`` and ``b`` over the lengths seen, less the
constant (``b`` is the attention term; it fits to 0 where the attention saves nothing quadratic). Until a
measurement exists, the layer type's arithmetic seeds it (:class:`LayerShape`): for a Qwen3 decoder layer in
fp32 with SDPA on a CPU (torch 2.13) it equals the count on transformers 4.52.4 and is 2 x hidden x
dtype-bytes per token above it on 5.23 (which saves one hidden-sized tensor less); it errs on the high side
elsewhere. Pure: no torch, no clock, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

# Hyper-connection models carry several residual streams through every layer (input [batch, seq, streams,
# hidden]); the config names the stream count under one of these keys.
STREAM_KEYS = ("hc_mult", "hc_count")


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """A decoder layer's sizes, for the seed. ``quadratic``: the attention saves its probabilities (eager
    attention, or attention dropout), a term in ``seq^2``; ``dropout``: attention dropout is on."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    quadratic: bool = False
    dropout: bool = False

    @classmethod
    def from_config(cls, config: Any, dtype_bytes: int) -> LayerShape | None:
        """From a transformers config (or a multimodal one's text config); None without the sizes it needs."""
        text = getattr(config, "text_config", None)
        if text is not None and getattr(config, "hidden_size", None) is None:
            config = text
        hidden = getattr(config, "hidden_size", None)
        if not isinstance(hidden, int):
            return None
        heads = _int(config, "num_attention_heads", 1)
        kv_heads = _int(config, "num_key_value_heads", heads)
        head_dim = _int(config, "head_dim", hidden // max(heads, 1))
        intermediate = _int(config, "intermediate_size", 4 * hidden)
        dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0
        eager = getattr(config, "_attn_implementation", None) == "eager"
        return cls(hidden, intermediate, heads, kv_heads, head_dim, dtype_bytes, eager or dropout, dropout)

    def bytes_per_token(self) -> float:
        """The linear term: what one token's activations in one layer take, beyond the layer's input."""
        d, q, kv = self.dtype_bytes, self.heads * self.head_dim, self.kv_heads * self.head_dim
        linear = d * (7 * self.hidden + 4 * self.intermediate + 4 * q + 4 * kv)
        statistics = 4 * (2 * self.heads + self.kv_heads + 2)  # norms' and attention's fp32 row statistics
        upcast = 4 * (2 * self.hidden + q + kv) if d < 4 else 0  # norms compute in fp32 below fp32
        eager = 2 * d * q if self.quadratic else 0
        return float(linear + statistics + upcast + eager)

    def bytes_per_token_and_position(self) -> float:
        """The attention term, per token and per position attended: probabilities (fp32 softmax, and its
        cast below fp32), and with dropout its mask and output."""
        if not self.quadratic:
            return 0.0
        d = self.dtype_bytes
        per_head = 4 + (d if d < 4 else 0) + (2 * max(d, 4) if self.dropout else 0)
        return float(self.heads * per_head)

    def bytes(self, tokens: int, seq: int) -> float:
        return tokens * self.bytes_per_token() + tokens * seq * self.bytes_per_token_and_position()


def _int(config: Any, name: str, default: int) -> int:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


# Lengths are measured per bucket of sequence lengths, this many buckets per doubling (about 9% wide): the
# model's state and a decision's cost stay bounded however many distinct lengths a run meets (padding-free and
# packed batches make thousands), and one count per bucket is all the fit needs.
BUCKETS_PER_OCTAVE = 8


def length_bucket(length: int) -> int:
    """The bucket of a length: ``floor(log2(length) x BUCKETS_PER_OCTAVE)`` (-1 for no tokens)."""
    return math.floor(math.log2(length) * BUCKETS_PER_OCTAVE) if length > 0 else -1


class KeptLayerModel:
    """Bytes one kept layer adds for a micro-batch of ``tokens`` (batch x seq) at sequence length ``seq``.

    ``seed``: the arithmetic used until a measurement exists (None: nothing is known, nothing predicted);
    ``weights``: the layer's matrix-weight elements (what autocast casts); ``weight_bytes``: their dtype's bytes.
    Measurements are exact counts, so the fit through them is exact where the layer's saves are a constant plus
    terms linear in tokens and in tokens x seq; a length between or beyond those measured is read off the fit,
    and never below the seed scaled by the largest measured-to-seed ratio, so one measurement already corrects
    the seed. One measurement is kept per bucket of sequence lengths (:func:`length_bucket`): of two in one
    bucket, the one that needs more bytes per token (what the fit must stay above). The fit is computed once
    per change, not per prediction.
    """

    def __init__(self, seed: LayerShape | None = None, weights: int = 0, weight_bytes: int = 0) -> None:
        self.seed = seed
        self.weights = weights
        self.weight_bytes = weight_bytes
        self.cast_bytes: int | None = None  # the autocast dtype's bytes at the last measurement; 0: none
        self.samples: dict[tuple[int, int], float] = {}  # (tokens, seq) -> bytes measured, one per seq bucket
        self._buckets: dict[int, tuple[int, int]] = {}  # seq bucket -> its sample's key
        self._fitted: tuple[Any, list[tuple[float, float]]] | None = None  # (what it was for, the forms)

    @property
    def constant(self) -> float:
        """The bytes a kept layer saves whatever the tokens: its weights' casts under autocast."""
        if self.cast_bytes is None:  # not measured yet: fp32 weights are assumed cast to 2 bytes
            return float(self.weights * 2) if self.weight_bytes > 2 else 0.0
        return float(self.weights * self.cast_bytes) if self.cast_bytes < self.weight_bytes else 0.0

    def wants(self, tokens: int, seq: int) -> bool:
        """True when no measurement exists in this length's bucket: the layer should be counted the next time it
        keeps."""
        return tokens > 0 and length_bucket(seq) not in self._buckets

    def add(self, tokens: int, seq: int, nbytes: float, cast_bytes: int = 0) -> None:
        """A count of what the layer saved at this length; ``cast_bytes``: the autocast dtype's bytes (0: off)."""
        if tokens <= 0:
            return
        self.cast_bytes = max(cast_bytes, self.cast_bytes or 0)
        key, bucket = (tokens, seq), length_bucket(seq)
        value = max(float(nbytes), self.samples.get(key, 0.0))
        held = self._buckets.get(bucket)
        if held is not None and held != key:
            constant = self.constant
            if (value - constant) / tokens < (self.samples[held] - constant) / held[0]:
                return  # the bucket's sample needs more per token: the fit stays above this one too
            del self.samples[held]
        self.samples[key] = value
        self._buckets[bucket] = key
        self._fitted = None

    @property
    def measured(self) -> bool:
        return bool(self.samples)

    def predict(self, tokens: int, seq: int) -> float | None:
        """Bytes this kept layer adds at this length; None when there is neither a measurement nor a seed."""
        measured = self.samples.get((tokens, seq))
        if measured is not None:
            return measured
        constant = self.constant
        forms = self._forms(constant)
        return constant + max(a * tokens + b * (tokens * seq) for a, b in forms) if forms else None

    def variable(self, tokens: int, seq: int) -> float | None:
        """The part that grows with the tokens (the prediction less the constant)."""
        constant = self.constant
        if (tokens, seq) in self.samples:
            return max(self.samples[(tokens, seq)] - constant, 0.0)
        forms = self._forms(constant)
        return max(a * tokens + b * (tokens * seq) for a, b in forms) if forms else None

    def _forms(self, constant: float) -> list[tuple[float, float]]:
        """The candidates of a prediction away from the samples, each ``a x tokens + b x tokens x seq``: the fit
        through the samples, else the seed scaled by the largest measured-to-seed ratio (the seed itself before a
        measurement), else the most bytes per token measured. Computed once per change of the samples, the
        constant or the seed, so that a prediction costs the same however many lengths were measured."""
        basis = (constant, self.seed)
        if self._fitted is not None and self._fitted[0] == basis:
            return self._fitted[1]
        samples = {key: max(y - constant, 0.0) for key, y in self.samples.items()}
        forms = []
        fit = _fit(samples)
        if fit is not None:
            forms.append(fit)
        if self.seed is not None:
            per_token, per_position = self.seed.bytes_per_token(), self.seed.bytes_per_token_and_position()
            ratios = [y / self.seed.bytes(t, s) for (t, s), y in samples.items() if self.seed.bytes(t, s) > 0]
            if not ratios:
                forms.append((per_token, per_position))
            elif fit is None:
                forms.append((per_token * max(ratios), per_position * max(ratios)))
        if not forms and samples:
            forms.append((max(y / t for (t, _), y in samples.items()), 0.0))
        self._fitted = (basis, forms)
        return forms

    def state_dict(self) -> dict[str, Any]:
        return {"samples": [[t, s, y] for (t, s), y in self.samples.items()], "cast_bytes": self.cast_bytes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A state from :meth:`state_dict`; one saved before the buckets (a sample per length) keeps, per bucket,
        the sample that needs the most per token."""
        cast = state.get("cast_bytes")
        self.cast_bytes = None if cast is None else int(cast)
        self.samples, self._buckets, self._fitted = {}, {}, None
        for t, s, y in state.get("samples", []):
            self.add(int(t), int(s), float(y), self.cast_bytes or 0)
        self.cast_bytes = None if cast is None else int(cast)


def _fit(samples: dict[tuple[int, int], float]) -> tuple[float, float] | None:
    """Least squares of bytes / tokens = a + b x seq over the measured lengths; None with fewer than two."""
    points = [(s, y / t) for (t, s), y in samples.items()]
    if len({s for s, _ in points}) < 2:
        return None
    n = len(points)
    mean_s = sum(s for s, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((s - mean_s) ** 2 for s, _ in points)
    b = max(sum((s - mean_s) * (y - mean_y) for s, y in points) / var, 0.0)
    a = max(max(y - b * s for s, y in points), 0.0)  # the upper line: never below a measured point
    return a, b


def stack_costs(layers: Sequence[KeptLayerModel], tokens: int, seq: int) -> list[float | None]:
    """What keeping each layer of a stack adds at this length; None where nothing is known. A layer not measured yet
    costs the most any measured layer costs at this length, scaled up by its share of matrix weights, and never less
    than its own seed: a layer of another kind (a wider one, a Mamba layer) is not planned below the widest known."""
    own = [model.predict(tokens, seq) for model in layers]
    known = [
        (max(c - m.constant, 0.0), m.weights) for c, m in zip(own, layers, strict=True) if m.measured and c is not None
    ]
    most = max((v for v, _ in known), default=None)
    most_per_weight = max((v / w for v, w in known if w), default=None)
    costs = list(own)
    for position, model in enumerate(layers):
        if model.measured or most is None:
            continue
        borrowed = most
        if model.weights and most_per_weight is not None:
            borrowed = max(most, model.weights * most_per_weight)
        costs[position] = max(model.constant + borrowed, own[position] or 0.0)
    return costs
