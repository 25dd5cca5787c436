"""The matrix's fixed run (a tiny model, its lengths, its steps), a configuration, a fault and the window of the
run it strikes in, and this process's rank."""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch

LAYERS, HIDDEN, VOCAB = 4, 64, 256
STEPS, ACCUMULATION, SAVE_EVERY = 6, 2, 3
LENGTHS = (32, 256, 48, 224, 32, 192, 40, 256, 32, 96, 224, 32)  # per micro-batch, one optimizer step = 2
DEVICE_BYTES = "2.4MiB"  # the simulated device: long micro-batches offload, short ones keep (recompute="auto")
THRESHOLDS = dict(seq_high=200, seq_low=100, min_steps=1)  # the hysteresis policy's, on these lengths
TIMEOUT = datetime.timedelta(seconds=60)  # the process group's: a rank left waiting fails instead of hanging
BATCH_TIMEOUT_S = 1800
TOPOLOGIES = ("one", "ddp", "zero3")
ENGINES, POLICIES, RECOMPUTES = ("sync", "stream"), ("predictive", "hysteresis"), ("always", "auto")
PROBE_FAULTS = ("nvml-error", "none", "above-1", "nan", "reset-raises")
HOST_FAULTS = ("allocate-fails", "pin-fails", "host-runs-out")
# The names of autooffload's checkpoint functions other than plain checkpointing's.
ACTIVE_FUNCTIONS = ("checkpoint_offload", "checkpoint_keep", "checkpoint_keep_measured", "checkpoint_plain_measured")


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration: ``model`` "qwen3", "t5" (an encoder-decoder: the model and both stacks are entries) or
    "inner" (a Qwen3 whose loss is computed from ``model.model(...)``, as TRL's fused-loss paths do: the top model's
    forward never runs on one process, and runs without tokens through DDP or DeepSpeed, the call redirected)."""

    topology: str = "one"
    engine: str = "sync"
    policy: str = "predictive"
    recompute: str = "always"
    model: str = "qwen3"

    @property
    def name(self) -> str:
        return f"{self.topology}/{self.model}/{self.engine}/{self.policy}/{self.recompute}"


@dataclasses.dataclass(frozen=True)
class Fault:
    """``kind``: "none", "entry" (a guarded entry point), "step" (a place of autooffload's inside a step,
    ``autooffload.guard.IN_STEP``), "probe", "host" or "kill"; ``name``: the entry point, the place or the fault's
    name; ``timing``: "before" or "after" the entry's body; ``at``: which call of it fails, in ``window`` (the
    moment of the run that call was in, :class:`Moment`); ``run``: "fresh", "resumed" (from the fault-free run's
    checkpoint) or "rescued" (an out-of-memory step injected)."""

    kind: str = "none"
    name: str = ""
    timing: str = "before"
    at: int = 1
    run: str = "fresh"
    ranks: str = "last"  # which ranks fail: "last" (rank 1 of 2, or the only one), "first" (rank 0) or "all"
    window: str = ""

    @property
    def label(self) -> str:
        parts = (["after its body"] if self.timing == "after" else []) + {
            "last": [], "first": ["rank 0"], "all": ["every rank"]
        }[self.ranks]  # fmt: skip
        detail = f" ({', '.join(parts)})" if parts else ""
        return self.kind if self.kind in ("none", "kill") else f"{self.kind}: {self.name}{detail}"

    def failing(self, rank: int, world: int) -> bool:
        """Whether ``rank`` of ``world`` is one this fault strikes."""
        return self.ranks == "all" or rank == (0 if self.ranks == "first" else world - 1)


class InjectedFault(RuntimeError):
    """The exception the matrix raises inside autooffload."""


# ---- the moments of a training run ---------------------------------------------------------------------------


class Moment:
    """Where the running Trainer is, so that each call of autooffload's is filed under the window of the run it
    falls in: a training micro-batch (the run's first, or a non-last or the last of an accumulation), its forward or
    its backward; an evaluation; or outside any micro-batch (a step's start or end, a save, a log, the run's start
    and end). The matrix fails each entry point and place once in each window the fault-free run called it in."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.micro, self.steps, self.in_micro, self.evaluating = 0, 0, False, False

    def window(self) -> str:
        if self.evaluating:
            return "evaluation"
        if not self.in_micro:
            return "outside a micro-batch"
        first = self.steps == 0 and self.micro == 1
        position = "the run's first" if first else ("the last" if self.micro == ACCUMULATION else "a non-last")
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        return f"{position} micro-batch, {phase}"


MOMENT = Moment()


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
