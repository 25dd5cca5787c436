"""Many ranks: one offload level per micro-batch for the whole group, and the worst rank's memory at the end.

Ranks see different micro-batches (one long, one short) and each reads its own device. Deciding alone, the
rank with the short micro-batch keeps its saved inputs on the device while its neighbour offloads: under
FSDP or ZeRO-3 the step is as slow as the slowest rank anyway, and under torch.compile the ranks would run
different graphs and recompile at different steps. So before every training micro-batch's forward the ranks
agree on the largest level any of them asked for, with one ``all_reduce(MAX)`` of seven integers (the level; negated
so that MAX gives their minimum, the host-memory cap and the keep count; a rank that gave up, and what the end's
collective says, see below).

What a policy sees: ``decide`` gets this rank's own observation (its sequence length, its memory reading).
When the group's level differs from what it decided, the planner (:mod:`autooffload.decide.planner`) tells it
through an optional method ``agreed(observation, level)``, so that a stateful policy counts its dwell from the
same switch as every other rank (``HysteresisPolicy`` takes the group's level as its own state). A policy without
the method keeps its own state, and the group's level is still the maximum of the ranks' decisions.

The same collective carries each rank's host-memory cap (the most layers its budget holds), and the group
runs the smallest: ``min(max of the levels, min of the caps)``, one level on every rank.

Cost: one collective per training micro-batch, on the host. The decision's inputs live on the host, so the
ranks agree over a gloo group made once at attach (:class:`AgreementGroup`); where the default group's
backend already takes CPU tensors (gloo, ``"cpu:gloo,cuda:nccl"``) that group is used as it is. Over NCCL the
tensor would live on the device, and reading the result would wait for all the work queued there: a
host-device synchronisation before every forward. Only without gloo does it fall back to that (measure
both with ``benchmarks/rank_agreement.py``).

Every rank must make the same calls: autooffload makes one per training-mode forward under grad of the
attached model, and none in ``mode="on"``/``"off"`` (the level is fixed by the settings, alike on every rank).
Data-parallel training (DDP, FSDP, ZeRO) runs the same forwards on every rank; ranks that run different models
(pipeline stages) must turn it off: ``AUTOOFFLOAD_SYNC_RANKS=0``. Ranks that run different numbers of micro-batches
fail safe, with one warning (``uneven-micro-batches``): under DDP's ``join()`` (uneven inputs), which shadows only
the collectives it knows of, no rank agrees from the first micro-batch under it (every rank sees it there); outside
it, the end's collective is of the same size as an agreement (the worst peak rides in it, not in a gather of its
own), so a rank that ended meets the others' next agreement, and they learn it there: no rank makes another.

Each collective's bookkeeping (the join made, a micro-batch's agreement no longer due, the end reached) is marked
only as the ``torch.distributed`` call is entered, once everything that can fail before it has run (the message
built, the side group made, the rank read, the tensor made: the ``made`` of :func:`all_reduce_max` and
:func:`join_ranks`): a failure before the call leaves the collective owed, so the give-up makes it
(:mod:`autooffload.fallback`) where the other ranks wait in it. Marked before, a rank that failed there skipped it:
its next collective (DDP's gradient all-reduce) met the others' agreement and gloo aborted both, or the others waited
out the timeout.

A rank that gives up (:mod:`autooffload.guard`) cannot simply stop making these collectives: the others would
meet their next one (DDP's gradient all-reduce: gloo aborts both) or wait in it (NCCL, with the agreement on a
gloo side group: a hang). So each collective carries "a rank gave up", and the rank that failed keeps making
exactly the ones it owes, with that flag, until every rank knows (:mod:`autooffload.fallback`); from then on no
rank makes another until the run ends. Without a failure the collectives are the same as ever, none extra.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from .guard import StepFaults, in_step

DECIDING = in_step("the agreement falling due")


def world_size() -> int:
    """Ranks in the default process group; 1 when torch.distributed is absent or not initialised."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size()


def collective_device() -> torch.device:
    """Where a small tensor must live for the default group's backend: the host where the backend takes CPU
    tensors (gloo, mpi, a ``cpu:`` entry), else the current device of the accelerator (NCCL: CUDA)."""
    backend = str(torch.distributed.get_backend()).lower()
    if any(name in backend for name in ("gloo", "mpi", "cpu:")):
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = getattr(torch, "accelerator", None)
    kind = accelerator.current_accelerator() if accelerator is not None else None
    if kind is None:
        return torch.device("cpu")
    return torch.device(kind.type, accelerator.current_device_index())


