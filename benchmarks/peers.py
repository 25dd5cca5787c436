"""Fastest within the budget, compiled or not: PyTorch's own ways next to autooffload, on the ladder's scenarios.

    python benchmarks/peers.py --out DIR [--rounds N] [--quick] [--scenario a b ...] [--modes ...]
                               [--backend inductor|aot_eager]

The ladder's scenarios, models, length traces and budgets (``benchmarks/ladder.py``, imported: the budget is the
step's real peak on torch's CPU allocator, gradients and the backward's transients included), with every mode
on one model with the same weights and inputs, interleaved step by step:

- eager: ``none`` (no checkpointing), ``plain`` (transformers' checkpointing), ``always`` and ``auto``
  (autooffload, ``recompute="always"`` / ``"auto"``), ``hf-offload`` (transformers' ``offload=True``: its
  ``save_on_cpu(pin_memory=True)`` cannot pin on a CPU-only build, so on the CPU the same hooks copy into host
  buffers outside torch's allocator, as a device's copy would leave it), ``sac`` (selective activation
  checkpointing, torchtitan's op policy: every layer checkpointed, the outputs of attention and of every other
  matmul saved), ``every-2nd`` (transformers' ``every_n_layers=2``: half the layers checkpointed, the rest
  keep their activations);
- compiled (``torch.compile``, ``--backend``, inductor by default): ``compile-<b>`` for
  ``activation_memory_budget`` b in 1.0, 0.5, 0.2, 0.0 (no checkpointing: the partitioner's knapsack decides what
  the backward recomputes; 1.0 is the default, speed-first), ``compile-plain`` (transformers' checkpointing,
  compiled), ``compile-auto`` (autooffload, ``recompute="auto"``, on the compiled model);
- layers compiled in place (``layer.compile()`` on each decoder layer, the rest eager): ``layers-plain``
  (transformers' checkpointing) and ``layers-auto`` (autooffload, ``recompute="auto"``). Whole-model compiles
  peak higher than eager on the CPU (``benchmarks/results/2026-12-04-compile-regions-cpu``); these do not.

Per mode and scenario: the trace's process CPU time (median over the rounds, the spread, against plain and
against the fastest mode that fits), the real peak's largest reading against the budget and the steps over it,
and for compiled modes the compile apart: the warm-up's wall time, the graphs compiled (warm-up, timed) and
the graph breaks. ``compile-auto`` also reports its recompiling plan switches (the controller's budget), and,
per length of the scenario, its loss and gradients against ``compile-plain``'s for the same input. A mode
"fits" when no timed step is over the budget and its warm-up is no worse than ``always``'s (the first step of a
length, before any reading, is the policy's).

Compiled modes share one model and one process, so each gets a backend of its own (dynamo keeps their graphs
apart by backend) and dynamo's recompile limits are raised for the run. Graphs compiled in a step that also
counted the peak make that count drop (the next step at the key counts again).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import inspect
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ladder
from bench import cpu_model

import autooffload
from autooffload import OffloadController, Settings
from autooffload.apply.compile_guard import CompiledFrames
from autooffload.apply.host_memory import page_round, pageable

EAGER = ("none", "plain", "always", "auto", "hf-offload", "sac", "every-2nd")
BUDGETS = (1.0, 0.5, 0.2, 0.0)
COMPILED = ("compile-plain", *(f"compile-{b}" for b in BUDGETS), "compile-auto")
LAYERS = ("layers-plain", "layers-auto")
MODES = EAGER + COMPILED + LAYERS
OURS = ("always", "auto", "compile-auto", "layers-auto")
# Whom each of ours is held against round by round: the other modes of its kind.
KIND = {"always": EAGER, "auto": EAGER, "compile-auto": COMPILED, "layers-auto": LAYERS}


# ---- the peers ----------------------------------------------------------------------------------------------


class HostSaveOnCpu(torch.autograd.graph.saved_tensors_hooks):
    """``save_on_cpu`` on a machine without pinned memory: every tensor saved in the block is copied into a host
    buffer of its own outside torch's allocator (an anonymous mapping) and copied back at its unpack."""

    def __init__(self, pin_memory: bool = False, device_type: str = "cpu") -> None:
        def pack(tensor: torch.Tensor) -> tuple:
            nbytes = tensor.numel() * tensor.element_size()
            host = pageable(page_round(nbytes))[:nbytes].view(tensor.dtype).view(tensor.shape)
            host.copy_(tensor)
            return tensor.device, host

        def unpack(packed: tuple) -> torch.Tensor:
            device, host = packed
            return torch.empty(host.shape, dtype=host.dtype, device=device).copy_(host)

        super().__init__(pack, unpack)


