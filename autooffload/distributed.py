"""Many ranks: one offload level per micro-batch for the whole group, and the worst rank's memory at the end.

Ranks see different micro-batches (one long, one short) and each reads its own device. Deciding alone, the
rank with the short micro-batch keeps its saved inputs on the device while its neighbour offloads: under
FSDP or ZeRO-3 the step is as slow as the slowest rank anyway, and under torch.compile the ranks would run
different graphs and recompile at different steps. So before every training micro-batch's forward the ranks
agree on the largest level any of them asked for, with one ``all_reduce(MAX)`` of three integers (the level, and,
negated so that MAX gives their minimum, the host-memory cap and the keep count).

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
(pipeline stages) or different numbers of micro-batches must turn it off: ``AUTOOFFLOAD_SYNC_RANKS=0``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


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


def all_reduce_max(values: list[int], group: AgreementGroup | None = None) -> list[int]:
    """The largest of each of ``values`` over all ranks (a collective: every rank must call it).
    Without ``group``, over the default group on its backend's device."""
    device = collective_device() if group is None else group.device
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    torch.distributed.all_reduce(
        tensor, op=torch.distributed.ReduceOp.MAX, group=None if group is None else group.group
    )
    return tensor.tolist()


def every_rank(ready: bool, group: AgreementGroup) -> bool:
    """True when ``ready`` holds on every rank (a collective, made once at attach). A rank that found no layer
    to control makes none of the collectives the others make per micro-batch and at the end; they would wait
    for it forever, so then no rank makes them."""
    tensor = torch.tensor([int(not ready)], dtype=torch.int64, device=group.device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group.group)
    return int(tensor.item()) == 0


class RankAgreement:
    """This rank's part in the agreement: the group (made at :meth:`join`), whether every rank has layers, and the
    one collective per micro-batch. ``settings``: the run's (``sync_ranks`` and ``mode`` say whether to agree)."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.group: AgreementGroup | None = None
        self.ranks_agree = True  # False when a rank found no layers at attach: then no rank makes collectives

    def join(self, ready: bool, warn: Callable[[str, str], Any]) -> None:
        """Every rank attaches at the same point, with layers to control or not: make the side group there
        (``new_group`` is a collective) and learn whether every rank has layers; if one has none, no rank makes
        the per-micro-batch and end-of-training collectives, which that rank would never join."""
        if not self.settings.sync_ranks or world_size() < 2:
            return
        if self.group is None:
            self.group = AgreementGroup()
        self.ranks_agree = every_rank(ready, self.group)
        if not self.ranks_agree:
            warn(
                "ranks-without-layers",
                "a rank has no checkpointed layers for autooffload to control, so the ranks do not agree on one "
                "offload level: each decides alone (AUTOOFFLOAD_SYNC_RANKS=0 silences this)",
            )

    def agree(self, level: int, cap: int, keep: int, layers: int) -> tuple[int, int]:
        """The plan every rank runs: the most offload any rank asked for, capped at the smallest rank's host-memory
        ``cap``, and the least keep (``recompute="auto"``), in one collective, when there is a group to ask."""
        settings = self.settings
        if not settings.sync_ranks or not self.ranks_agree or settings.mode != "auto" or world_size() < 2:
            return level, keep
        most, least_cap, fewest_kept = all_reduce_max([level, -cap, -keep], self.group)
        return min(most, -least_cap), -fewest_kept

    def worst(self, fraction: float | None) -> RankPeak | None:
        """The worst rank's peak memory fraction (a collective on every rank), where the ranks agree at all."""
        return worst_rank(fraction, self.settings.sync_ranks and self.ranks_agree, self.group)


@dataclasses.dataclass(frozen=True)
class RankPeak:
    """The highest peak memory fraction any rank read during training, and which rank read it."""

    fraction: float
    rank: int
    world_size: int


def worst_rank(fraction: float | None, enabled: bool = True, group: AgreementGroup | None = None) -> RankPeak | None:
    """Gather every rank's peak memory fraction (a collective) and return the worst; None when not distributed,
    not ``enabled``, or no rank had a reading."""
    size = world_size()
    if not enabled or size < 2:
        return None
    device = collective_device() if group is None else group.device
    mine = torch.tensor([-1.0 if fraction is None else fraction], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    torch.distributed.all_gather(gathered, mine, group=None if group is None else group.group)
    readings = [float(value.item()) for value in gathered]
    rank = max(range(size), key=readings.__getitem__)
    return None if readings[rank] < 0 else RankPeak(readings[rank], rank, size)
