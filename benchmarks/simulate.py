"""Replay micro-batch lengths against a simulated device and compare offload policies, without a GPU.

    python benchmarks/simulate.py --out DIR [--scenario NAME ...] [--trace FILE ...] [--seeds 1 2]

Policies, each driven step by step through autooffload's own classes (the same ``Observation`` the
controller builds, the same ``decide``):

- ``never``: plain checkpointing; ``always``: every layer, every step;
- ``threshold``: :class:`~autooffload.decide.policy.HysteresisPolicy` with the default settings (memory >= 90% of
  the last step, or a sequence of 32768 tokens, turns all layers on);
- ``predictive``: :class:`~autooffload.decide.predictive.PredictivePolicy` with the default settings, partial offload;
- ``predictive, compiled``: the same, held to the levels the controller allows under torch.compile;
- ``ladder``: the predictive policy with ``recompute="auto"``: where it offloads nothing, the last layers keep
  (no checkpointing, no recompute) as far as :func:`autooffload.decide.ladder.plan` fits them under the same
  90% less its margin, from lengths a reading has covered;
- ``oracle``: knows every step's true peak and offloads the fewest layers that keep it at or below the
  same 90% (or, where nothing can, at or below the device's size).

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

A step whose peak passes the device's size counts as an out-of-memory step and is rescued as
:mod:`autooffload.rescue` does: rerun with every layer offloaded (its bytes are counted; the failed attempt
costs a step's compute); its reading is the device's size. Time: the sync engine copies every offloaded
byte out in the forward and back in the backward on the compute stream, 2 x bytes / --bandwidth; compute is
(8 x params x tokens + 8 x layers x hidden x batch x seq^2) / --flops (forward, recompute and backward,
dense and causal attention). Both are stated estimates, not measurements. The recompute is the middle part:
one layer's forward, (2 x layer params x tokens + 2 x hidden x batch x seq^2) / --flops, per recomputed layer
and micro-batch; a kept layer does not pay it, and adds its activations to the peak, (kept bytes per token
from the layer type's arithmetic, :class:`autooffload.decide.activations.LayerShape`) x T x (1 + noise). The
time column compares each policy's total (compute less the recompute it skipped, plus copies and failed
attempts) with plain checkpointing's (``never``: compute alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import random
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.verdicts import slope as fitted_slope

from autooffload.decide import ladder
from autooffload.decide.activations import LayerShape
from autooffload.decide.peak import layer_work_bytes_per_token, logits_bytes_per_token
from autooffload.decide.policy import HysteresisPolicy, Observation
from autooffload.decide.predictive import PredictivePolicy, compile_levels
from autooffload.settings import Settings

GIB = 2**30
HERE = Path(__file__).resolve().parent
FIXED_TRACE = HERE / "traces" / "longtail.txt"
POLICIES = ("never", "always", "threshold", "predictive", "predictive, compiled", "ladder", "oracle")


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
            "8b-lora-24gb",
            "Qwen3-8B shape, LoRA on frozen bf16 weights (17 GiB resident), 24 GiB device",
            36,
            4096,
            12288,
            8.2e9,
            17.0,
            24.0,
        ),
        Scenario(
            "32b-lora-80gb",
            "Qwen3-32B shape, LoRA on frozen bf16 weights (63 GiB resident), 80 GiB device",
            64,
            5120,
            25600,
            32.8e9,
            63.0,
            80.0,
            heads=64,
        ),
        Scenario(
            "8b-fsdp-80gb",
            "Qwen3-8B shape, full fine-tune sharded (30 GiB resident per GPU), 80 GiB device: room to spare",
            36,
            4096,
            12288,
            8.2e9,
            30.0,
            80.0,
            optimizer_state_gib=8.0,
        ),
        Scenario(
            "8b-lora-80gb-logits",
            "Qwen3-8B shape, LoRA (17 GiB resident), 80 GiB device, the loss not chunked: 1.8 MB of logits per token",
            36,
            4096,
            12288,
            8.2e9,
            17.0,
            80.0,
            chunked_loss=False,
        ),
    )
}


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


# ---- the replay ----------------------------------------------------------------------------------------------


def oracle_level(model: MemoryModel, tokens: int, noise: float, limit: float, step: int = 1) -> int:
    """The fewest layers that keep the true peak at or below ``limit``, else below the device, else all."""
    for bound in (limit, model.total):
        for level in range(model.layers + 1):
            if model.peak(tokens, level, noise, step) <= bound:
                return level
    return model.layers


def decider(name: str, model: MemoryModel, settings: Settings) -> Callable[[Observation, float], int]:
    """A function (observation, noise) -> level for the named policy; the noise is seen by the oracle only."""
    layers = model.layers
    if name == "never":
        return lambda o, noise: 0
    if name == "always":
        return lambda o, noise: layers
    if name == "threshold":
        policy = HysteresisPolicy.from_settings(settings)
        return lambda o, noise: policy.decide(o)
    if name == "predictive":
        policy = PredictivePolicy.from_settings(settings)
        return lambda o, noise: policy.decide(o)
    if name == "predictive, compiled":
        return compiled(PredictivePolicy.from_settings(settings), layers, settings.compile_max_switches)
    if name == "ladder":
        return ladder_decider(PredictivePolicy.from_settings(settings), model, settings)
    if name == "oracle":
        limit = settings.memory_high * model.total
        return lambda o, noise: oracle_level(model, o.tokens, noise, limit, o.step)
    raise ValueError(name)


def ladder_decider(
    policy: PredictivePolicy, model: MemoryModel, settings: Settings
) -> Callable[[Observation, float], tuple[int, int]]:
    """The controller's plan with ``recompute="auto"``: the policy's offload; where it is 0, the kept layers
    the ladder fits, from a micro-batch no longer than any a reading has covered."""
    read = {"longest": 0, "step": -1, "step_tokens": 0}

    def decide(observation: Observation, noise: float) -> tuple[int, int]:
        if observation.step != read["step"]:
            if observation.memory_bytes is not None:
                read["longest"] = max(read["longest"], read["step_tokens"])
            read.update(step=observation.step, step_tokens=0)
        read["step_tokens"] = max(read["step_tokens"], observation.tokens)
        level = policy.decide(observation)
        if level or observation.total_bytes is None or observation.tokens > read["longest"]:
            return level, 0
        rungs = ladder.plan(
            policy.predict(observation.tokens, observation.bytes_per_layer, observation),
            model.kept_bytes(observation.tokens, observation.seq_len),
            observation.bytes_per_layer,
            model.layers,
            settings.memory_high * model.total,
            ladder.KEEP_MARGIN * model.total,
        )
        return level, rungs.keep

    return decide


def compiled(policy: PredictivePolicy, layers: int, budget: int) -> Callable[[Observation, float], int]:
    """The policy as the controller runs it under torch.compile: held to the compile levels, and latched to all
    layers once ``budget`` levels never used before (each one a recompilation) have been switched to."""
    levels = compile_levels(layers, budget)
    compiled_levels = {0}
    latched = False

    def decide(observation: Observation, noise: float) -> int:
        nonlocal latched
        if latched:
            return layers
        level = policy.decide(dataclasses.replace(observation, levels=levels))
        if level not in compiled_levels:
            compiled_levels.add(level)
            latched = len(compiled_levels) - 1 >= budget
        return level

    return decide


def replay(
    name: str,
    model: MemoryModel,
    lengths: list[int],
    noises: list[float],
    settings: Settings,
    micro_batches: int = 1,
    flops: float = 400e12,
) -> dict[str, Any]:
    """Run one policy over a trace; what it copied, how often memory ran out, and the levels it chose."""
    decide = decider(name, model, settings)
    s = model.scenario
    c = model.layer_bytes_per_token
    reading: float | None = None
    kept_at_reading = 0.0
    recompute_s = 0.0
    kept_layers = 0
    rescued = False
    copied = rescued_bytes = 0
    oom_steps = unrescued = steps_offloading = 0
    levels_used: list[int] = []
    oom_at: list[int] = []
    switches = 0
    for step, start in enumerate(range(0, len(lengths), micro_batches)):
        peak, offloaded = 0.0, False
        step_kept: list[float] = []
        group = list(range(start, min(start + micro_batches, len(lengths))))
        for index in group:
            tokens = s.batch * lengths[index]
            as_if_recomputed = None if reading is None else reading - kept_at_reading
            observation = Observation(
                step,
                lengths[index],
                tokens,
                None if as_if_recomputed is None else as_if_recomputed / model.total,
                model.layers,
                memory_bytes=None if as_if_recomputed is None else int(as_if_recomputed),
                total_bytes=None if reading is None else model.total,
                bytes_per_layer=c * tokens,
                last_step_rescued=rescued,
                logits_bytes_per_token=model.logits_seed,
                layer_work_bytes_per_token=model.work_seed,
                pending_bytes=int(model.state) if step == 1 else 0,
            )
            level, keep = _rungs(decide(observation, noises[index]))
            switches += bool(levels_used) and level != levels_used[-1]
            levels_used.append(level)
            copied += level * c * tokens
            offloaded |= level > 0
            kept_layers += keep
            recompute_s += (model.layers - keep) * layer_forward_seconds(s, lengths[index], flops)
            peak = max(peak, model.peak(tokens, level, noises[index], step, keep, lengths[index]))
            step_kept.append(keep * model.kept_bytes(tokens, lengths[index]) * (1 + noises[index]))
        steps_offloading += offloaded
        rescued = peak > model.total
        if rescued:
            oom_steps += 1
            oom_at.append(step)
            rerun = [model.peak(s.batch * lengths[i], model.layers, noises[i], step) for i in group]
            unrescued += max(rerun) > model.total
            rescued_bytes += sum(model.layers * c * s.batch * lengths[i] for i in group)
            reading = float(model.total)
            kept_at_reading = 0.0  # the rerun kept nothing
        else:
            reading = peak
            kept_at_reading = min(step_kept, default=0.0)
    return {
        "policy": name,
        "oom_steps": oom_steps,
        "oom_at": oom_at,
        "unrescued_steps": unrescued,
        "bytes": copied + rescued_bytes,
        "rescue_bytes": rescued_bytes,
        "steps_offloading": steps_offloading,
        "steps": math.ceil(len(lengths) / micro_batches),
        "switches": switches,
        "distinct_levels": sorted(set(levels_used)),
        "recompute_s": recompute_s,
        "kept_share": kept_layers / (model.layers * len(lengths)) if lengths else 0.0,
    }


def _rungs(decided: int | tuple[int, int]) -> tuple[int, int]:
    return decided if isinstance(decided, tuple) else (decided, 0)


def layer_forward_seconds(scenario: Scenario, seq: int, flops: float) -> float:
    """One layer's forward for a micro-batch: what recomputing it costs (dense, causal attention)."""
    s = scenario
    return (2 * s.layer_params * s.batch * seq + 2 * s.hidden * s.batch * seq * seq) / flops