@contextlib.contextmanager
def transformers_offload_on_this_machine():
    """transformers' ``offload=True`` as it runs on a device: on a CPU-only build its ``save_on_cpu`` is
    :class:`HostSaveOnCpu` (pinning fails there at the first forward)."""
    import transformers.modeling_utils as modeling_utils

    original = modeling_utils.save_on_cpu
    if not torch.cuda.is_available():
        modeling_utils.save_on_cpu = HostSaveOnCpu
    try:
        yield
    finally:
        modeling_utils.save_on_cpu = original


def torchtitan_policy() -> Any:
    """torchtitan's op-level selective checkpointing policy, as a ``context_fn``: inside each checkpointed layer
    the outputs of attention and of every other matmul are saved, everything else is recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    saved = {
        aten.mm.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    cudnn = getattr(aten, "_scaled_dot_product_cudnn_attention", None)
    if cudnn is not None:
        saved.add(cudnn.default)

    def context_fn() -> Any:
        counts: dict[str, int] = defaultdict(int)

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            key = "recompute" if ctx.is_recompute else "forward"
            if op == aten.mm.default:
                counts[key] += 1
            keep = op in saved and not (op == aten.mm.default and counts[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def enable_checkpointing(model: torch.nn.Module, kwargs: dict[str, Any], **options: Any) -> None:
    """transformers' checkpointing with torch's checkpoint ``kwargs`` and its own ``options`` (``every_n_layers``,
    ``offload``), under the name this release has."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(kwargs, **options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **options)


def transformers_options() -> set[str]:
    """The checkpointing options this transformers release takes: ``every_n_layers`` (5.16), ``offload`` (5.17)."""
    model = transformers.PreTrainedModel
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    return set(inspect.signature(enable).parameters)


def budget_backend(backend: str, budget: float | None) -> Any:
    """A dynamo backend of its own (its graphs are kept apart from the other modes'), compiling under
    ``activation_memory_budget=budget`` (None: the default)."""
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx as compile_graph
    else:
        from torch._dynamo.backends.registry import lookup_backend

        compile_graph = lookup_backend(backend)

    def compile_mode(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        patch = {} if budget is None else {"activation_memory_budget": budget}
        with torch._functorch.config.patch(**patch):
            return compile_graph(gm, example_inputs)

    return compile_mode


def give_up(frames: CompiledFrames) -> None:
    """Dynamo gives up on these frames, as it does itself after a graph break in a loop."""
    from torch._C._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    for code in frames.codes:
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.DEFAULT))


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def frames_compiled() -> int:
    """Frames dynamo traced so far (a compilation, with or without a graph: with the layers compiled in place, the
    first step of an offloading form traces frames and compiles no graph, and its count held the tracing's own
    allocations, 1.0125 of (c)'s budget against 0.9875 counted again: that mode's controller offloaded a second
    layer for it)."""
    from torch._dynamo.utils import compilation_time_metrics

    return len(compilation_time_metrics.get("_compile.compile_inner", ()))


def graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


