"""The simulated device: the scenarios (a model shape and a device), the memory model of a micro-batch, its
calibration from measured results, the traces of lengths, and the compute time.

Memory model, per micro-batch of T tokens with k of the L layers offloaded (c = hidden x dtype-bytes, what one
layer's checkpointed input takes per token; w = one layer's recompute working set per token, estimated as
(4 x hidden + 3 x intermediate) x dtype-bytes; g = the logits at the loss per token, vocab x 12 bytes in bf16:
the logits, their fp32 upcast and both gradients; 0 for a chunked loss, which never holds them whole):
peak = static + T x (1 + noise) x max(g + (L - f k) c, w + (L - f min(k, L - 1)) c). The first term is the
end of the forward, every kept input alive plus the loss; the second the start of the backward, where the last
layer's input is back on the device for its recompute, so offloading the last layer does not lower it. The
noise (uniform in [0, --noise), drawn per micro-batch from --seed, the same for every policy) stands for
fragmentation. A full fine-tune's optimizer state (``optimizer_state_gib``) is missing from step 0's peak,
as Adam allocates it at the first ``optimizer.step()``; the policies are told so (``pending_bytes``) at step 1,
as the controller tells them. The observations carry the per-token terms the controller computes from a
model's config (the logits, whether or not the loss is chunked, and w). f, the share of a layer input's bytes
that offloading removes from the peak, is 1 by the arithmetic. When a measured results file of
``benchmarks/bench.py`` from a GPU is found (``--results``), its plain peaks calibrate w (the slope over
tokens beyond the checkpointed inputs) and its offloaded peaks f.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
from collections.abc import Iterable
from pathlib import Path

from harness.verdicts import slope as fitted_slope

from autooffload.decide.activations import LayerShape
from autooffload.decide.peak import layer_work_bytes_per_token, logits_bytes_per_token

GIB = 2**30
FIXED_TRACE = Path(__file__).resolve().parents[1] / "traces" / "longtail.txt"


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A model shape and a device: what a step's memory is made of."""

    name: str
    description: str
    layers: int
    hidden: int
    intermediate: int
    params: float
    static_gib: float
    device_gib: float
    dtype_bytes: int = 2
    vocab: int = 151936
    chunked_loss: bool = True
    optimizer_state_gib: float = 0.0
    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128

    @property
    def layer_shape(self) -> LayerShape:
        return LayerShape(self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim, self.dtype_bytes)

    @property
    def layer_params(self) -> float:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate


