"""PyTorch's own ways to fit a budget as modes on the ladder's shared model (:mod:`harness.scenarios`), next to
autooffload's: transformers' ``offload=True``, selective checkpointing, every other layer, and under
``torch.compile`` the partitioner's memory budgets, transformers' checkpointing and ``recompute="auto"``, whole or
layer by layer (benchmarks/peers.py's docstring says what each is).

Compiled modes share one model and one process, so each gets a backend of its own (dynamo keeps their graphs
apart by backend) and dynamo's recompile limits are raised for the run. Graphs compiled in a step that also
counted the peak make that count drop (the next step at the key counts again).
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any

import torch

from autooffload import OffloadController, Settings
from autooffload.apply.compile_guard import CompiledFrames
from harness import scenarios as ladder
from harness.compiled import budget_backend, frames_compiled, give_up, graphs_compiled
from harness.forms import torchtitan_policy, transformers_offload_on_this_machine
from harness.models import set_checkpointing


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
            set_checkpointing(model, False)
            return
        if name == "sac":
            kwargs["context_fn"] = torchtitan_policy()
        options = {"every-2nd": {"every_n_layers": 2}, "hf-offload": {"offload": True}}.get(name, {})
        set_checkpointing(model, True, kwargs, **options)
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
