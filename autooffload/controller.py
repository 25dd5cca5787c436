"""The controller: observe -> decide -> apply, once per micro-batch, with no training framework in sight.

``attach(model)`` reads the model once (:class:`~autooffload.observe.layout.ModelLayout`), installs autooffload's
checkpoint functions (:class:`~autooffload.apply.switch.CheckpointSwitch`) and hooks that hand it each micro-batch
before its forward: there it sizes the layers' saved inputs, plans, installs the plan and records it.
``end_step()`` closes an optimizer step. What the loop keeps between calls, the run's parts and its saved state, is
:class:`~autooffload.run.Run`'s. The Trainer callback is a thin layer over these calls; a custom loop makes them::

    controller = OffloadController()
    controller.attach(model, optimizer=optimizer)  # the optimizer: its state, not yet allocated, is foreseen
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        controller.end_step()
    print(controller.finish())  # on every rank: under torch.distributed it gathers the worst rank's memory

Nothing here may stop a training run: the entry points are guarded (:mod:`~autooffload.guard`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import lifecycle
from .apply.compile_guard import CompiledFrames, compiled_module, is_compiled
from .apply.hooks import ForwardHooks
from .apply.switch import CheckpointSwitch
from .console import say
from .fallback import AT_END
from .guard import guarded
from .observe.inputs import NO_TOKENS, MicroBatch, read_micro_batch
from .observe.layout import CHECKPOINTING_OFF, ENABLE_HINT, ModelLayout
from .observe.stacks import Stack
from .run import Run


class OffloadController(Run):
    """Decides per micro-batch how many checkpointed layers keep their saved input in host memory.

    ``settings``: a :class:`~autooffload.settings.Settings` (default: ``Settings.from_env()``); the keyword
    arguments of :class:`~autooffload.callback.AutoOffloadCallback` (``mode="on"``, ``min_steps=4``, ...)
    override it, or ``AUTOOFFLOAD_*`` variables where no ``settings`` is given.
    ``probe``: a :class:`~autooffload.observe.probe.MemoryProbe`, ``"auto"`` (NVML on the model's CUDA device) or
    ``None`` (no memory signal). ``policy``: a policy's name (the ``policy`` setting) or any object with
    ``decide(Observation) -> int`` (default: the one ``settings.policy`` names; an object given here is the
    caller's: :meth:`reset` does not reset it). ``host``: the engines' host memory manager (default: one budgeted
    at attach from ``settings.host_memory``, released at detach; one passed in keeps its buffers across detach).
    """

    layout: ModelLayout | None = None  # what was read of the attached model
    switch: CheckpointSwitch | None = None  # the checkpoint functions installed on its layers
    hooks: ForwardHooks | None = None  # how its micro-batches reach the controller
    _model: torch.nn.Module | None = None

    # ---- attach and detach --------------------------------------------------------------------------

    @guarded("attach", False, always=True)
    def attach(self, model: torch.nn.Module, *, compiled: bool | None = None, optimizer: Any = None) -> bool:
        """Install the checkpoint functions and the hooks (on the module a ``torch.compile`` wrapper compiled). False,
        with a warning, where there is nothing to control or this run gave up (until :meth:`finish`). ``optimizer``:
        the run's optimizer, so that state it has not allocated yet (Adam's) is foreseen before a reading holds it."""
        compiled, model = is_compiled(model) if compiled is None else compiled, compiled_module(model)
        if self.failed:
            return self.fallback.attach_refused(model)  # under torch.distributed the other ranks are in the join
        self.detach()
        lifecycle.take_over(model, self)
        self._model = model  # from here on, a failure leaves this model on plain checkpointing
        layout = self.layout = self._read(model)  # from here on, a notice knows where micro-batches enter
        self.agreement.join(bool(layout.targets), self.warn)
        if not layout.targets:
            lifecycle.let_go(model, self)
            self._model, self.layout = None, None
            if not layout.unknown:  # otherwise checkpointing is on, and a warning named the function it runs
                self.warn("no-targets", f"no checkpointed layers found, so autooffload does nothing: {ENABLE_HINT}")
            return False
        self.host.set_budget(self.settings.host_memory, layout.devices)
        self.record.costs.start(self.host, self.memory.read_seconds)
        frames = CompiledFrames(model) if compiled else None
        self.switch = CheckpointSwitch(
            list(layout.targets), self.stats, self.settings.engine, self.warn, self.host,
            on_first_call=self._on_first_call, on_measured=self._on_measured, frames=frames, foreign=layout.unknown,
            faults=self.faults, on_mark=self.memory.mark,
        )  # fmt: skip
        self._adopt(layout, frames is not None)
        recompute, layers = self.settings.recompute, len(layout.layers)
        self.adopt_identity(lifecycle.model_identity(model, layers=layers, hidden=layout.hidden, recompute=recompute))
        self.memory.attach(model, layout.devices, optimizer, self.settings)
        backwards = self.planner.backward if recompute == "auto" else None
        self.hooks = ForwardHooks(model, layout.entries, self._enter, backwards, self.agreement.deciding, self._leave,
                                  self.faults)  # fmt: skip
        fixed = self.planner.fixed_level(self.memory.rescuing)
        self._install(fixed if fixed is not None else self.level or 0)
        probe = type(self.memory.probe).__name__ if self.memory.probe is not None else "none"
        say(
            "autooffload: controlling %d checkpointed layer(s), mode=%s, memory signal=%s, compiled=%s, %s",
            len(self.switch.layers), self.settings.mode, probe, self.planner.compiled,
            self.host.describe(self.settings.host_memory),
        )  # fmt: skip
        return True

    def _read(self, model: torch.nn.Module) -> ModelLayout:
        layout = ModelLayout.read(model)
        for key, message in layout.warnings:
            self.warn(key, message)
        return layout

    def _adopt(self, layout: ModelLayout, compiled: bool) -> None:
        """The model's (new) layout: the sizes and the planner follow it."""
        self.layout = layout
        self.sizes.attach(layout)
        self.planner.attach(layout, compiled)

    def give_up(self, where: str, error: BaseException) -> None:
        """An entry point raised (:mod:`autooffload.guard`): one warning, then plain checkpointing until the run ends,
        on every rank (the hooks removed, plain functions installed; :mod:`autooffload.fallback`)."""
        self.failed, model, hooks, self.hooks = True, self._model, self.hooks, None  # the fallback takes the hooks
        self.fallback.give_up(where, error, model, hooks, self.layout)
        try:
            self.detach()
        except Exception:  # the switch itself is broken: forget it, the functions are replaced below
            self.switch, self.hooks = None, None
        if model is not None:
            self.fallback.keep_plain(model)
        if where in AT_END:  # the run is over: the next one tries again
            self.end_run()

    def detach(self, *, restore: bool = False) -> None:
        """Remove the hooks. Plain checkpointing stays installed unless ``restore`` puts back the functions that
        were found (which, on some transformers releases, fail or always offload)."""
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None
        if self.switch is not None:
            self.switch.close()
            self.switch.restore() if restore else self.switch.apply(0)
            self.switch = None
        lifecycle.let_go(self._model, self)
        self._model, self.layout = None, None
        self._release()

    def retire(self) -> None:
        """Another controller takes this one's model over: remove the hooks and put back the functions found."""
        self.detach(restore=True)

    # ---- the micro-batch: observe, decide, apply -----------------------------------------------------

    @guarded("the pre-forward hook")
    def _enter(
        self, module: torch.nn.Module, stacks: Sequence[Stack] | None, args: tuple, kwargs: dict, deferrable: bool
    ) -> bool:
        """A call entered the model (or a stack's entry) inside no other that decided: one micro-batch, decided here
        for every stack the call runs (``stacks``; None: every planned one). False: the call carries no tokens and a
        watched entry inside it will (``deferrable``), so the decision is left to that entry."""
        if self.switch is not None:
            self.switch.new_forward()
        if not module.training:
            return True
        grad = torch.is_grad_enabled()  # without: a no-grad forward in train mode (TRL's KL forward), decide nothing
        if self.switch is not None and (grad or not self.switch.checkpointing_off()):
            self._rebuild_if_replaced()  # first: the call is read with the stacks of the layout it runs with
        if not grad or self.hooks is None:
            return True
        planned = list(self.layout.stacks) if self.layout is not None else []
        stacks = planned if stacks is None else list(self.hooks.stacks.get(module, ()))
        batch = read_micro_batch(module, stacks, args, kwargs)
        if batch is None and deferrable:
            return False
        if batch is None:
            if self.switch is not None and self.switch.layers and self.settings.mode == "auto":  # only auto triggers
                self.warn("no-tokens", NO_TOKENS.format(type(module).__name__))
            batch = MicroBatch(0, 0, {stack.name: (0, 0) for stack in stacks})
        if not self.memory.begun:
            self.begin_step()
        self.before_forward(batch.seq_len, batch.tokens, batch.lengths, batch.sources)
        return True

    @guarded("the post-forward hook")
    def _leave(self, raised: bool = False) -> None:
        """The call ``_enter`` took ended: what its layer calls deferred moves if it was theirs alone."""
        if self.switch is not None:
            self.switch.end_forward(raised)

    def before_forward(
        self, seq_len: int, tokens: int, lengths: dict[str, tuple[int, int]] | None = None, sources: Any = None
    ) -> int:
        """Decide for the micro-batch about to run and install the decision. Returns the layers offloaded.

        ``seq_len``: the longest of the stacks' lengths (the sequence trigger reads it); ``tokens``: the micro-batch's
        input tokens (an encoder-decoder's source and target together; stacks that read one input, such as HRM's,
        count it once). ``lengths``: (sequence length, tokens) per planned stack, by name; a stack not named runs
        no tokens, and without ``lengths`` every planned stack read from tokens runs ``seq_len`` and ``tokens``.
        ``sources``: per stack sized from a raw input, its elements (:mod:`~autooffload.observe.sources`)."""
        if self.switch is None:
            return 0
        self._close_micro_batch()  # the one that ran last: its layers' calls are counted
        self._rebuild_if_replaced()
        self.planner.settle()
        batch = MicroBatch.of(seq_len, tokens, lengths, list(self.layout.stacks) if self.layout else [], sources)
        sized = self.sizes.size(batch, self.switch.calls_per_forward)  # observe
        batch = sized.batch or batch
        self.switch.begin_micro_batch(batch)
        before = (self.switch.offloaded, self.switch.kept)
        plan = self.planner.plan(
            self.step, batch, sized, self.memory.last,
            host_budget=self.host.budget_bytes, installed=before, first=self.record.micro_batches == 0,
            rescuing=self.memory.rescuing,
        )  # decide  # fmt: skip
        self._install(plan.level, plan.keep, plan.measure, sized.order)  # apply
        self.host.expect(sized.layer_bytes[: plan.level] if sized.layer_bytes else ())
        self.sizes.start(self.switch.offloading, sized)
        host, layers = (self.host.budget_bytes, self.settings.host_memory), len(self.switch.layers)
        self.record.micro_batch(batch.seq_len, batch.tokens, plan, before[0], self.switch.kept, layers, host)
        return plan.level

    def _install(self, level: int, keep: int = 0, measure: bool = False, order: tuple[int, ...] | None = None) -> None:
        assert self.switch is not None
        self.switch.apply(level, keep, measure, order)
        self.record.installed(self.switch.offloaded, self.switch.kept, len(self.switch.layers))

    def _rebuild_if_replaced(self) -> None:
        """Rebuild the switch where the model's checkpoint functions changed hands (a trainer's disable and enable)."""
        assert self.switch is not None and self._model is not None
        if self.switch.unchanged():
            return
        layout = self._read(self._model)
        if not layout.targets and not layout.unknown:
            self.warn("checkpointing-off", CHECKPOINTING_OFF)
        level = self.switch.offloaded
        self.switch = self.switch.rebuilt(list(layout.targets), layout.unknown)
        self._adopt(layout, self.planner.compiled)
        if self.hooks is not None:
            self.hooks.follow(layout.entries)
        self.record.reinstalled()
        self._install(level)

    @guarded("a layer call's report")
    def _on_first_call(self, position: int, nbytes: int, shape: tuple[int, int] | None = None) -> None:
        """A planned layer's first call in this micro-batch, with its inputs' bytes (a stale switch's: ignored)."""
        if self.switch is not None and position < len(self.switch.layers):
            self.sizes.first_call(position, nbytes, self.stats.total_bytes > 0, shape)

    @guarded("a kept layer's report")
    def _on_measured(self, position: int, nbytes: int, cast_bytes: int, batch: MicroBatch | None = None) -> None:
        """A layer that does not offload kept (or would keep) ``nbytes`` in its call's micro-batch ``batch``."""
        self.planner.measured(position, batch or self.sizes.batch or MicroBatch(0, 0, {}), nbytes, cast_bytes)

    def planned_bytes(self) -> float | None:
        """The running micro-batch's offloaded bytes by the arithmetic: after the backward, what the engine moved."""
        return self.sizes.planned_bytes(self.switch.forward.counts) if self.switch is not None else None

    def _close_micro_batch(self) -> None:
        if self.switch is not None:
            self.sizes.close_micro_batch(self.switch.forward.take_counts())
            self.record.ran(len(self.switch.layers))

    @guarded("rescue", False)
    def rescue(self, tried_bytes: int | None = None) -> bool:
        """Offload every layer until this step ends, for a rerun after an out-of-memory error. ``tried_bytes``: the
        allocation that failed ("Tried to allocate X"): the step's reading is raised to at least the reading plus it
        and the device's size, so the policy plans more offload for that length next time. False when a rerun cannot
        help: nothing is controlled, or mode ``off`` forbids offload."""
        if self.switch is None or not self.switch.layers or self.settings.mode == "off":
            return False
        self.record.rescue(len(self.switch.layers))
        self.memory.rescue(tried_bytes)
        self.planner.rerun()
        return True

    # ---- the optimizer step --------------------------------------------------------------------------

    @guarded("begin_step")
    def begin_step(self) -> None:
        """Start an optimizer step: its peak starts here (the probe's ``reset()``), so evaluation and saving between
        two steps stay out of the next reading. Called at ``on_step_begin``, else at a step's first micro-batch."""
        self.memory.begin_step()

    @guarded("end_step")
    def end_step(self) -> None:
        """Close an optimizer step: bytes moved, memory reading, what the plans learn, the step's record."""
        self._close_micro_batch()
        rescued = self.memory.rescuing
        moved = self.record.close_step()  # what fell short says nothing of a layer input's bytes
        self.sizes.end_step(moved, measure=not rescued and not self.record.last_step_short_bytes)
        self.planner.end_step(self.memory.end_step(), self.memory.last.clean and not rescued, self.memory.segments)
        self.host.end_step()
        layers = len(self.switch.layers) if self.switch is not None else None
        self.record.end_step(rescued, self.memory.last, layers, self.settings, (self.host, self.memory.read_seconds))

    @guarded("load")
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.switch is not None:
            self._install(self.level if self.level is not None else self.switch.offloaded)