def takes_cpu_tensors() -> bool:
    """Does the default group's backend carry CPU tensors (gloo, mpi, or a ``cpu:`` entry)?"""
    backend = str(torch.distributed.get_backend()).lower()
    return any(name in backend for name in ("gloo", "mpi", "cpu:"))


class AgreementGroup:
    """Where the agreement runs: a gloo side group when the default backend cannot take CPU tensors (NCCL),
    else the default group; the small tensor then always lives on the host. Made once, at attach, by every
    rank at the same point (``new_group`` is itself a collective over the default group). ``always_side``:
    make the side group even where the default group would do (a benchmark compares the two)."""

    def __init__(self, always_side: bool = False) -> None:
        self.group = None
        self.device = torch.device("cpu")
        self.side = False
        if takes_cpu_tensors() and not always_side:
            return
        if torch.distributed.is_gloo_available():
            self.group = torch.distributed.new_group(backend="gloo")
            self.side = True
        else:
            self.device = collective_device()


def all_reduce_max(
    values: list[int], group: AgreementGroup | None = None, made: Callable[[], None] | None = None
) -> list[int]:
    """The largest of each of ``values`` over all ranks (a collective: every rank must call it).
    Without ``group``, over the default group on its backend's device. ``made()``: called as the collective is
    entered, once everything before it went through (the caller's mark that it was made, module docs)."""
    device = collective_device() if group is None else group.device
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    if made is not None:
        made()
    torch.distributed.all_reduce(
        tensor, op=torch.distributed.ReduceOp.MAX, group=None if group is None else group.group
    )
    return tensor.tolist()


def join_ranks(
    ready: bool, gave_up: bool, group: AgreementGroup, made: Callable[[], None] | None = None
) -> tuple[bool, int | None]:
    """The join at attach (a collective, once per run): whether ``ready`` holds on every rank, and the rank that gave
    up (``gave_up`` on it; the highest such rank), or None. A rank that found no layer to control makes none of the
    collectives the others make per micro-batch and at the end; they would wait for it forever, so then no rank
    makes them. ``made()``: called as the collective is entered, once everything before it went through."""
    rank = torch.distributed.get_rank()
    tensor = torch.tensor([int(not ready), rank + 1 if gave_up else 0], dtype=torch.int64, device=group.device)
    if made is not None:
        made()
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group.group)
    not_ready, quitter = tensor.tolist()
    return not_ready == 0, quitter - 1 if quitter else None


class RankGaveUp(Exception):
    """Another rank gave up (its own warning says why): this one goes plain too, from the same micro-batch on."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank} gave up")
        self.rank = rank


# One collective's integers, the same at every point of a run after the join (a micro-batch's agreement, a give-up's
# notice, the end), so that ranks out of step (one at its end, another still in a micro-batch) meet in a collective
# of the same size and learn it, instead of aborting: the level, the host cap and the keep count (negated where the
# group needs the minimum), a rank that gave up (its rank + 1), whether a rank is at its end and whether every rank
# is (negated), and the worst peak memory fraction with its rank (:func:`peak_code`).
LEVEL, CAP, KEEP, QUITTER, ENDED, ALL_ENDED, PEAK = range(7)
PEAK_SCALE = 10**6  # a peak fraction's resolution in the end's collective


def message(level: int = 0, cap: int = 0, keep: int = 0, quitter: int = 0, ended: bool = False, peak: int = 0) -> list:
    """The integers this rank sends (see :data:`LEVEL`): ``quitter`` its rank + 1 where it gave up."""
    return [level, -cap, -keep, quitter, int(ended), -int(ended), peak]


def peak_code(fraction: float | None, rank: int, world: int) -> int:
    """``fraction`` and ``rank`` as one integer whose maximum over the ranks is the worst peak (the lowest rank on a
    tie); 0: no reading."""
    if fraction is None or fraction < 0 or fraction != fraction:
        return 0
    return round(fraction * PEAK_SCALE) * world + (world - 1 - rank) + 1


def worst_of(code: int, world: int) -> RankPeak | None:
    """The worst rank's peak from the maximum of :func:`peak_code` over the ranks; None where no rank had one."""
    if code <= 0:
        return None
    fraction, place = divmod(code - 1, world)
    return RankPeak(fraction / PEAK_SCALE, world - 1 - place, world)


