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


class KeptLayerModel:
    """Bytes one kept layer adds for a micro-batch of ``tokens`` (batch x seq) at sequence length ``seq``.

    ``seed``: the arithmetic used until a measurement exists (None: nothing is known, nothing predicted);
    ``weights``: the layer's matrix-weight elements (what autocast casts); ``weight_bytes``: their dtype's bytes.
    Measurements are exact counts, so the fit through them is exact where the layer's saves are a constant plus
    terms linear in tokens and in tokens x seq; a length between or beyond those measured is read off the fit,
    and never below the seed scaled by the largest measured-to-seed ratio, so one measurement already corrects
    the seed.
    """

    def __init__(self, seed: LayerShape | None = None, weights: int = 0, weight_bytes: int = 0) -> None:
        self.seed = seed
        self.weights = weights
        self.weight_bytes = weight_bytes
        self.cast_bytes: int | None = None  # the autocast dtype's bytes at the last measurement; 0: none
        self.samples: dict[tuple[int, int], float] = {}  # (tokens, seq) -> bytes measured

    @property
    def constant(self) -> float:
        """The bytes a kept layer saves whatever the tokens: its weights' casts under autocast."""
        if self.cast_bytes is None:  # not measured yet: fp32 weights are assumed cast to 2 bytes
            return float(self.weights * 2) if self.weight_bytes > 2 else 0.0
        return float(self.weights * self.cast_bytes) if self.cast_bytes < self.weight_bytes else 0.0

    def wants(self, tokens: int, seq: int) -> bool:
        """True when no measurement exists at this length: the layer should be counted the next time it keeps."""
        return tokens > 0 and (tokens, seq) not in self.samples

    def add(self, tokens: int, seq: int, nbytes: float, cast_bytes: int = 0) -> None:
        """A count of what the layer saved at this length; ``cast_bytes``: the autocast dtype's bytes (0: off)."""
        if tokens > 0:
            self.cast_bytes = max(cast_bytes, self.cast_bytes or 0)
            self.samples[(tokens, seq)] = max(float(nbytes), self.samples.get((tokens, seq), 0.0))

    @property
    def measured(self) -> bool:
        return bool(self.samples)

    def predict(self, tokens: int, seq: int) -> float | None:
        """Bytes this kept layer adds at this length; None when there is neither a measurement nor a seed."""
        if (tokens, seq) in self.samples:
            return self.samples[(tokens, seq)]
        variable = self.variable(tokens, seq)
        return None if variable is None else self.constant + variable

    def variable(self, tokens: int, seq: int) -> float | None:
        """The part that grows with the tokens (the prediction less the constant)."""
        constant = self.constant
        samples = {key: max(y - constant, 0.0) for key, y in self.samples.items()}
        if (tokens, seq) in samples:
            return samples[(tokens, seq)]
        candidates = []
        fit = _fit(samples)
        if fit is not None:
            a, b = fit
            candidates.append(a * tokens + b * tokens * seq)
        if self.seed is not None:
            seed = self.seed.bytes(tokens, seq)
            ratios = [y / self.seed.bytes(t, s) for (t, s), y in samples.items() if self.seed.bytes(t, s) > 0]
            if ratios and fit is None:
                candidates.append(seed * max(ratios))
            elif not ratios:
                candidates.append(seed)
        if not candidates and samples:
            per_token = max(y / t for (t, _), y in samples.items())
            candidates.append(per_token * tokens)
        return max(candidates) if candidates else None

    def state_dict(self) -> dict[str, Any]:
        return {"samples": [[t, s, y] for (t, s), y in self.samples.items()], "cast_bytes": self.cast_bytes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples = {(int(t), int(s)): float(y) for t, s, y in state.get("samples", [])}
        cast = state.get("cast_bytes")
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
