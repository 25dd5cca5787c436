"""The record of a run: what it did, counted, per micro-batch, per step and in total, and told to a person.

The controller hands it each micro-batch's plan and each step's end; it keeps the counters a resumed run must
continue (steps, switches, bytes moved, rescues, the level in place), the history records not yet written
(:mod:`autooffload.history`), the ``autooffload/*`` metrics for a training log, the lines a switch
(:mod:`autooffload.console`) or a host cap is worth, and the summary at the end of training.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .apply.offload import OffloadStats
from .console import logger, say
from .decide.planner import Plan
from .distributed import RankPeak
from .history import REASONS, HistoryRecorder
from .observe.costs import StepCosts
from .observe.memory import Reading


def why(plan: Plan) -> str:
    """A switch's reason as a person reads it, with the history's key for it (``reasons`` in history.jsonl)."""
    reason = plan.reason or "policy"
    return f"{REASONS.get(reason, reason)} ({reason})"


class RunRecord:
    """Counters, history and metrics of one run. ``stats``: the bytes the engines move (the switch adds to it)."""

    def __init__(self, warn: Callable[[str, str], Any]) -> None:
        self.warn = warn
        self.stats = OffloadStats()
        self.reinstalls = 0  # switches rebuilt because a trainer replaced the functions, over the object's life
        self.costs = StepCosts()  # what each step cost beside its compute (collections, host buffers, the probe)
        self.last_step_costs: dict[str, float] = {}
        self._cap_logged = False
        self.reset()

    def reset(self) -> None:
        """A new run: every counter from zero, no history pending (the stats object stays: the switch holds it)."""
        stats = self.stats
        stats.step_bytes = stats.total_bytes = stats.tensors = stats.step_short_bytes = stats.short_bytes = 0
        stats.take_short_layers()
        self.step = 0
        self.switches = 0
        self.steps_offloading = 0
        self.rescues = 0
        self.last_step_bytes = 0
        self.last_step_short_bytes = 0  # bytes the last step was to move but kept on the device (host memory short)
        self.level: int | None = None  # layers offloading in the last micro-batch (what is installed)
        self.active = 0.0  # the same, as a share of the planned layers
        self.kept = 0.0  # layers kept in the last micro-batch, as a share of the planned layers
        self.micro_batches = 0
        self.offloaded_this_step = False
        self.worst_rank: RankPeak | None = None
        self.history = HistoryRecorder()

    def installed(self, offloaded: int, kept: int, layers: int) -> None:
        """What the switch has in place now."""
        self.level = offloaded
        self.active = offloaded / layers if layers else 0.0
        self.kept = kept / layers if layers else 0.0

    def micro_batch(
        self, seq_len: int, tokens: int, plan: Plan, before: int, kept: int, layers: int, host: tuple[int | None, str]
    ) -> None:
        """A micro-batch of ``seq_len`` and ``tokens`` runs ``plan`` (``before``: the level it replaced; ``kept``:
        the layers kept as installed; ``host``: this rank's host budget and the setting it came from)."""
        if plan.asked is not None and not self._cap_logged:
            self._cap_logged = True
            logger.info(
                "autooffload: step %d: offload capped at %d of the %d layer(s) asked for: the host memory budget "
                "(%.1f MiB for this rank, AUTOOFFLOAD_HOST_MEMORY=%s) holds no more at %d tokens",
                self.step + 1, plan.cap, plan.asked, (host[0] or 0) / 2**20, host[1], tokens,
            )  # fmt: skip
        if plan.switched:
            self.switches += 1
            say(
                "autooffload: step %d, seq %d: offload %d -> %d of %d layer(s): %s",
                self.step + 1, seq_len, before, plan.level, layers, why(plan),
            )  # fmt: skip
        self.offloaded_this_step |= plan.level > 0
        self.micro_batches += 1
        self.history.micro_batch(seq_len, tokens, self.level or 0, plan.reason, kept, plan.switched, plan.predicted)

    def ran(self, layers: int) -> None:
        """The micro-batch planned last has run: a layer that kept an input on the device for want of host memory
        did not offload, and its record and ``active`` say so (reason ``host_short``)."""
        short = len(self.stats.take_short_layers())
        if short and self.level:
            offloaded = max(self.level - short, 0)
            self.active = offloaded / layers if layers else 0.0
            self.history.fell_short(offloaded)

    def reinstalled(self) -> None:
        """A trainer replaced the checkpoint functions; autooffload's are installed again."""
        self.reinstalls += 1

    def rescue(self, layers: int) -> None:
        """The step ran out of device memory and is rerun with all ``layers`` offloaded."""
        self.rescues += 1
        self.history.rescue()
        logger.warning(
            "autooffload: step %d ran out of device memory; rerunning it with all %d layer(s) offloaded",
            self.step + 1,
            layers,
        )

    def close_step(self) -> int:
        """The step's bytes moved (and kept short), and whether it offloaded at all, are final: returns the bytes
        moved."""
        self.last_step_short_bytes = self.stats.step_short_bytes
        self.last_step_bytes = self.stats.next_step()
        self.steps_offloading += int(self.offloaded_this_step)
        self.offloaded_this_step = False
        return self.last_step_bytes

    def end_step(
        self, rescued: bool, reading: Reading, layers: int | None, settings: Any, sources: tuple[Any, float]
    ) -> None:
        """Count the step; with ``layers`` (attached), close its history record. ``reading``: the step's memory
        reading; ``sources``: the host memory manager and the probe's time so far, whose counts since the last step
        are what it cost beside its compute (:mod:`autooffload.observe.costs`)."""
        self.step += 1
        self.last_step_costs = self.costs.take(*sources)
        if layers is None:
            return
        moved = (self.last_step_bytes, self.last_step_short_bytes)
        memory = (reading.fraction, reading.bytes, reading.total)
        self.history.end_step(self.step, moved, rescued, memory, layers, settings, self.last_step_costs)
        if self.history.dropped:
            self.warn(
                "history-dropped",
                f"{self.history.limit} history records were never written; the oldest are dropped "
                "(call controller.write_history(path) now and then)",
            )

    def write(self, path: str | os.PathLike) -> int:
        """Append the records not yet written to ``path`` and forget them; one warning if it cannot be written."""
        try:
            return self.history.write(path)
        except OSError as error:
            self.warn("history-write", f"cannot write the history to {path} ({error}); the records wait in memory")
            return 0

    def metrics(self, host_bytes: int, memory_fraction: float | None) -> dict[str, float]:
        """The ``autooffload/*`` values for a training log."""
        logs = {
            "autooffload/active": self.active,
            "autooffload/kept": self.kept,
            "autooffload/offloaded_bytes": float(self.last_step_bytes),
            "autooffload/short_bytes": float(self.last_step_short_bytes),
            "autooffload/switches": float(self.switches),
            "autooffload/rescues": float(self.rescues),
            "autooffload/host_bytes": float(host_bytes),
        }
        if memory_fraction is not None:
            logs["autooffload/memory_fraction"] = memory_fraction
        return logs

    def summary(self, mode: str, peak_fraction: float | None, compile_budget: tuple[int, int, bool] | None) -> str:
        """One line for the end of training; ``compile_budget``: (switches spent, allowed, latched) when compiled."""
        share = self.steps_offloading / self.step if self.step else 0.0
        text = (
            f"autooffload: mode={mode}, {self.step} step(s), offload in {self.steps_offloading} "
            f"({share:.0%}), {self.switches} switch(es), {self.stats.total_bytes / 2**20:.1f} MiB moved to host"
        )
        if self.stats.short_bytes:
            text += f" ({self.stats.short_bytes / 2**20:.1f} MiB stayed on the device: host memory short)"
        if peak_fraction is not None:
            text += f", peak memory {peak_fraction:.2f} of device"
        if self.worst_rank is not None:
            worst = self.worst_rank
            text += f", worst of {worst.world_size} ranks: rank {worst.rank} at {worst.fraction:.2f}"
        if compile_budget is not None:
            spent, allowed, latched = compile_budget
            text += f", compile: {spent}/{allowed} recompiling switch(es)" + (", latched on" if latched else "")
        return text

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "switches": self.switches,
            "steps_offloading": self.steps_offloading,
            "total_bytes": self.stats.total_bytes,
            "short_bytes": self.stats.short_bytes,
            "level": self.level,
            "rescues": self.rescues,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state.get("step", 0))
        self.switches = int(state.get("switches", 0))
        self.steps_offloading = int(state.get("steps_offloading", 0))
        self.stats.total_bytes = int(state.get("total_bytes", 0))
        self.stats.short_bytes = int(state.get("short_bytes", 0))
        self.rescues = int(state.get("rescues", 0))
        self.level = state.get("level")
        if self.level is not None:
            self.micro_batches = 1  # the next change of level is a switch, as it would have been