class Peer(ladder.Mode):
    """One mode of this benchmark on the ladder's shared model (module docs)."""

    def __init__(self, name: str, bench: ladder.Bench, backend: str = "inductor") -> None:
        super().__init__(name if name in ("none", "plain", "always", "auto") else "_", bench)
        self.name = name
        self.compiled = name.startswith(("compile-", "layers-"))
        self._compiled_model: Any = None
        self.backend = backend
        if name in ("compile-auto", "layers-auto"):
            settings = Settings(recompute="auto", memory_high=ladder.HIGH, memory_low=ladder.HIGH - 0.1)
            self.controller = OffloadController(settings, probe=self.probe)
        self.graphs = {"warm-up": 0, "timed": 0}
        self.compiled_timed_steps = 0
        self.warmup_wall_s = 0.0
        self._configured = False
        self._given_up = False  # this mode's eager-frame functions made dynamo give up the model's frames
        if self.compiled:
            # A model of its own, set up once: re-enabling checkpointing every step installs new objects dynamo
            # guards on (a new partial, a new input-grad hook), and every step would compile again. The
            # controller stays attached to it, as in a run.
            self.model = copy.deepcopy(bench.model)
            self.persistent = True
            self.frames = CompiledFrames(self.model)

    def configure(self, model: torch.nn.Module) -> None:
        if self.compiled and self._configured:
            return
        self._configured = True
        name = self.name
        kwargs: dict[str, Any] = {"use_reentrant": False}
        if name == "none" or (name.startswith("compile-") and name[len("compile-") :][0].isdigit()):
            ladder.set_checkpointing(model, False)
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if name == "sac":
                kwargs["context_fn"] = torchtitan_policy()
                enable_checkpointing(model, kwargs)
            elif name == "every-2nd":
                enable_checkpointing(model, kwargs, every_n_layers=2)
            elif name == "hf-offload":
                enable_checkpointing(model, kwargs, offload=True)
            else:
                ladder.set_checkpointing(model, True)
        if name.startswith("layers-"):  # each decoder layer compiled in place; the rest of the model runs eagerly
            for layer in model.model.layers:
                layer.compile(backend=budget_backend(self.backend, None))

    def runner(self, model: torch.nn.Module) -> Any:
        if not self.compiled or self.name.startswith("layers-"):
            return model
        if self._compiled_model is None:
            suffix = self.name[len("compile-") :]
            budget = float(suffix) if suffix[0].isdigit() else None
            self._compiled_model = torch.compile(model, backend=budget_backend(self.backend, budget))
        return self._compiled_model

    def dynamo_state(self) -> None:
        """Dynamo's frames as they would be in a process of this mode's own: given up on where this mode's
        eager-frame functions made dynamo give up (and autooffload did not give them back yet), else compiled.
        The modes share one process, and a frame dynamo gives up on is given up for every model of its class
        (autooffload's record of it too, ``CompiledFrames.GIVEN_UP``): each mode's own is put back before its
        step and kept after it. Only then: a resume also gives back the frames dynamo gave up on for reasons of its
        own (transformers 5.25's checkpointing breaks the graph in five places), and giving them back before every
        step made compiled plain checkpointing trace them again in every step (17x plain's time)."""
        if self._given_up and not self.name.startswith("layers-"):
            give_up(self.frames)
            self.frames.give_up()
        elif self.frames.given_up:  # another mode's eager-frame plan gave them up: given back as this process has them
            self.frames.resume()

    def step(self, seq: int, seed: int, timed: bool = True, **how: Any) -> dict:
        if self.compiled:
            self.dynamo_state()
        graphs, frames, wall = graphs_compiled(), frames_compiled(), time.perf_counter()
        offload = transformers_offload_on_this_machine() if self.name == "hf-offload" else contextlib.nullcontext()
        with offload:
            row = super().step(seq, seed, timed=timed, **how)
        if self.compiled:
            self._given_up = self.frames.given_up
        self.graphs["timed" if timed else "warm-up"] += graphs_compiled() - graphs
        compiled = frames_compiled() != frames
        if not timed:
            self.warmup_wall_s += time.perf_counter() - wall
        if compiled and timed:
            self.compiled_timed_steps += 1
        if compiled and row["profiled"]:  # the count holds the compilation's own allocations: count it again
            self.bench.counts.pop(self._last_key, None)
        row["compiled"] = compiled  # a reading no controller took as a sample (its warm-up's count leaves it out)
        return row

    def _cpu_step(self, model: torch.nn.Module, inputs: list[torch.Tensor], seq: int, autocast: bool) -> tuple:
        frames = frames_compiled()
        result = super()._cpu_step(model, inputs, seq, autocast)
        if frames_compiled() != frames and self.controller is not None:
            # The compilation's own allocations are in this step's peak: no sample of training (as an evaluation
            # inside a step would not be) for compile-auto's policy and keep planner.
            self.controller.memory.note_side_work()
        return result

    def settle(self, lengths: list[int], how: dict[str, Any]) -> None:
        """A compiled mode runs the trace, untimed, until a pass compiles nothing (at most 4 passes): the timed
        rounds then time steps, not compilations (``compile-auto``'s plans settle, and dynamo gets its frames back
        after the measuring micro-batches, a graph of its own to compile once)."""
        for _ in range(4 if self.compiled else 0):
            frames = frames_compiled()
            for seq in lengths:
                self.step(seq, seed=seq + 1, timed=False, **how)
            if frames_compiled() == frames:
                break

    def key(self, seq: int, tokens: int, plan: tuple[int, int], autocast: bool, forwards: int) -> tuple:
        self._last_key = super().key(seq, tokens, plan, autocast, forwards)
        return self._last_key


