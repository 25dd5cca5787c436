"""The run: what a controller holds, learns and reports, part by part, from a fresh start or a checkpoint.

:class:`~autooffload.controller.OffloadController` is the per-micro-batch loop; this is everything that loop
reads and writes between two calls, each concern in the part that owns it:

- ``sizes`` (:mod:`~autooffload.observe.sizes`): what each planned layer's saved input weighs;
- ``memory`` (:mod:`~autooffload.observe.memory`): the probe and the last step's reading;
- ``planner`` (:mod:`~autooffload.decide.planner`): the policy, the keep planner, the compile budget;
- ``agreement`` (:mod:`~autooffload.distributed`): this rank's part in the ranks' one level;
- ``fallback`` (:mod:`~autooffload.fallback`): what giving up does, and what this rank then owes the others;
- ``record`` (:mod:`~autooffload.record`): the counters, the history, the metrics and the summary;
- ``host`` (:mod:`~autooffload.apply.host_memory`): the host buffers both engines take from.

A run starts fresh (:meth:`Run.reset`) or continues a saved one (``load_state_dict``); its state is the parts'
states side by side in one JSON-serialisable dict, with the identity of the model its measurements were taken
on (:mod:`autooffload.lifecycle`: they are dropped on a model of another identity).
"""

from __future__ import annotations

import os
from typing import Any

from . import lifecycle
from .apply.compile_guard import CompileBudget
from .apply.host_memory import HostMemory
from .apply.offload import OffloadStats
from .decide.planner import Planner
from .decide.policy import Policy
from .distributed import RankAgreement
from .fallback import Fallback
from .guard import StepFaults, guarded
from .history import StepRecord
from .observe.memory import MemoryMonitor
from .observe.probe import MemoryProbe
from .observe.sizes import LayerSizes
from .record import RunRecord
from .settings import PAGE, Settings, SettingsError, resolve
from .warn import WarnOnce