SCENARIOS = {
    s.name: s
    for s in (
        Scenario(
            "8b-lora-24gb", "Qwen3-8B shape, LoRA on frozen bf16 weights (17 GiB resident), 24 GiB device",
            36, 4096, 12288, 8.2e9, 17.0, 24.0,
        ),
        Scenario(
            "32b-lora-80gb", "Qwen3-32B shape, LoRA on frozen bf16 weights (63 GiB resident), 80 GiB device",
            64, 5120, 25600, 32.8e9, 63.0, 80.0, heads=64,
        ),
        Scenario(
            "8b-fsdp-80gb",
            "Qwen3-8B shape, full fine-tune sharded (30 GiB resident per GPU), 80 GiB device: room to spare",
            36, 4096, 12288, 8.2e9, 30.0, 80.0, optimizer_state_gib=8.0,
        ),
        Scenario(
            "8b-lora-80gb-logits",
            "Qwen3-8B shape, LoRA (17 GiB resident), 80 GiB device, the loss not chunked: 1.8 MB of logits per token",
            36, 4096, 12288, 8.2e9, 17.0, 80.0, chunked_loss=False,
        ),
    )
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Factors on the arithmetic, 1.0 where nothing was measured."""

    work_scale: float = 1.0
    freed_fraction: float = 1.0
    bandwidth: float | None = None
    source: str = "arithmetic only (no measured GPU results found)"


class MemoryModel:
    """Peak bytes of a micro-batch, from the scenario's arithmetic and the calibration."""

    def __init__(self, scenario: Scenario, calibration: Calibration) -> None:
        s = scenario
        self.scenario = s
        self.layers = s.layers
        self.layer_bytes_per_token = s.hidden * s.dtype_bytes
        self.work_seed = layer_work_bytes_per_token(s.hidden, s.intermediate, s.dtype_bytes)
        self.logits_seed = logits_bytes_per_token(s.vocab, s.dtype_bytes)
        self.work_per_token = calibration.work_scale * self.work_seed
        self.loss_per_token = 0.0 if s.chunked_loss else self.logits_seed
        self.freed = calibration.freed_fraction
        self.static = s.static_gib * GIB
        self.state = s.optimizer_state_gib * GIB
        self.total = int(s.device_gib * GIB)

    def peak(
        self, tokens: int, level: int, noise: float = 0.0, step: int = 1, keep: int = 0, seq: int | None = None
    ) -> float:
        """The true peak; at step 0 without the optimizer state, which the first optimizer step allocates;
        ``keep`` layers kept add their activations (at sequence length ``seq``)."""
        c, layers, f = self.layer_bytes_per_token, self.layers, self.freed
        forward_end = self.loss_per_token + (layers - f * level) * c
        backward_start = self.work_per_token + (layers - f * min(level, layers - 1)) * c
        static = self.static - (self.state if step == 0 else 0.0)
        kept = keep * self.kept_bytes(tokens, seq or tokens // self.scenario.batch) if keep else 0.0
        return static + (tokens * max(forward_end, backward_start) + kept) * (1 + noise)

    def kept_bytes(self, tokens: int, seq: int) -> float:
        """What keeping one layer adds to the peak for a micro-batch (its activations beyond its input)."""
        return self.scenario.layer_shape.bytes(tokens, seq)


# ---- traces -----------------------------------------------------------------------------------------------


def read_trace(path: Path) -> list[int]:
    """One sequence length per line; ``#`` starts a comment."""
    lengths = []
    for line in path.read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if text:
            lengths.append(int(text))
    return lengths


def longtail(seed: int, steps: int = 2000) -> list[int]:
    """Log-normal lengths (median 2048, sigma 1.1), clipped to [128, 32768], rounded up to a multiple of 64."""
    rng = random.Random(seed)
    return [min(32768, max(128, 64 * math.ceil(rng.lognormvariate(math.log(2048), 1.1) / 64))) for _ in range(steps)]


def bursty(seed: int, steps: int = 2000) -> list[int]:
    """Mostly short lengths (median 1024), with runs (8 steps on average) of long ones between 8k and 32k."""
    rng = random.Random(seed)
    lengths, long_run = [], 0
    for _ in range(steps):
        if long_run == 0 and rng.random() < 0.02:
            long_run = 1 + int(rng.expovariate(1 / 8))
        if long_run:
            long_run -= 1
            lengths.append(64 * rng.randint(8192 // 64, 32768 // 64))
        else:
            lengths.append(min(32768, max(128, 64 * math.ceil(rng.lognormvariate(math.log(1024), 0.6) / 64))))
    return lengths


def packed(length: int, steps: int = 300) -> list[int]:
    """Packing (or ``padding="max_length"``) to one length: every micro-batch the same."""
    return [length] * steps


# ---- calibration from measured results ---------------------------------------------------------------------


def calibrate(paths: Iterable[Path]) -> Calibration:
    """Fit w, f and the copy bandwidth from the plain and ``on`` rows of GPU results of ``benchmarks/bench.py``."""
    scales, fractions, bandwidths, used = [], [], [], []
    for path in paths:
        try:
            data = json.loads(path.read_text())
            plan, rows = data["plan"], data["rows"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if data.get("device") == "cpu":
            continue
        dtype_bytes = {"bf16": 2, "fp16": 2, "fp32": 4}.get(plan.get("dtype"), 2)
        vocab = plan.get("vocab", 0)
        shapes = {(r["layers"], r["hidden"]) for r in rows if r.get("peak_bytes")}
        for layers, hidden in shapes:
            mine = [r for r in rows if (r["layers"], r["hidden"]) == (layers, hidden) and r.get("peak_bytes")]
            plain = {r["seq"] * r.get("batch", 1): r for r in mine if r["mode"] == "checkpointing"}
            on = {r["seq"] * r.get("batch", 1): r for r in mine if r["mode"] == "on"}
            c = hidden * dtype_bytes
            if len(plain) >= 2:
                tokens = sorted(plain)
                slope = fitted_slope([(t, plain[t]["peak_bytes"]) for t in tokens])
                estimate = (4 * hidden + 3 * 3 * hidden) * dtype_bytes + vocab * (dtype_bytes + 4)
                scales.append(max(slope - layers * c, 0.0) / estimate)
            for t in sorted(set(plain) & set(on)):
                freed = plain[t]["peak_bytes"] - on[t]["peak_bytes"]
                fractions.append(min(max(freed / ((layers - 1) * c * t), 0.0), 1.0))
                extra = on[t].get("median_s", 0) - plain[t].get("median_s", 0)
                if extra > 0 and on[t].get("packed_bytes"):
                    bandwidths.append(2 * on[t]["packed_bytes"] / extra)
        used.append(str(path))
    if not (scales or fractions):
        return Calibration()
    return Calibration(
        work_scale=statistics.median(scales) if scales else 1.0,
        freed_fraction=statistics.median(fractions) if fractions else 1.0,
        bandwidth=statistics.median(bandwidths) if bandwidths else None,
        source="measured: " + ", ".join(used),
    )


# ---- compute time -----------------------------------------------------------------------------------------


def layer_forward_seconds(scenario: Scenario, seq: int, flops: float) -> float:
    """One layer's forward for a micro-batch: what recomputing it costs (dense, causal attention)."""
    s = scenario
    return (2 * s.layer_params * s.batch * seq + 2 * s.hidden * s.batch * seq * seq) / flops


def compute_seconds(scenario: Scenario, lengths: list[int], flops: float) -> list[float]:
    s = scenario
    return [(8 * s.params * s.batch * seq + 8 * s.layers * s.hidden * s.batch * seq * seq) / flops for seq in lengths]