# ---- losses and gradients of compiled auto against compiled plain ---------------------------------------------


def compare_compiled(
    bench: ladder.Bench, peers: dict[str, Peer], scenario: ladder.Scenario, plain: str = "compile-plain"
) -> list[dict]:
    """Per length of the scenario, one step of ``plain`` (``compile-plain`` or ``layers-plain``) and one of its
    ``auto`` (as planned now) on the same input: the loss and every gradient, their largest differences."""
    auto = plain.replace("-plain", "-auto")
    if plain not in peers or auto not in peers:
        return []
    rows = []
    for seq in sorted(set(scenario.lengths)):
        grads = {}
        for name in (plain, auto):
            peer = peers[name]
            model = peer.model
            peer.configure(model)
            peer.dynamo_state()
            try:
                ids = bench.ids(seq, 7, scenario.batch)
                with torch.autocast(bench.device, dtype=torch.bfloat16, enabled=scenario.autocast):
                    loss = peer.runner(model)(input_ids=ids, labels=ids).loss
                loss.backward()
                plan = peer.plan()
                grads[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, plan)
            finally:
                model.zero_grad(set_to_none=True)
                if peer.controller is not None:
                    peer.controller.end_step()
        (loss_a, grads_a, _), (loss_b, grads_b, plan) = grads[plain], grads[auto]
        rows.append(
            dict(
                plain=plain,
                auto=auto,
                seq=seq,
                auto_plan=plan,
                loss_equal=bool(torch.equal(loss_a, loss_b)),
                grads_equal=all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a),
                loss_diff=float((loss_a - loss_b).abs()),
                grad_diff_rel=max(
                    float((grads_a[n] - grads_b[n]).abs().max() / grads_a[n].abs().max().clamp_min(1e-30))
                    for n in grads_a
                ),
            )
        )
    return rows


# ---- a scenario -----------------------------------------------------------------------------------------------


def fits(values: dict[str, Any], always: dict[str, Any] | None) -> bool:
    warm = always["warmup_steps_over_budget"] if always is not None else 0
    return values["steps_over_budget"] == 0 and values["warmup_steps_over_budget"] <= warm


def run(bench: ladder.Bench, name: str, scenario: ladder.Scenario, rounds: int, modes: list[str], backend: str):
    peers = {m: Peer(m, bench, backend) for m in modes}
    result = ladder.run_scenario(bench, name, scenario, rounds, list(peers.values()))
    values = result["modes"]
    always = values.get("always")
    for mode, peer in peers.items():
        v = values[mode]
        v["fits"] = fits(v, always)
        if peer.compiled:
            v["compile"] = dict(
                warmup_wall_s=peer.warmup_wall_s,
                graphs=dict(peer.graphs),
                timed_steps_compiling=peer.compiled_timed_steps,
            )
        if peer.controller is not None:
            budget = peer.controller.planner.budget
            v["switch_budget"] = dict(
                spent=budget.spent, recompiled=budget.recompiles, latched=peer.controller.planner.latched
            )
    fitting = [m for m in modes if values[m]["fits"] and m not in OURS]
    fastest = fastest_fitting(values, fitting)
    result["fastest_fitting_peer"] = fastest
    for v in values.values():
        v["vs_fastest_fitting"] = v["median_s"] / values[fastest]["median_s"] if fastest else None
    budgets = [m for m in modes if m.startswith("compile-") and m[len("compile-") :][0].isdigit()]
    result["fastest_fitting_budget"] = fastest_fitting(values, budgets)
    result["compiled_equal"] = compare_compiled(bench, peers, scenario) + compare_compiled(
        bench, peers, scenario, "layers-plain"
    )
    result["graph_breaks"] = graph_breaks()
    for ours in OURS:
        if ours in values:
            values[ours]["paired"] = {m: paired(values, ours, m) for m in fitting}
    return result