def compute_seconds(scenario: Scenario, lengths: list[int], flops: float) -> list[float]:
    s = scenario
    return [(8 * s.params * s.batch * seq + 8 * s.layers * s.hidden * s.batch * seq * seq) / flops for seq in lengths]


def compare(
    scenario: Scenario,
    trace_name: str,
    lengths: list[int],
    calibration: Calibration,
    options: argparse.Namespace,
) -> dict[str, Any]:
    """Every policy over one trace on one scenario, with times and the ratios to the oracle."""
    model = MemoryModel(scenario, calibration)
    rng = random.Random(options.seed)
    noises = [rng.uniform(0, options.noise) for _ in lengths]
    settings = Settings.from_env({})
    bandwidth = calibration.bandwidth or options.bandwidth * 1e9
    compute = compute_seconds(scenario, lengths, options.flops * 1e12)
    total_compute = sum(compute)
    step_compute = statistics.fmean(compute)
    flops = options.flops * 1e12
    rows = [replay(name, model, lengths, noises, settings, options.micro_batches, flops) for name in POLICIES]
    by_name = {row["policy"]: row for row in rows}
    oracle = by_name["oracle"]["bytes"]
    plain_recompute = by_name["never"]["recompute_s"]
    for row in rows:
        row["copy_s"] = 2 * row["bytes"] / bandwidth
        row["failed_attempts_s"] = row["oom_steps"] * step_compute * options.micro_batches
        row["overhead"] = (row["copy_s"] + row["failed_attempts_s"]) / total_compute
        row["bytes_vs_oracle"] = row["bytes"] / oracle if oracle else None
        skipped = plain_recompute - row["recompute_s"]
        row["total_s"] = total_compute - skipped + row["copy_s"] + row["failed_attempts_s"]
        row["time_vs_plain"] = row["total_s"] / total_compute
    predictive, oracle_row = by_name["predictive"], by_name["oracle"]
    ratio = predictive["bytes_vs_oracle"]
    first_reading_oom = [step for step in predictive["oom_at"] if step > 0]
    constant = len(set(lengths)) == 1
    return {
        "scenario": scenario.name,
        "trace": trace_name,
        "steps": len(lengths),
        "max_seq": max(lengths),
        "compute_s": total_compute,
        "rows": rows,
        "constant": constant,
        "target": {
            "no_oom_after_step_0_where_the_oracle_has_none": bool(oracle_row["oom_steps"]) or not first_reading_oom,
            "bytes_within_1.05x_oracle": (predictive["bytes"] == 0) if ratio is None else ratio <= 1.05,
            "at_most_one_switch_on_a_constant_trace": not constant or predictive["switches"] <= 1,
        },
    }


