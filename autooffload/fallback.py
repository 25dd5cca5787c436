"""Giving up: plain checkpointing on this rank, and on every rank from the same micro-batch on.

When an entry point fails (:mod:`autooffload.guard`), the controller warns once, removes its hooks and installs
plain checkpointing (:meth:`~autooffload.controller.OffloadController.give_up`). With one process that is all.
Under torch.distributed the other ranks make the agreement's collectives (:mod:`autooffload.distributed`) at
fixed points of the run: the join at attach, one agreement per training micro-batch (mode ``auto``), the gather
at the end. A rank that stopped making them would leave the others in a collective it never joins: a mismatch
with DDP's next all-reduce (gloo aborts every process), a wait until the timeout (NCCL), or, under ZeRO-3, a
parameter all-gather met. So the rank that failed makes the one collective it owes, with the flag "this rank gave
up", exactly where the others make theirs, and every rank learns it there:

- failed inside ``attach`` or ``on_train_begin`` before this run's join: the join, at once; every rank gives up
  at attach. Failed before a run began (a load): the join, at the next ``attach``, which a rank that gave up
  still makes (it attaches nothing);
- failed anywhere during the run (the pre-forward hook, a layer's report in the forward or the backward, code of
  autooffload's inside a step, ``end_step``, a save, a Trainer event): the agreement of the training micro-batch
  being decided, or else of the next one, made by a :class:`RankNotice`. The notice takes over the controller's
  forward hooks (:meth:`~autooffload.apply.hooks.ForwardHooks.hand_over`), so it stands where the others decide:
  the call that enters the model or an entry inside no other watched call (the top model, TRL's ``model.model``,
  the backbone a redirected call passes the tokens to), in train mode under grad, once a forward running at the
  failure ended; never at an inner entry of that forward (an encoder-decoder's decoder, ``Qwen3Model`` under its
  causal LM) whose agreement was made before the failure. Every rank is on plain checkpointing from that
  micro-batch on (this one since it failed: placement only, results are the same);
- failed at the end (``finish``, ``on_train_end``), or no micro-batch came after the failure: the end's gather,
  where the others warn that it gave up.

In modes ``on`` and ``off`` there is no agreement per micro-batch: the failed rank goes plain at once and the
others hear of it at the end. With ``AUTOOFFLOAD_SYNC_RANKS=0``, or a rank without layers, no collective is
made at all and giving up is local. From the collective that told every rank until the run ends, no rank makes
another: no mismatch, no hang, and nothing extra while nothing fails. A trainer that reinstalls checkpointing
between the failure and the next micro-batch may make the others watch other entries; the notice watches those
the controller watched when it gave up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .apply.functions import install_plain
from .apply.hooks import ForwardHooks
from .distributed import RankAgreement, RankGaveUp
from .guard import StepFaults, in_step, nothing
from .observe.inputs import read_micro_batch
from .observe.layout import ModelLayout
from .observe.stacks import Stack

PLAIN_CHECK = in_step("plain checkpointing's check")

# The entry points that run before a run's join: a rank that fails in one of them joins the others at once.
BEFORE_JOIN = ("attach", "on_train_begin", "Lightning on_train_start")
# The entry points at a run's end, where every rank gathers the worst peak: a rank failing in one owes it now.
AT_END = ("finish", "on_train_end", "Lightning on_train_end")


class RankNotice:
    """What stands, on a rank that gave up, where the ranks make a micro-batch's agreement: the controller's forward
    hooks, handed over (or, given up before it had any, hooks of its own on ``model`` and its ``entries``). At the
    first call whose agreement is due (being decided: :meth:`RankAgreement.deciding`), unless it carries no tokens
    and an entry inside it will (then that entry decides, as on the other ranks), it removes the hooks and makes
    the collective the other ranks make there (:meth:`RankAgreement.tell`). ``stacks``: the planned stacks, which
    the model's own call is read with."""

    def __init__(
        self,
        agreement: RankAgreement,
        hooks: ForwardHooks | None,
        stacks: Sequence[Stack],
        model: torch.nn.Module,
        entries: Sequence[tuple[torch.nn.Module, Sequence[Stack]]],
    ) -> None:
        self.agreement, self.stacks = agreement, list(stacks)
        if hooks is None:
            hooks = ForwardHooks(model, entries, self._enter, deciding=agreement.deciding)
        else:
            hooks.hand_over(self._enter)
        self.hooks: ForwardHooks | None = hooks

    @torch.compiler.disable
    def _enter(
        self, module: torch.nn.Module, stacks: Sequence[Stack] | None, args: tuple, kwargs: dict, deferrable: bool
    ) -> bool:
        if not self.agreement.due:  # not a training micro-batch, or its agreement was made before the failure
            return True
        if deferrable and not self._carries(module, stacks, args, kwargs):
            return False
        self.remove()
        with contextlib.suppress(Exception):  # nothing better to do: the collective itself failed
            self.agreement.tell()
        return True

    def _carries(self, module: torch.nn.Module, stacks: Sequence[Stack] | None, args: tuple, kwargs: dict) -> bool:
        """Whether the call carries tokens, read as the controller reads it (a reading that fails: it does)."""
        try:
            return read_micro_batch(module, self.stacks if stacks is None else list(stacks), args, kwargs) is not None
        except Exception:
            return True

    def remove(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None


class PlainCheckpointing:
    """Plain checkpointing on ``model`` until :meth:`remove`: installed at once (:func:`install_plain`), and again
    at a training forward that finds other functions in place. A trainer that turns checkpointing off and on again
    mid-run (TRL's generation) installs transformers' own functions, with the ``offload`` key of the training
    arguments' kwargs, which torch's reentrant checkpoint refuses; with autooffload's hooks gone, nothing else
    would take them over."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.installed = install_plain(model)
        # Shielded: where the check fails, the functions found stay (the run gave up already: noted nowhere).
        self._handle = model.register_forward_pre_hook(StepFaults().shield(PLAIN_CHECK, self._before, nothing))

    @torch.compiler.disable
    def _before(self, module: torch.nn.Module, args: tuple) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        if self.installed and all(getattr(m, a, None) is f for m, a, f in self.installed):
            return
        with contextlib.suppress(Exception):  # nothing better to do: the functions found stay
            self.installed = install_plain(self.model)

    def remove(self) -> None:
        self._handle.remove()


class Fallback:
    """What a run does when it gives up (see the module docstring): the warning, and the collective this rank
    owes the others. ``agreement``: the run's :class:`~autooffload.distributed.RankAgreement`; ``warn``: the
    controller's ``warn(key, message)``."""

    def __init__(self, agreement: RankAgreement, warn: Callable[[str, str], Any]) -> None:
        self.agreement = agreement
        self.warn = warn
        self.notice: RankNotice | None = None
        self.plain: PlainCheckpointing | None = None

    def give_up(
        self,
        where: str,
        error: BaseException,
        model: torch.nn.Module | None,
        hooks: ForwardHooks | None = None,
        layout: ModelLayout | None = None,
    ) -> None:
        """``where`` raised ``error`` (a :class:`~autooffload.distributed.RankGaveUp`: another rank gave up).
        ``model`` (None: not attached), the controller's forward ``hooks``, which this takes (kept for a notice,
        else removed), and its ``layout`` (the planned stacks and their entries), for a notice."""
        try:
            self._warn(where, error)
            if not isinstance(error, RankGaveUp):
                with contextlib.suppress(Exception):  # the collective failed: the process group is what is broken
                    hooks = self._tell(where, model, hooks, layout)
        finally:
            if hooks is not None:
                hooks.remove()

    def _warn(self, where: str, error: BaseException) -> None:
        if isinstance(error, RankGaveUp):
            since = "the start" if where in BEFORE_JOIN else "this micro-batch on, this one included"
            self.warn(
                "rank-gave-up",
                f"rank {error.rank} gave up (its own warning says why), so every rank goes on with plain "
                f"checkpointing from {since}",
            )
            return
        self.warn(
            "failed",
            f"internal error in {where} ({type(error).__name__}: {error}); autooffload stops and the run goes on "
            "with plain checkpointing (please report this with the model's config)",
        )

    def _tell(
        self, where: str, model: torch.nn.Module | None, hooks: ForwardHooks | None, layout: ModelLayout | None
    ) -> ForwardHooks | None:
        """Make the collective this rank owes, or leave a notice that makes it; returns the hooks it did not keep."""
        agreement = self.agreement
        if not agreement.active() or agreement.gave_up is not None or agreement.owing:
            return hooks
        if not agreement.joined:
            if where in BEFORE_JOIN:
                agreement.join(False, gave_up=True)
            return hooks  # otherwise the next attach joins with the flag (attach_refused)
        if not agreement.ranks_agree:
            return hooks
        agreement.owing = True
        if where in AT_END:
            agreement.worst(None)
        elif agreement.per_micro_batch() and model is not None and (hooks is not None or layout is not None):
            stacks, entries = (layout.stacks, layout.entries) if layout is not None else ((), ())
            self.notice = RankNotice(agreement, hooks, stacks, model, entries)
            return None
        return hooks

    def keep_plain(self, model: torch.nn.Module) -> None:
        """Plain checkpointing on ``model`` until the model is let go of (:meth:`let_go`) or the run ends."""
        self.let_go()
        self.plain = PlainCheckpointing(model)

    def let_go(self) -> None:
        """The model is detached: stop keeping plain checkpointing on it."""
        if self.plain is not None:
            self.plain.remove()
            self.plain = None

    def attach_refused(self, model: torch.nn.Module) -> bool:
        """``attach`` on a controller that gave up in this run: attach nothing (False, what ``attach`` returns), but
        put plain checkpointing on ``model`` (the trainer's own functions may carry an ``offload`` key that fails or
        always offloads), and make the join the other ranks make there, with the flag, where it is still owed."""
        with contextlib.suppress(Exception):  # the functions found stay
            self.keep_plain(model)
        agreement = self.agreement
        if agreement.active() and not agreement.joined:
            agreement.join(False, gave_up=True)
        return False

    def end(self) -> None:
        """The run ended: nothing is owed any more."""
        if self.notice is not None:
            self.notice.remove()
            self.notice = None
        self.let_go()
        self.agreement.end_run()