def paired(values: dict[str, Any], ours: str, peer: str) -> dict[str, Any]:
    """``ours`` against ``peer`` round by round. A round runs every mode step by step, interleaved, so what moves a
    whole round (the shared machine's other load, its clock) moves both: the per-round ratio cancels it, where each
    mode's own spread (slowest - fastest round) holds it twice. Beyond the spread: the ratio on one side of 1 in
    every round."""
    ratios = [a / b for a, b in zip(values[ours]["round_s"], values[peer]["round_s"], strict=True)]
    low, high = min(ratios), max(ratios)
    return dict(
        median=statistics.median(ratios),
        low=low,
        high=high,
        faster_rounds=sum(r < 1 for r in ratios),
        rounds=len(ratios),
        beyond=high < 1 or low > 1,
    )


def fastest_fitting(values: dict[str, Any], modes: list[str] | tuple[str, ...]) -> str | None:
    """The fastest of ``modes`` that ran and fits."""
    fitting = [m for m in modes if m in values and values[m]["fits"]]
    return min(fitting, key=lambda m: values[m]["median_s"], default=None)


def fastest_peer(values: dict[str, Any], ours: str) -> str | None:
    """The fastest mode of ``ours``'s kind that fits, not one of ours."""
    return fastest_fitting(values, [m for m in KIND[ours] if m not in OURS])


def verdicts(result: dict[str, Any]) -> list[str]:
    """Per autooffload mode: fits, and how it stands against every peer that fits."""
    values, lines = result["modes"], []
    for ours in OURS:
        if ours not in values:
            continue
        v = values[ours]
        if not v["fits"]:
            lines.append(f"{ours} does NOT fit (max reading {v['max_reading_over_budget']:.3f} of the budget)")
            continue
        slower = [
            f"{m} ({values[m]['median_s'] / v['median_s']:.3f}x {ours}'s time)"
            for m in values
            if m not in OURS and values[m]["fits"] and values[m]["median_s"] < v["median_s"]
        ]
        if ours == "compile-auto" and result.get("fastest_fitting_budget"):
            b = result["fastest_fitting_budget"]
            ratio = v["median_s"] / values[b]["median_s"]
            lines.append(f"{ours} fits; {ratio:.3f}x the fastest compiled budget that fits ({b})")
        lines.append(
            f"{ours} fits; faster than every peer that fits"
            if not slower
            else f"{ours} fits; peers that fit and are faster: {', '.join(slower)}"
        )
    return lines


# ---- output ---------------------------------------------------------------------------------------------------

# The summary's columns: ours, then the peers it is held against (modes that fit, the fastest of them).
SUMMARY = (
    ("eager `auto`", ("auto",)),
    ("fastest other eager mode that fits", tuple(m for m in EAGER if m != "auto")),
    ("compiled `auto`", ("compile-auto",)),
    ("fastest compiled mode that fits", tuple(m for m in COMPILED if m != "compile-auto")),
    ("layers compiled, `auto`", ("layers-auto",)),
    ("layers compiled, plain", ("layers-plain",)),
)
NAMES = {"every-2nd": "every other layer", "hf-offload": "`offload=True`", "plain": "plain", "none": "none"}


def display_name(mode: str) -> str:
    """How the summaries name a mode: ``compile-0.5`` as budget 0.5."""
    return NAMES.get(mode, mode.replace("compile-", "budget ") if mode[-1].isdigit() else mode)


def _cell(values: dict[str, Any], modes: tuple[str, ...], single: bool) -> str:
    """A summary cell: one mode (its ratio to plain, spread, whether it fits) or the fastest of ``modes`` that fits."""
    present = [m for m in modes if m in values]
    if not present:
        return "-"
    if single:
        v = values[present[0]]
        over = "" if v["fits"] else f", over ({v['max_reading_over_budget']:.2f})"
        return f"{v['vs_plain']:.3f} ±{v['spread'] / 2:.0%}{over}"
    best = fastest_fitting(values, present)
    if best is None:
        return "none fits"
    v = values[best]
    return f"{display_name(best)}: {v['vs_plain']:.3f} ±{v['spread'] / 2:.0%}"