class Run:
    """The parts of a controller's run (see the module docstring), its start, its saved state and its report.

    The arguments are :class:`~autooffload.controller.OffloadController`'s: ``settings`` (default:
    ``Settings.from_env()``), overridden by the keyword arguments named like its fields, ``probe``, ``policy``
    and ``host``.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        mode: str | None = None,
        memory_high: float | None = None,
        memory_low: float | None = None,
        seq_high: int | None = None,
        seq_low: int | None = None,
        min_steps: int | None = None,
        compile_max_switches: int | None = None,
        engine: str | None = None,
        sync_ranks: bool | None = None,
        recompute: str | None = None,
        rescue: bool | None = None,
        host_memory: str | float | None = None,
        keep_margin: float | None = None,
        probe: MemoryProbe | str | None = "auto",
        policy: Policy | str | None = None,
        host: HostMemory | None = None,
    ) -> None:
        settings = resolve(
            settings,
            mode=mode,
            memory_high=memory_high,
            memory_low=memory_low,
            seq_high=seq_high,
            seq_low=seq_low,
            min_steps=min_steps,
            compile_max_switches=compile_max_switches,
            engine=engine,
            sync_ranks=sync_ranks,
            recompute=recompute,
            rescue=rescue,
            host_memory=host_memory,
            keep_margin=keep_margin,
            policy=policy if isinstance(policy, str) else None,
        )
        if not (policy is None or isinstance(policy, str) or callable(getattr(policy, "decide", None))):
            raise SettingsError(
                f"argument policy={policy!r} is not allowed: expected one of predictive, hysteresis, or an object "
                "with decide(observation) -> int"
            )
        self._settings = settings
        self.warn = WarnOnce()
        self.failed = False  # autooffload.guard gave up: plain checkpointing until the run ends
        self.faults = StepFaults()  # failures of its code inside a step, until an entry point gives up with them
        # A probe that stands for a device in the CPU's memory (SimulatedDevice) needs offloaded inputs moved out of it.
        self.host = host if host is not None else HostMemory(copy_cpu=bool(getattr(probe, "separate_host", False)))
        self._owns_host = host is None  # a manager passed in is the caller's: detach leaves its buffers to it
        self.sizes = LayerSizes()
        self.memory = MemoryMonitor(probe, self.warn, self.faults)
        self.agreement = RankAgreement(settings, self.warn, self.faults)
        self.fallback = Fallback(self.agreement, self.warn)
        policy = None if isinstance(policy, str) else policy
        self.planner = Planner(settings, self.warn, policy, CompileBudget, self.agreement.agree, PAGE)
        self.record = RunRecord(self.warn)
        self.identity: dict[str, Any] | None = None  # of the model the run's measurements belong to
        self._attached_identity: dict[str, Any] | None = None  # of the model attached now (None: detached)
        self.reset()

    @property
    def settings(self) -> Settings:
        """What the run may do; replacing them (the Trainer callback does, from the checkpointing kwargs) replaces
        them in the parts that decide by them."""
        return self._settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        self._settings = self.planner.settings = self.agreement.settings = settings

    def reset(self) -> None:
        """Start a new run: forget the steps, the dwell, the switches, the memory readings, the policy's samples,
        the measured bytes and the history not yet written. The settings, the probe, a policy object given at
        construction and the model it is attached to stay. The Trainer callback calls it at every ``train()``
        that does not resume from a checkpoint; a custom loop that trains again from scratch calls it itself."""
        for part in (self.planner, self.record, self.memory, self.sizes):
            part.reset()
        self.identity = self._attached_identity

    def adopt_identity(self, identity: dict[str, Any]) -> None:
        """A model of ``identity`` is being attached: measurements taken on a model of another one are dropped (a
        reset, then the run's counters restored)."""
        held = self.state_dict()
        kept = lifecycle.measurements_for(held, identity)
        if kept is not held:
            self.reset()
            self._restore(kept)
        self._attached_identity = self.identity = identity

    def note_side_work(self) -> None:
        """Evaluation or a checkpoint save ran since the last reading: the next reading is not a sample of
        training (the callback calls it from ``on_evaluate`` and ``on_save``), unless the probe's ``reset()`` at
        the next step's start keeps that work out of it, as it does under Trainer."""
        self.memory.note_side_work()

    # ---- the saved state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: enough for a resumed run to decide as the uninterrupted one would have: the
        run's counters, the level in place, the compile budget, the last reading (with the optimizer state it
        lacks and whether it is a clean sample), the measured layer bytes and what the policy and the keep planner
        learned, and the identity of the model they were measured on."""
        parts = (self.record, self.planner, self.memory, self.sizes)
        return {key: value for part in parts for key, value in part.state_dict().items()} | {"identity": self.identity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the run a checkpoint saved: everything of this controller's run is replaced by ``state``.

        Measurements taken on a model of another identity than the attached one (:mod:`autooffload.lifecycle`)
        are dropped, with one INFO line; before attach, ``attach`` checks them.
        """
        if self._attached_identity is not None:
            state = lifecycle.measurements_for(state, self.identity)
        self.reset()
        self._restore(state)
        # The checkpoint was written after its last step; in the uninterrupted run the next reading follows
        # that save, and here it follows the load: either way no clean sample, unless the probe's reset at the
        # step's start keeps the work out of it.
        self.memory.note_side_work()

    def _release(self) -> None:
        """The model is detached: nothing of it stays (its identity, its probe's hold on it, the host buffers of a
        manager the run made). A manager passed in keeps its buffers for its owner's next attach: its owner
        releases them (``host.release_all()``); they do not go with the controller, which the functions left
        installed on the model (``detach(restore=False)``) keep alive."""
        self._attached_identity = None
        self.record.costs.stop()
        self.fallback.let_go()
        self.memory.detach()
        self.sizes.detach()
        self.planner.detach()
        if self._owns_host:
            self.host.release_all()

    def _restore(self, state: dict[str, Any]) -> None:
        for part in (self.record, self.memory, self.sizes, self.planner):
            part.load_state_dict(state)
        if "identity" in state and self._attached_identity is None:
            self.identity = state["identity"]

    # ---- what it did -----------------------------------------------------------------------------------

    @property
    def history(self) -> list[StepRecord]:
        """One record per optimizer step not yet written (autooffload.history describes the fields)."""
        return self.record.history.pending

    def write_history(self, path: str | os.PathLike) -> int:
        """Append the records not yet written to ``path`` (JSON Lines) and forget them; returns how many.
        A file that cannot be written gives one warning; the records wait for the next call."""
        return self.record.write(path)

    @property
    def stats(self) -> OffloadStats:
        """Bytes moved to host memory: in the running step, and since the run began."""
        return self.record.stats

    @property
    def step(self) -> int:
        """Optimizer steps ended in this run (a resumed run counts on from its checkpoint)."""
        return self.record.step

    @property
    def level(self) -> int | None:
        """Layers offloading in the last micro-batch (None before the first is planned)."""
        return self.record.level

    @property
    def last_step_bytes(self) -> int:
        """Bytes moved to host memory in the last optimizer step."""
        return self.record.last_step_bytes

    @property
    def last_step_costs(self) -> dict[str, float]:
        """What the last optimizer step cost beside its compute (:mod:`autooffload.observe.costs`)."""
        return self.record.last_step_costs

    @property
    def memory_fraction(self) -> float | None:
        """The last step's memory reading, a fraction of the device (None: none)."""
        return self.memory.last.fraction

    @property
    def policy(self) -> Policy | None:
        """Who decides in mode ``auto``."""
        return self.planner.policy

    def metrics(self) -> dict[str, float]:
        """The ``autooffload/*`` values for a training log."""
        return self.record.metrics(self.host.held_bytes, self.memory.last.fraction)

    def summary(self) -> str:
        """One line: steps, switches, bytes moved, the peak memory, the worst rank, the compile budget."""
        planner = self.planner
        budget = (planner.budget.spent, self.settings.compile_max_switches, planner.latched)
        return self.record.summary(self.settings.mode, self.memory.peak_fraction, budget if planner.compiled else None)

    @guarded("finish", "", always=True)
    def finish(self) -> str:
        """End of training, called on every rank: under torch.distributed (with ``sync_ranks``) one collective
        gathers the worst rank's peak memory into the summary, since rank 0's own device says little about the
        others' (a rank that gave up makes it too). Ends the run: after giving up, the next run tries again.
        Returns the summary. A failure before the end's collective leaves it owed: the give-up at ``finish`` makes it,
        then ends the run."""
        self.record.worst_rank = self.agreement.worst(self.memory.peak_fraction)
        self.end_run()
        return self.summary()

    def end_run(self) -> None:
        """The run ended (or a Trainer's new one begins): a give-up is over, nothing is owed to other ranks."""
        self.fallback.end()
        self.failed = False
        self.faults.take()
