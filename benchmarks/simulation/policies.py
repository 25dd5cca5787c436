"""The policies replayed, each driven step by step through autooffload's own classes (the same ``Observation``
the controller builds, the same ``decide``), and the replay of one over a trace:

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

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from autooffload.decide import ladder
from autooffload.decide.policy import HysteresisPolicy, Observation
from autooffload.decide.predictive import PredictivePolicy, compile_levels
from autooffload.settings import Settings
from simulation.device import MemoryModel, layer_forward_seconds

POLICIES = ("never", "always", "threshold", "predictive", "predictive, compiled", "ladder", "oracle")


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