def summary(results: list[dict[str, Any]]) -> list[str]:
    """The issue's table: per scenario, CPU time against plain checkpointing of ours and of the fastest peer that
    fits, each with half its spread (a ratio apart from another by more than both half-spreads is beyond them)."""
    lines = [
        "| scenario | " + " | ".join(title for title, _ in SUMMARY) + " |",
        "|---" * (len(SUMMARY) + 1) + "|",
    ]
    for result in results:
        values = result["modes"]
        cells = [_cell(values, modes, title.endswith("`auto`") or title.endswith("plain")) for title, modes in SUMMARY]
        lines.append(f"| {result['scenario']} | " + " | ".join(cells) + " |")
    return lines


def paired_table(results: list[dict[str, Any]]) -> list[str]:
    columns = [m for m in ("auto", "compile-auto", "layers-auto") if any(m in r["modes"] for r in results)]
    lines = ["| scenario | " + " | ".join(f"`{m}`" for m in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for result in results:
        values, cells = result["modes"], []
        for ours in columns:
            peer = fastest_peer(values, ours) if ours in values and values[ours]["fits"] else None
            if peer is None:
                cells.append("-")
                continue
            p = values[ours]["paired"][peer]
            cells.append(
                f"{display_name(peer)}: {p['median']:.3f} ({p['low']:.3f}-{p['high']:.3f}), "
                f"faster in {p['faster_rounds']} of {p['rounds']}{', **beyond**' if p['beyond'] else ''}"
            )
        lines.append(f"| {result['scenario']} | " + " | ".join(cells) + " |")
    return lines


def render(env: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = [
        "# autooffload and PyTorch's own ways to fit a budget: CPU",
        "",
        f"- device: {env['device_name']}; load (uptime's 1, 5, 15 min) before / after: {env['load_before']} / "
        f"{env.get('load_after', '-')}",
        f"- torch {env['torch']}, transformers {env['transformers']}, python {env['python']}, date {env['date']}",
        f"- command: `{env['command']}`",
        f"- model and scenarios: benchmarks/ladder.py's, {env['shape']}; compiled modes: {env['backend']}",
        f"- time: process CPU time of forward + backward per step, summed over the trace; median over {env['rounds']} "
        "rounds, modes interleaved step by step (rotating order); spread = (slowest - fastest round) / median",
        "- budget: memory_high 0.9 x device size; reading = weights and AdamW state + the step's peak on torch's "
        "CPU allocator (gradients and the backward's transients included); fits = no timed step over it",
        "",
        "| scenario | mode | time / trace, ms | spread | vs plain | vs fastest fitting peer | max reading / budget "
        "| steps over (timed, warm-up) | fits | kept | offloaded | compile: warm-up s, graphs (warm-up, timed) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for name, v in result["modes"].items():
            compile_ = v.get("compile")
            compiled = (
                f"{compile_['warmup_wall_s']:.0f}, {compile_['graphs']['warm-up']}, {compile_['graphs']['timed']}"
                if compile_
                else ""
            )
            fastest = v["vs_fastest_fitting"]
            lines.append(
                f"| {result['scenario']} | {name} | {v['median_s'] * 1e3:.1f} | {v['spread']:.0%} "
                f"| {v['vs_plain']:.3f} | {'-' if fastest is None else f'{fastest:.3f}'} "
                f"| {v['max_reading_over_budget']:.3f} | {v['steps_over_budget']}, {v['warmup_steps_over_budget']} "
                f"| {'yes' if v['fits'] else '**no**'} | {v['kept']:.0%} | {v['offloaded']:.0%} | {compiled} |"
            )
    lines += ["", "Against plain checkpointing (its time = 1), half the spread after ±:", "", *summary(results)]
    lines += [
        "",
        "Round by round against the fastest mode of its kind that fits (ours' time / its time, the median and the",
        "range over the rounds; **beyond** = on one side of 1 in every round):",
        "",
        *paired_table(results),
    ]
    lines += ["", "Per scenario:", ""]
    for result in results:
        lines.append(f"- {ladder.describe(result)}; fastest peer that fits: {result['fastest_fitting_peer']}")
        for verdict in verdicts(result):
            lines.append(f"  - {verdict}")
        for row in result["compiled_equal"]:
            loss = "equal" if row["loss_equal"] else f"differs by {row['loss_diff']:.2e}"
            grads = "equal" if row["grads_equal"] else f"differ by at most {row['grad_diff_rel']:.2e} of their largest"
            pair = f"{row.get('auto', 'compile-auto')} against {row.get('plain', 'compile-plain')}"
            lines.append(
                f"  - {pair} at {row['seq']} tokens (plan offload, keep "
                f"{tuple(row['auto_plan'])}): loss {loss}, gradients {grads}"
            )
        auto = result["modes"].get("compile-auto")
        if auto is not None and "switch_budget" in auto:
            b = auto["switch_budget"]
            lines.append(
                f"  - compile-auto: {b['spent']} recompiling plan switch(es) charged, {b['recompiled']} graph(s) "
                f"compiled after them{', latched' if b['latched'] else ''}"
            )
    return "\n".join(lines) + "\n"


def load() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "-"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--rounds", type=int, help="timed passes over each trace (default 12; --quick 1)")
    parser.add_argument("--scenario", nargs="*", choices=tuple(ladder.TARGETS), help="default: all; --quick: a b c")
    parser.add_argument("--modes", nargs="*", choices=MODES, help="default: all")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--quick", action="store_true", help="the ladder's tiny model and one round: checks the script")
    parser.add_argument(
        "--skip-side-effects",
        action="store_true",
        help="dynamo's skip_fwd_side_effects_in_bwd_under_checkpoint: compiled checkpointing whole on transformers "
        "5.25 (docs/compile.md)",
    )
    options = parser.parse_args(argv)
    for key in [k for k in os.environ if k.startswith("AUTOOFFLOAD_")]:
        os.environ.pop(key)
        print(f"peers: ignoring {key}: the benchmark sets its own settings", file=sys.stderr)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    # Every compiled mode keeps its own graphs for each length and plan, all on the same frames.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = options.skip_side_effects
    rounds = options.rounds or (1 if options.quick else 12)
    shape = ladder.SHAPES["quick" if options.quick else "cpu"]
    names = options.scenario or (["a", "b", "c"] if options.quick else list(ladder.TARGETS))
    modes = options.modes or list(MODES)
    for mode, option in (("every-2nd", "every_n_layers"), ("hf-offload", "offload")):
        if mode in modes and option not in transformers_options():
            modes.remove(mode)
            print(f"peers: {mode} needs transformers' {option} (5.16 / 5.17 and later); left out", file=sys.stderr)
    bench = ladder.Bench(shape, "cpu")
    hybrid = ladder.Bench(shape, "cpu", "jamba") if "f" in names else None
    plans, readings = ladder.budgets(bench, hybrid, names)
    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device_name=f"{cpu_model()}, 1 torch thread of {os.cpu_count()}, no GPU",
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        autooffload=autooffload.__version__,
        command=" ".join(["python", "benchmarks/peers.py", *argv]),
        shape=dataclasses.asdict(shape),
        rounds=rounds,
        backend=options.backend,
        skip_side_effects=options.skip_side_effects,
        modes=modes,
        calibration=readings,
        load_before=load(),
    )
    options.out.mkdir(parents=True, exist_ok=True)
    results = []
    for scenario in names:
        plan = plans[scenario]
        on = hybrid if plan.model == "jamba" else bench
        started = time.perf_counter()
        result = run(on, scenario, plan, rounds, modes, options.backend)
        result["wall_s"] = time.perf_counter() - started
        results.append(result)
        env["load_after"] = load()
        (options.out / "peers.json").write_text(json.dumps(dict(env, results=results), indent=1, default=str) + "\n")
        (options.out / "peers.md").write_text(render(env, results))
        print(f"peers: scenario {scenario} done ({result['wall_s']:.0f} s)", file=sys.stderr)
    print((options.out / "peers.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