def under_join() -> bool:
    """Whether this call runs inside a module run under a ``join()`` context (DDP's uneven-inputs support): ranks
    may then run different numbers of micro-batches, and ``join()`` shadows the collectives it knows of only."""
    frame = sys._getframe(1)
    while frame is not None:
        if _joining(frame.f_locals.get("self")):
            return True
        frame = frame.f_back
    return False


def _joining(candidate: Any) -> bool:
    """Whether ``candidate`` (a frame's ``self``: any object of the user's call stack) is a module under ``join()``.
    Read statically, without running its code: a user class's ``__getattr__`` (``return self.cfg[name]``) raises
    ``KeyError``, which ``getattr``'s default does not catch, out of ``model(...)``."""
    try:
        config = inspect.getattr_static(candidate, "_join_config", None)
        return getattr(config, "enable", False) is True
    except Exception:
        return False


UNEVEN = (
    "the ranks run different numbers of micro-batches ({}), so autooffload stops agreeing on one level: each rank "
    "decides alone from here on (set AUTOOFFLOAD_SYNC_RANKS=0 for such runs)"
)


class RankAgreement:
    """This rank's part in the agreement: the group (made at :meth:`join`), whether every rank has layers, the one
    collective per micro-batch, and what a rank that gave up still owes the others (:mod:`autooffload.fallback`).

    A run's collectives, in order, the same on every rank: the join at attach; with mode ``auto``, one agreement
    per training micro-batch; the gather at the end (:meth:`worst`). Each carries whether a rank gave up, so that
    a rank that fails makes exactly the collectives it owes, with that flag, until every rank knows; from then on
    no rank makes another until the run ends. ``settings``: the run's (``sync_ranks`` and ``mode`` say whether to
    agree); ``warn``: ``warn(key, message)``, once per key."""

    def __init__(
        self, settings: Any, warn: Callable[[str, str], Any] | None = None, faults: StepFaults | None = None
    ) -> None:
        self.settings = settings
        self.warn = warn if warn is not None else (lambda key, message: None)
        # The forward hooks call it inside the step, in the user's forward: shielded (autooffload.guard).
        self._deciding = (faults or StepFaults()).shield(DECIDING, self._decide, self._fall_due)
        self.group: AgreementGroup | None = None
        self.ranks_agree = True  # False when a rank found no layers at attach: then no rank makes collectives
        self.end_run()

    def end_run(self) -> None:
        """A run ended (or a new one starts): the next collective is the next run's join."""
        self.joined = False  # this run's join was made
        self.due = False  # a training micro-batch is being decided and its agreement is not made yet
        self.gave_up: int | None = None  # the rank that gave up, once every rank knows: no collective after
        self.owing = False  # this rank gave up and the others do not know yet

    def active(self) -> bool:
        """Whether this run's ranks make collectives at all."""
        return bool(self.settings.sync_ranks) and world_size() > 1

    def per_micro_batch(self) -> bool:
        """Whether every training micro-batch makes the agreement's collective now."""
        live = self.joined and self.ranks_agree and self.gave_up is None and self.settings.mode == "auto"
        return live and self.active()

    def deciding(self, on: bool) -> None:
        """A training micro-batch under grad is being decided (the forward hooks say so around the call that decides,
        :class:`~autooffload.apply.hooks.ForwardHooks`): its agreement is due from then until :meth:`agree` makes it,
        or the call is passed by to an entry inside it, or the decision is over (``on`` False) without it. Under
        DDP's ``join()`` (uneven inputs) no rank agrees any more: every rank sees it at the same micro-batch. Runs
        shielded: a failure is noted for the next entry point, and the agreement falls due all the same, so that a
        rank giving up there still makes it (:meth:`_fall_due`)."""
        self._deciding(on)

    def _decide(self, on: bool) -> None:
        if on and self.per_micro_batch() and under_join():
            self.out_of_step("DDP's join()")
        self._fall_due(on)

    def _fall_due(self, on: bool) -> None:
        self.due = on and self.per_micro_batch()

    def out_of_step(self, why: str) -> None:
        """The ranks run different numbers of micro-batches: no collective of autooffload's from here to the run's
        end (one warning), and nothing owed (the ranks that ended make none)."""
        self.ranks_agree, self.due, self.owing = False, False, False
        self.warn("uneven-micro-batches", UNEVEN.format(why))

    def _exchange(self, values: list[int], made: Callable[[], None]) -> list[int] | None:
        """One collective of :func:`message`'s integers (``made()`` as it is entered); None where a rank was at its
        end and this one was not."""
        result = all_reduce_max(values, self.group, made)
        if result[ENDED] and not values[ENDED]:
            self.out_of_step("a rank ended its run while this one has micro-batches left")
            return None
        return result

    def join(self, ready: bool, warn: Callable[[str, str], Any] | None = None, *, gave_up: bool = False) -> None:
        """Every rank attaches at the same point, with layers to control or not: make the side group there
        (``new_group`` is a collective) and learn whether every rank has layers; if one has none, no rank makes
        the per-micro-batch and end-of-training collectives, which that rank would never join. ``gave_up``: this
        rank gave up before it got here; every rank then gives up (:class:`RankGaveUp` on the others)."""
        warn = warn or self.warn
        if not self.active():
            return
        self.end_run()
        if self.group is None:
            self.group = AgreementGroup()
        self.ranks_agree, quitter = join_ranks(ready, gave_up, self.group, self._joined)
        if quitter is not None:
            self.gave_up, self.ranks_agree = quitter, False
            if not gave_up:
                raise RankGaveUp(quitter)
        elif not self.ranks_agree:
            warn(
                "ranks-without-layers",
                "a rank has no checkpointed layers for autooffload to control, so the ranks do not agree on one "
                "offload level: each decides alone (AUTOOFFLOAD_SYNC_RANKS=0 silences this)",
            )

    # The marks that a collective was made, each set as its torch.distributed call is entered (module docs).
    def _joined(self) -> None:
        self.joined = True

    def _agreed(self) -> None:
        self.due = False  # a failure after this point owes the next micro-batch's agreement

    def _told(self) -> None:
        self.due, self.owing = False, False

    def agree(self, level: int, cap: int, keep: int, layers: int) -> tuple[int, int]:
        """The plan every rank runs: the most offload any rank asked for, capped at the smallest rank's host-memory
        ``cap``, and the least keep (``recompute="auto"``), in one collective, when there is a group to ask. Raises
        :class:`RankGaveUp` when a rank gave up."""
        if not self.per_micro_batch():
            return level, keep
        values = message(level, cap, keep)
        result = self._exchange(values, self._agreed)
        if result is None:
            return level, keep
        if result[QUITTER]:
            self.gave_up = result[QUITTER] - 1
            raise RankGaveUp(result[QUITTER] - 1)
        return min(result[LEVEL], -result[CAP]), -result[KEEP]

    def tell(self) -> None:
        """This rank gave up inside a micro-batch whose agreement is due, or at the next one's start: make that
        collective now with the flag (and nothing else, since this rank's parts may be broken)."""
        values = message(quitter=torch.distributed.get_rank() + 1)
        result = self._exchange(values, self._told)
        if result is not None:
            self.gave_up = result[QUITTER] - 1

    def worst(self, fraction: float | None) -> RankPeak | None:
        """The worst rank's peak memory fraction (the end's collective, on every rank), where the ranks agree at all
        and nobody gave up; a rank that gave up and has not told the others tells them here. Ends the run, once the
        collective is made: a failure before it leaves it owed (the give-up at the end makes it)."""
        if not self.joined or not self.ranks_agree or self.gave_up is not None or not self.active():
            self.end_run()
            return None
        rank, world = torch.distributed.get_rank(), world_size()
        values = message(quitter=rank + 1 if self.owing else 0, ended=True, peak=peak_code(fraction, rank, world))
        owing = self.owing
        result = all_reduce_max(values, self.group, self.end_run)  # made, and the run ended, as it is entered
        if not result[ALL_ENDED]:  # another rank was still in a micro-batch: it learned that this one ended
            self.warn(
                "uneven-micro-batches", UNEVEN.format("this rank ended its run while another had micro-batches left")
            )
            return None
        if result[QUITTER] and not owing:
            self.warn(
                "rank-gave-up",
                f"rank {result[QUITTER] - 1} gave up during training (its own warning says why); this rank learned it "
                "at the end (no agreement per micro-batch in modes on and off, or no micro-batch after the failure) "
                "and finished with autooffload",
            )
        return worst_of(result[PEAK], world)


@dataclasses.dataclass(frozen=True)
class RankPeak:
    """The highest peak memory fraction any rank read during training, and which rank read it."""

    fraction: float
    rank: int
    world_size: int