# ---- output -----------------------------------------------------------------------------------------------


def table(results: list[dict[str, Any]]) -> str:
    head = (
        "| scenario | trace | policy | OOM steps | not rescuable | GiB copied | x oracle | time overhead "
        "| steps offloading | switches | levels used | kept | time vs plain checkpointing |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for result in results:
        for row in result["rows"]:
            ratio = "-" if row["bytes_vs_oracle"] is None else f"{row['bytes_vs_oracle']:.2f}"
            levels = row["distinct_levels"]
            shown = (
                ", ".join(map(str, levels)) if len(levels) <= 5 else f"{len(levels)} levels, {levels[0]}..{levels[-1]}"
            )
            lines.append(
                f"| {result['scenario']} | {result['trace']} | {row['policy']} | {row['oom_steps']} "
                f"| {row['unrescued_steps']} | {row['bytes'] / GIB:,.1f} | {ratio} | {row['overhead']:.2%} "
                f"| {row['steps_offloading']} / {row['steps']} | {row['switches']} | {shown} "
                f"| {row['kept_share']:.0%} | {row['time_vs_plain']:.3f} |"
            )
    return head + "\n".join(lines) + "\n"


def summary(results: list[dict[str, Any]]) -> str:
    """The targets, counted over every scenario and trace."""

    def row(result: dict[str, Any], name: str) -> dict[str, Any]:
        return next(r for r in result["rows"] if r["policy"] == name)

    clear = [r for r in results if not row(r, "oracle")["oom_steps"]]
    late_oom = [(r["scenario"], r["trace"], s) for r in clear for s in row(r, "predictive")["oom_at"] if s > 0]
    first_oom = sum(0 in row(r, "predictive")["oom_at"] for r in clear)
    ratios = [row(r, "predictive")["bytes_vs_oracle"] for r in results]
    measured = [x for x in ratios if x is not None]
    zero = sum(1 for r, x in zip(results, ratios, strict=True) if x is None and row(r, "predictive")["bytes"] == 0)
    constant = [r for r in results if r["constant"]]
    lines = [
        f"Targets, over {len(results)} scenario x trace blocks ({len(results) - len(clear)} where even the oracle "
        "runs out of memory: nothing fits there):",
        f"- predictive out-of-memory steps after step 0 where the oracle has none ({len(clear)} blocks): "
        f"{len(late_oom)}{f' {late_oom[:4]}' if late_oom else ''}; at step 0, before any reading: {first_oom} blocks",
        f"- predictive bytes / oracle bytes: max {max(measured):.3f}, median {statistics.median(measured):.3f}"
        f" ({len(measured)} blocks; in {zero} more the oracle and predictive both copy nothing)"
        if measured
        else "- predictive bytes / oracle bytes: the oracle copies nothing anywhere",
        f"- switches of predictive on constant traces ({len(constant)} blocks): max "
        f"{max((row(r, 'predictive')['switches'] for r in constant), default=0)}",
        f"- blocks missing a target: {sum(not all(r['target'].values()) for r in results)}",
    ]
    times = [row(r, "ladder")["time_vs_plain"] for r in results]
    ladder_oom = sum(row(r, "ladder")["oom_steps"] - row(r, "predictive")["oom_steps"] for r in results)
    lines.append(
        f"- ladder (recompute=auto) time / plain checkpointing's: median {statistics.median(times):.3f}, "
        f"best {min(times):.3f}, worst {max(times):.3f}; out-of-memory steps beyond predictive's: {ladder_oom}"
    )
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    scenarios = list(dict.fromkeys(r["scenario"] for r in results))
    figure, axes = plt.subplots(len(scenarios), 1, figsize=(11, 3.2 * len(scenarios)), squeeze=False)
    names = [p for p in POLICIES if p not in ("never", "always")]
    for axis, scenario in zip(axes[:, 0], scenarios, strict=True):
        mine = [r for r in results if r["scenario"] == scenario]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            rows = [next(row for row in r["rows"] if row["policy"] == name) for r in mine]
            xs = [j + i * width for j in range(len(mine))]
            bars = axis.bar(xs, [row["bytes"] / GIB for row in rows], width, label=name)
            for bar, row in zip(bars, rows, strict=True):
                if row["oom_steps"]:
                    axis.annotate(f"{row['oom_steps']} OOM", (bar.get_x(), bar.get_height()), fontsize=7, color="red")
        axis.set_xticks([j + 0.4 - width / 2 for j in range(len(mine))], [r["trace"] for r in mine], fontsize=8)
        axis.set_ylabel("GiB copied to host")
        axis.set_title(f"{scenario}: {SCENARIOS[scenario].description}", fontsize=9)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for simulate.md, simulate.json, simulate.png")
    parser.add_argument("--scenario", nargs="*", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--trace", nargs="*", type=Path, default=[FIXED_TRACE], help="trace files to replay")
    parser.add_argument("--seeds", nargs="*", type=int, default=[1, 2], help="generated traces: longtail and bursty")
    parser.add_argument(
        "--packed", nargs="*", type=int, default=[8192, 32768, 131072], help="fixed-length traces (packing)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-micro-batch noise")
    parser.add_argument("--noise", type=float, default=0.03, help="fragmentation: peaks grow by up to this share")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--bandwidth", type=float, default=25.0, help="host link, GB/s each way (sync engine)")
    parser.add_argument("--flops", type=float, default=400.0, help="achieved TFLOP/s of the device, for compute time")
    parser.add_argument(
        "--results",
        nargs="*",
        type=Path,
        default=sorted((HERE / "results").glob("*/results.json")),
        help="results.json files of benchmarks/bench.py to calibrate from (GPU runs only)",
    )
    parser.add_argument("--work-scale", type=float, help="override: w as a multiple of the arithmetic estimate")
    parser.add_argument(
        "--freed-fraction", type=float, help="override: f, the share of a layer input freed at the peak"
    )
    options = parser.parse_args(argv)

    calibration = calibrate(options.results)
    overrides = {"work_scale": options.work_scale, "freed_fraction": options.freed_fraction}
    if any(v is not None for v in overrides.values()):
        given = {k: v for k, v in overrides.items() if v is not None}
        calibration = dataclasses.replace(calibration, **given, source=f"{calibration.source}, overridden: {given}")
    traces = [(path.stem, read_trace(path)) for path in options.trace]
    traces += [(f"longtail-seed{seed}", longtail(seed)) for seed in options.seeds]
    traces += [(f"bursty-seed{seed}", bursty(seed)) for seed in options.seeds]
    traces += [(f"pack-{length // 1024}k", packed(length)) for length in options.packed]
    results = [
        compare(SCENARIOS[name], trace_name, lengths, calibration, options)
        for name in options.scenario
        for trace_name, lengths in traces
    ]
    options.out.mkdir(parents=True, exist_ok=True)
    text = table(results)
    bandwidth = (
        f"{calibration.bandwidth / 1e9:.1f} GB/s (measured)" if calibration.bandwidth else f"{options.bandwidth} GB/s"
    )
    header = (
        "# autooffload: policies replayed on a simulated device\n\n"
        f"- command: `python benchmarks/simulate.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n"
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}\n"
        f"- memory model: {calibration.source}; work scale {calibration.work_scale:.2f}, "
        f"freed fraction {calibration.freed_fraction:.2f}, noise up to {options.noise:.0%}\n"
        f"- time: copies at {bandwidth} each way, not overlapped (sync engine); compute at {options.flops} TFLOP/s\n"
        f"- micro-batches per step: {options.micro_batches}; settings: defaults ({Settings.from_env({}).to_dict()})\n\n"
        + summary(results)
        + "\n"
    )
    scenarios = "".join(f"- `{s.name}`: {s.description}\n" for s in (SCENARIOS[n] for n in options.scenario))
    report = header + "Scenarios:\n\n" + scenarios + "\n" + text
    (options.out / "simulate.md").write_text(report)
    payload = {
        "argv": argv if argv is not None else sys.argv[1:],
        "calibration": dataclasses.asdict(calibration),
        "scenarios": {n: dataclasses.asdict(SCENARIOS[n]) for n in options.scenario},
        "settings": Settings.from_env({}).to_dict(),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(options).items() if k != "results"},
        "results": results,
    }
    (options.out / "simulate.json").write_text(json.dumps(payload, indent=1, default=str))
    plotted = plot(results, options.out / "simulate.png")
    print(report + ("" if plotted else "\n(matplotlib not importable: no plot)\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
