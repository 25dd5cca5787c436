"""Giving up: plain checkpointing on this rank, and on every rank from the same micro-batch on.

When an entry point fails (:mod:`autooffload.guard`), the controller warns once, removes its hooks and installs
plain checkpointing (:meth:`~autooffload.controller.OffloadController.give_up`). With one process that is all.
Under torch.distributed the other ranks make the agreement's collectives (:mod:`autooffload.distributed`) at
fixed points of the run: the join at attach, one agreement per training micro-batch (mode ``auto``), the gather
at the end. A rank that stopped making them would leave the others in a collective it never joins: a mismatch
with DDP's next all-reduce (gloo aborts every process) or a wait until the timeout (NCCL). So the rank that
failed makes the one collective it owes, with the flag "this rank gave up", and every rank learns it there:

- failed inside ``attach`` or ``on_train_begin`` before this run's join: the join, at once; every rank gives up
  at attach. Failed before a run began (a load): the join, at the next ``attach``, which a rank that gave up
  still makes (it attaches nothing);
- failed in a training micro-batch's forward before its agreement (the pre-forward hook): that agreement, at
  once; every rank runs that micro-batch and the rest on plain checkpointing;
- failed anywhere else during the run (a layer's report in the forward or the backward, ``end_step``, a save,
  a Trainer event): the next training micro-batch's agreement, made by a :class:`RankNotice`, a pre-forward hook
  that depends on nothing but the agreement's group; every rank is on plain checkpointing from that
  micro-batch on (this one since it failed: placement only, results are the same);
- failed at the end (``finish``, ``on_train_end``), or no micro-batch came after the failure: the end's gather,
  where the others warn that it gave up.

In modes ``on`` and ``off`` there is no agreement per micro-batch: the failed rank goes plain at once and the
others hear of it at the end. With ``AUTOOFFLOAD_SYNC_RANKS=0``, or a rank without layers, no collective is
made at all and giving up is local. From the collective that told every rank until the run ends, no rank makes
another: no mismatch, no hang, and nothing extra while nothing fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .apply.functions import install_plain
from .distributed import RankAgreement, RankGaveUp

# The entry points that run before a run's join: a rank that fails in one of them joins the others at once.
BEFORE_JOIN = ("attach", "on_train_begin", "Lightning on_train_start")
# The entry points at a run's end, where every rank gathers the worst peak: a rank failing in one owes it now.
AT_END = ("finish", "on_train_end", "Lightning on_train_end")


class RankNotice:
    """The least a rank that gave up needs to be at the next training micro-batch: a pre-forward hook on each of
    ``modules`` (the model and its entries) that, at the first call in train mode under grad, removes itself and
    calls ``tell`` (the collective the other ranks make there)."""

    def __init__(self, modules: Sequence[torch.nn.Module], tell: Callable[[], None]) -> None:
        self._tell = tell
        self._handles = [module.register_forward_pre_hook(self._before) for module in modules]

    @torch.compiler.disable
    def _before(self, module: torch.nn.Module, args: tuple) -> None:
        if not self._handles or not module.training or not torch.is_grad_enabled():
            return
        self.remove()
        with contextlib.suppress(Exception):  # nothing better to do: the collective itself failed
            self._tell()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class PlainCheckpointing:
    """Plain checkpointing on ``model`` until :meth:`remove`: installed at once (:func:`install_plain`), and again
    at a training forward that finds other functions in place. A trainer that turns checkpointing off and on again
    mid-run (TRL's generation) installs transformers' own functions, with the ``offload`` key of the training
    arguments' kwargs, which torch's reentrant checkpoint refuses; with autooffload's hooks gone, nothing else
    would take them over."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.installed = install_plain(model)
        self._handle = model.register_forward_pre_hook(self._before)

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
        self, where: str, error: BaseException, model: torch.nn.Module | None, entries: Sequence[torch.nn.Module]
    ) -> None:
        """``where`` raised ``error`` (a :class:`~autooffload.distributed.RankGaveUp`: another rank gave up).
        ``model`` and its ``entries``: where a training micro-batch enters (None: not attached), for a notice."""
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
        modules = [model, *(entry for entry in entries if entry is not model)] if model is not None else []
        with contextlib.suppress(Exception):  # the collective itself failed: the process group is what is broken
            self._tell(where, modules)

    def _tell(self, where: str, modules: Sequence[torch.nn.Module]) -> None:
        agreement = self.agreement
        if not agreement.active() or agreement.gave_up is not None or agreement.owing:
            return
        if not agreement.joined:
            if where in BEFORE_JOIN:
                agreement.join(False, gave_up=True)
            return  # otherwise the next attach joins with the flag (attach_refused)
        if not agreement.ranks_agree:
            return
        agreement.owing = True
        if agreement.due:
            agreement.tell()
        elif where in AT_END:
            agreement.worst(None)
        elif agreement.per_micro_batch() and modules:
            self.notice = RankNotice(modules, agreement.tell)

    def keep_plain(self, model: torch.nn.Module) -> None:
        """Plain checkpointing on ``model`` until the model is let go of (:meth:`let_go`) or the run ends."""
        self.let_go()
        self.plain = PlainCheckpointing(model)

    def let_go(self) -> None:
        """The model is detached: stop keeping plain checkpointing on it."""
        if self.plain is not None:
            self.plain.remove()
            self.plain = None

    def attach_refused(self) -> None:
        """``attach`` on a controller that gave up in this run: attach nothing, but make the join the other ranks
        make there, with the flag, where this run's join is still owed."""
        agreement = self.agreement
        if agreement.active() and not agreement.joined:
            agreement.join(False, gave_up=True)

    def end(self) -> None:
        """The run ended: nothing is owed any more."""
        if self.notice is not None:
            self.notice.remove()
            self.notice = None
        self.let_go()
        self.agreement.end_run()
