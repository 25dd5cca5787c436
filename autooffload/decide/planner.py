"""Decide, the micro-batch's plan: how many layers offload and how many keep, and why.

Everything that turns what is known before a forward into one :class:`Plan` sits here, in the order it applies:

1. the host cap: no more layers than the host memory budget holds at this micro-batch's sizes (under
   torch.compile, the largest allowed level under it);
2. a level the run fixes (``mode`` on or off, the torch.compile latch, a rescued step's rerun), else the policy's
   answer to an :class:`~autooffload.decide.policy.Observation` (a policy that raises is dropped: plain
   checkpointing from then on); then capped;
3. with ``recompute="auto"``, where nothing offloads, how many of the last layers keep
   (:mod:`~autooffload.decide.keep_plan`); where forwards before this one are still alive (two forwards before
   one backward) and hold more than the prediction covers, recomputing every layer may not be enough: then the
   fewest layers that bring the step under ``memory_high`` offload;
4. under torch.distributed, the ranks' agreement: the most offload any rank asked for, capped at the smallest
   rank's host cap, and the least keep (the ``agree`` function the controller hands in makes the collective;
   a policy that keeps state hears the group's level through ``agreed``);
5. under torch.compile, a plan that differs from the one installed is charged to the switch budget once the
   next micro-batch shows whether it recompiled (:meth:`Planner.settle`); a spent budget latches offload on.

Pure: no torch, no clock, no I/O. What the run measures comes in as plain values; what touches the process (the
collective, the compile counter, warnings) comes in as functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import ladder
from .keep_plan import KeepPlanner
from .peak import slope_terms
from .plan import Agree, Batch, LastReading, Plan, Sizes, fixed_reason, host_cap, policy_reason, predicted_peak
from .policy import Observation, Policy
from .predictive import compile_levels, make_policy


class Planner:
    """Plans every micro-batch of a run (see the module docstring) and keeps what the plans learn.

    ``settings``: the run's :class:`~autooffload.settings.Settings`; ``warn``: ``warn(key, message)``, once per key;
    ``policy``: a policy object that replaces the named one (the caller's: :meth:`reset` does not reset it);
    ``new_budget``: makes the torch.compile switch budget for a limit (``switched()``, ``settle()``,
    ``exhausted``, ``spent``); ``agree``: the ranks' agreement (None: one process); ``page``: the host page size
    buffers are rounded to.
    """

    def __init__(
        self,
        settings: Any,
        warn: Callable[[str, str], Any],
        policy: Policy | None,
        new_budget: Callable[[int], Any],
        agree: Agree | None = None,
        page: int = 4096,
    ) -> None:
        self.settings = settings
        self.warn = warn
        self.choice = policy
        self.new_budget = new_budget
        self.agree = agree
        self.page = page
        self.layers, self.stacks, self.compiled = 0, 0, False
        self.token_terms: tuple[float | None, float | None] = (None, None)  # logits, layer work per token
        self.policy: Policy | None = None
        self.keep_seed: tuple[list[int], int, Any] | None = None
        self.reset()

    def reset(self) -> None:
        """A new run: a fresh policy (the same object, where it is of the kind the settings name: a caller may
        hold it), a fresh keep planner for the same layers, an unspent compile budget."""
        self.policy = self._fresh_policy()
        self.budget = self.new_budget(self.settings.compile_max_switches)
        self.latched = False
        self.policy_failed = False
        self.keep = KeepPlanner()  # the ladder's keep rung (recompute="auto"), for the same layers
        self.keep.compiled = self.compiled
        if self.keep_seed is not None:
            self.keep.configure(*self.keep_seed)
        self.keep_plain: float | None = None  # the all-recompute peak the last keep plan was made from
        self.last_observation: Observation | None = None
        self.last_reason: str | None = None

    def _fresh_policy(self) -> Policy:
        if self.choice is not None:
            return self.choice
        fresh = make_policy(self.settings)
        if type(self.policy) is not type(fresh):
            return fresh
        self.policy.load_state_dict(fresh.state_dict())  # type: ignore[union-attr]
        return self.policy  # type: ignore[return-value]

    def attach(self, layout: Any, compiled: bool) -> None:
        """The attached model's :class:`~autooffload.observe.layout.ModelLayout` (its planned layers and stacks, the
        config's logits and working-set terms per token, the keep planner's seed) and whether it is compiled."""
        self.layers, self.stacks, self.compiled = len(layout.layers), len(layout.stacks), compiled
        self.token_terms = (layout.logits_token_bytes, layout.work_token_bytes)
        self.keep_seed = (list(layout.layer_weights), layout.weight_bytes, layout.layer_shape)
        self.keep.configure(*self.keep_seed)
        self.keep.compiled = compiled
        if self.compiled and self.budget.exhausted and self.settings.mode == "auto":
            self._latch()

    def detach(self) -> None:
        """No model: a new run starts with a keep planner for no layers in particular."""
        self.keep_seed = None

    def fixed_level(self, rescuing: bool = False) -> int | None:
        """The level the settings or the run's state fix, or None where the policy decides."""
        if self.latched or rescuing or self.settings.mode == "on":
            return self.layers
        if self.settings.mode == "off":
            return 0
        return None

    # ---- the plan -------------------------------------------------------------------------------------

    def plan(
        self,
        step: int,
        batch: Batch,
        sized: Sizes,
        reading: LastReading,
        *,
        host_budget: int | None,
        installed: tuple[int, int],
        first: bool,
        rescuing: bool,
    ) -> Plan:
        """The plan for ``batch`` (its ``seq_len`` and ``tokens``), a micro-batch of ``step``: ``sized``, its layers'
        :class:`~autooffload.observe.sizes.Sized`; ``reading``, the last
        :class:`~autooffload.observe.memory.Reading`; ``host_budget``: this rank's host memory budget in bytes;
        ``installed``: the (level, keep) in place; ``first``: no micro-batch ran yet in this run; ``rescuing``: the
        step is a rescue's rerun."""
        seq_len, tokens = batch.seq_len, batch.tokens
        cap = host_cap(host_budget, self.layers, sized.layer_bytes, sized.token_bytes, tokens, self.page)
        if self.compiled and cap is not None:
            allowed = compile_levels(self.layers, self.settings.compile_max_switches)
            cap = max(level for level in allowed if level <= cap)
        decided, reason = 0, self.last_reason  # no layer to decide for (checkpointing off): the reason stands
        if self.layers:
            decided, reason = self._decide(step, seq_len, tokens, sized, reading, cap, rescuing)
        asked = None
        if cap is not None and decided > cap:
            decided, asked, reason = cap, decided, "host_cap"
        keep = alive = 0
        if self.stacks <= 1 and self.settings.recompute == "auto":
            keep = self._plan_keep(seq_len, tokens, decided, sized, reading, rescuing)
            alive = 0 if keep else self._alive_level(decided, reading)
        own = decided  # the policy's level, capped: a policy that keeps state hears of another that runs
        if alive > decided:
            decided, reason = alive if cap is None else min(alive, cap), "forwards_alive"
        level, keep = self._agree(decided, cap, keep)
        if level != decided:
            reason = "rank_agreement"
        if level != own:
            self._tell(level, step, seq_len, tokens, reading)
        if self.compiled and (level, keep) != installed and not first:
            self.budget.switched()
        # Counting what a layer keeps holds its activations until its forward ends (the counter needs them alive):
        # under a budget that needs offload, that can be the step's peak. Where anything offloads nothing keeps at
        # that length anyway, so only a micro-batch that offloads nothing counts.
        measure = self.settings.recompute == "auto" and self.stacks <= 1 and level == 0
        measure = measure and (self.keep.wants(level, tokens, seq_len) or self.keep.wants_profile(tokens, seq_len))
        footprint = tokens * slope_terms(self.layers, tokens, sized.bytes_per_layer, *self.token_terms)[1]
        kept = max(0, min(keep, self.layers - level))
        plain = self.keep_plain if tokens <= self.keep.longest_read_tokens else None  # no peak known there
        self.keep.forward(tokens, seq_len, kept, plain, footprint, batch, measure)
        predicted = predicted_peak(self.policy, tokens, sized.bytes_per_layer)
        switched = level != installed[0] and not first
        self.last_reason = reason
        return Plan(level, keep, measure, reason, switched, asked, cap, predicted)

    def _decide(
        self, step: int, seq_len: int, tokens: int, sized: Sizes, reading: LastReading, cap: int | None, rescuing: bool
    ) -> tuple[int, str | None]:
        self.last_observation = None
        fixed = self.fixed_level(rescuing)
        if fixed is not None:
            return fixed, fixed_reason(self.latched, rescuing, self.settings.mode)
        if self.policy_failed:
            return 0, "policy_failed"
        memory_bytes, memory_fraction = self._as_if_all_recomputed(reading)
        layer_bytes = sized.layer_bytes
        observation = Observation(
            step,
            seq_len,
            tokens,
            memory_fraction,
            self.layers,
            memory_bytes=memory_bytes,
            total_bytes=reading.total,
            bytes_per_layer=sized.bytes_per_layer,
            layer_bytes=layer_bytes if layer_bytes and len(set(layer_bytes)) > 1 else None,
            levels=compile_levels(self.layers, self.settings.compile_max_switches) if self.compiled else None,
            last_step_rescued=reading.rescued,
            logits_bytes_per_token=self.token_terms[0],
            layer_work_bytes_per_token=self.token_terms[1],
            pending_bytes=reading.pending_bytes,
            last_step_clean=reading.clean,
            host_layers=cap,
        )
        self.last_observation = observation
        try:
            level = max(0, min(int(self.policy.decide(observation)), self.layers))  # type: ignore[union-attr]
        except Exception as error:  # a user's policy must not end the run
            self.policy_failed = True
            name = type(self.policy).__name__
            self.warn("policy", f"policy {name} raised {error!r}; plain checkpointing from now on")
            return 0, "policy_failed"
        return level, policy_reason(self.policy)

    def _as_if_all_recomputed(self, reading: LastReading) -> tuple[int | None, float | None]:
        """The last reading less what kept layers added to it: what the policies plan from (they know nothing
        of keep, so a step that kept must not look fuller to them than its all-recompute peak)."""
        kept_bytes = self.keep.reading_kept_bytes
        if not kept_bytes or reading.bytes is None or not reading.total:
            return reading.bytes, reading.fraction
        memory_bytes = max(round(reading.bytes - kept_bytes), 0)
        return memory_bytes, memory_bytes / reading.total

    def _plan_keep(
        self, seq_len: int, tokens: int, level: int, sized: Sizes, reading: LastReading, rescuing: bool
    ) -> int:
        """How many of the last layers run without checkpointing for this micro-batch (recompute="auto").

        None kept where anything is fixed or unknown: offload decided (or forced by mode, latch, rescue), no
        reading yet, a micro-batch longer than any a reading has covered, or a policy that cannot predict.
        The count is the keep planner's (:mod:`autooffload.decide.keep_plan`).
        """
        self.keep_plain = None
        if level > 0 or self.settings.mode != "auto" or self.fixed_level(rescuing) is not None or self.policy_failed:
            return 0
        if reading.total is None or tokens <= 0:  # longer than any read: the prediction still guards forwards alive
            return 0
        predict = getattr(self.policy, "predict", None)
        name = type(self.policy).__name__
        if predict is None:
            self.warn(
                "keep-no-prediction",
                f"AUTOOFFLOAD_RECOMPUTE=auto needs a policy that predicts the peak (predictive); {name} does not, "
                "so every layer recomputes",
            )
            return 0
        try:
            predicted = predict(tokens, sized.bytes_per_layer)  # sized as the decision sized it: each stack's width
        except Exception as error:  # a user's policy must not end the run
            self.warn("keep-predict", f"{name}.predict raised {error!r}; nothing is kept")
            return 0
        if predicted is None:
            return 0
        self.keep_plain = predicted
        levels = ladder.keep_levels(self.layers, self.settings.compile_max_switches) if self.compiled else None
        limit = self.settings.memory_high * reading.total
        margin, widen_by = self.settings.keep_margin * reading.total, ladder.KEEP_MARGIN * reading.total
        return self.keep.count(predicted, tokens, seq_len, limit, margin, levels, widen_by)

    def _alive_level(self, decided: int, reading: LastReading) -> int:
        """Layers this micro-batch offloads because forwards before it are still alive: where what they hold beyond
        the prediction (their kept layers, footprints no reading covered: the first step with two forwards) puts
        the all-recompute peak over ``memory_high``, the fewest that bring it under (all of them where none do)."""
        observation, predicted = self.last_observation, self.keep_plain
        if decided or observation is None or predicted is None or reading.total is None:
            return 0
        held = self.keep.held(observation.tokens, observation.seq_len)
        excess = predicted + held - self.settings.memory_high * reading.total
        if not held or excess <= 0:
            return 0
        level = observation.fewest_layers(excess)
        return min((allowed for allowed in observation.levels or () if allowed >= level), default=level)

    def _agree(self, level: int, cap: int | None, keep: int) -> tuple[int, int]:
        """The ranks' plan, where there is a group to ask."""
        if self.agree is None:
            return level, keep
        return self.agree(level, self.layers if cap is None else cap, keep, self.layers)

    def _tell(self, level: int, step: int, seq_len: int, tokens: int, reading: LastReading) -> None:
        """A policy that keeps state hears that ``level`` runs, not its own (the ranks' agreement, forwards alive)."""
        tell = getattr(self.policy, "agreed", None)
        if tell is None:
            return
        observation = self.last_observation or Observation(step, seq_len, tokens, reading.fraction, self.layers)
        try:
            tell(observation, level)
        except Exception as error:  # a user's policy must not end the run
            self.warn(
                "policy-agreed",
                f"policy {type(self.policy).__name__}.agreed raised {error!r}; its state may differ from the "
                "level the ranks agreed on",
            )

    def settle(self) -> None:
        """The micro-batch after a switch has run (called before the next plan and at a step's end): charge the
        switch if it recompiled; latch when the budget is spent."""
        if not self.compiled:
            return
        self.budget.settle()
        if self.budget.exhausted and not self.latched and self.settings.mode == "auto":
            self._latch()

    # ---- what ran -------------------------------------------------------------------------------------

    def measured(self, position: int, batch: Batch, nbytes: int, cast_bytes: int) -> None:
        """Layer ``position`` keeps ``nbytes`` (``cast_bytes``: its autocast dtype's bytes, 0: off) at ``batch``."""
        self.keep.measured(position, batch.tokens, batch.seq_len, nbytes, cast_bytes)

    def backward(self) -> None:
        """A backward ran: the forwards before it are freed."""
        self.keep.backward()

    def rerun(self) -> None:
        """A rescue reruns the step from its start: what its forwards so far were planned to hold is gone."""
        self.keep.rerun()

    def end_step(self, peak_bytes: float | None, clean: bool, segments: list[tuple[Any, float]] | None = None) -> None:
        """The step's peak as the probe read it (None: none), whether it is a sample of training alone, and its
        segments where it was marked: the keep planner compares the peak with its plan and reads the segments."""
        self.settle()
        self.keep.end_step(peak_bytes, clean=clean, segments=segments)

    def _latch(self) -> None:
        self.latched = True
        self.warn(
            "latched",
            f"torch.compile: {self.budget.spent} offload switch(es) triggered recompilation, the budget "
            f"AUTOOFFLOAD_COMPILE_MAX_SWITCHES={self.settings.compile_max_switches} is spent; offload stays on "
            "(the memory-safe state) for the rest of the run",
        )

    # ---- resume ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "latched": self.latched,
            "budget_spent": self.budget.spent,
            "policy": self._policy_state(),
            "kept_model": self.keep.state_dict(),
        }

    def _policy_state(self) -> dict[str, Any] | None:
        if not hasattr(self.policy, "state_dict"):
            return None
        try:
            return self.policy.state_dict()  # type: ignore[union-attr]
        except Exception as error:  # a user's policy must not stop a checkpoint save
            self.warn("policy-save", f"policy {type(self.policy).__name__}.state_dict() raised {error!r}; not saved")
            return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.latched = bool(state.get("latched", False))
        self.budget.spent = int(state.get("budget_spent", 0))
        legacy = {key: state[key] for key in ("longest_read_tokens", "reading_kept_bytes") if key in state}
        self.keep.load_state_dict({**legacy, **(state.get("kept_model") or {})})
        if self.keep_seed is not None:
            self.keep.configure(*self.keep_seed)  # the attached model's layers, with what was measured on them
        if state.get("policy") is not None and hasattr(self.policy, "load_state_dict"):
            try:
                self.policy.load_state_dict(state["policy"])  # type: ignore[union-attr]
            except Exception as error:  # saved by another policy (AUTOOFFLOAD_POLICY changed), or a user's policy
                self.warn(
                    "policy-state",
                    f"the saved policy state does not fit {type(self.policy).__name__} ({error!r}); it starts afresh",
                )
