"""Observe: the device's memory at a step's fullest, read once per optimizer step.

A :class:`MemoryMonitor` owns the probe (NVML on the model's device, one the caller gives, or none), starts each
step's peak, reads it at the step's end and says what the reading is worth: whether it is a sample of training
alone (``clean``: no evaluation or checkpoint save ran inside it), what it lacks (``pending_bytes``: optimizer
state the next steps hold all along that this one did not), and, after a rescued step, at least what the failed
allocation needed. A probe that fails is dropped with one warning: training goes on without a memory signal.

The optimizer state: torch's Adam creates its two moments at its first ``step()``, inside the first step's
window, so that step's peak is the larger of the backward's (without the state) and the optimizer step's (with
it). Later steps hold the state through their backward too. Where the probe can be read without ending its
peak (``peek()``), the monitor reads it just before the optimizer's first ``step()`` and counts as still to
come only what the backward's peak plus the state exceeds the reading by: on one H200 the whole state (0.875
GiB) was counted though the reading held it (a 2048-token step read 3.600 GiB before and after the state
existed), and the memory model over-predicted by 24%. Without ``peek()``, or where ``step()`` is handed a closure
that runs the backward inside it (Lightning's), the whole state counts, the safe side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ..guard import StepFaults, in_step, nothing, training_error
from ..settings import SettingsError
from .model import optimizer_state_bytes, unwrap_optimizer
from .probe import MemoryProbe, NvmlProbe, ProbeUnavailable

BEFORE_OPTIMIZER = in_step("the optimizer's pre-step hook")


@dataclasses.dataclass(frozen=True)
class Reading:
    """The last step's reading as the decision takes it (``None``: no reading). ``bytes`` is raised after a rescued
    step (``rescued``) to what it needed at least; ``fraction`` stays what the probe read."""

    fraction: float | None = None
    bytes: int | None = None
    total: int | None = None
    rescued: bool = False
    clean: bool = True
    pending_bytes: int = 0


class MemoryMonitor:
    """The probe and the readings of one run. ``choice``: a probe, ``"auto"`` (NVML on the model's CUDA device) or
    ``None``; ``warn``: the controller's :class:`~autooffload.warn.WarnOnce`."""

    def __init__(
        self, choice: MemoryProbe | str | None, warn: Callable[[str, str], Any], faults: StepFaults | None = None
    ) -> None:
        if not (choice is None or choice == "auto" or callable(getattr(choice, "read", None))):
            raise SettingsError(
                f"argument probe={choice!r} is not allowed: expected 'auto' (NVML on the model's CUDA device), None "
                "(no memory reading) or a probe object with read() (autooffload.ScriptedProbe, SimulatedDevice, ...)"
            )
        self.choice = choice
        self.warn = warn
        self.faults = faults or StepFaults()  # where the optimizer hook's failures are noted
        self.probe: MemoryProbe | None = None
        self.optimizer: Any = None
        self.read_seconds = 0.0  # time spent reading the probe (reset, peek, read): a running total, as costs read it
        self.reset()

    def reset(self) -> None:
        """A new run: no reading yet."""
        self.last = Reading()
        self.begun = False  # the running step's peak started (begin_step)
        self.rescuing = False  # the running step ran out of device memory and is rerun
        self.peak_fraction: float | None = None
        self.side_work = False  # evaluation or saving ran since the last reading
        self.state_at_start = 0  # optimizer state bytes when the step began
        self.before_optimizer: int | None = None  # the step's peak so far, read before the optimizer's first step
        self._optimizer_hook: Any = None
        self.tried_bytes: int | None = None  # the allocation the running step failed on
        self.segments: list[tuple[Any, float]] | None = None  # the last step's, where it was marked (mark)
        self.marking = True  # the probe's marks work (one that raised is not asked again)

    def attach(self, model: torch.nn.Module, devices: tuple[torch.device, ...], optimizer: Any, settings: Any) -> None:
        """Make the probe for ``model`` on ``devices`` and hand it the model where it counts the model itself."""
        self.optimizer = optimizer if optimizer is not None else self.optimizer
        self.probe = self._make_probe(list(devices), settings)
        watch = getattr(self.probe, "watch_model", None)
        if not callable(watch):
            return
        try:
            watch(model, lambda: self.optimizer)
        except Exception as error:
            self.warn("probe-watch", f"memory probe watch_model failed ({error!r}); no memory reading from it")
            self._drop()

    def detach(self) -> None:
        self._unwatch_optimizer()
        unwatch = getattr(self.probe, "unwatch_model", None)
        if callable(unwatch):
            unwatch()
        self.optimizer = None

    def _drop(self) -> None:
        """Stop using the probe: what it watches on the model (a simulated device's hooks) goes with it."""
        probe, self.probe = self.probe, None
        unwatch = getattr(probe, "unwatch_model", None)
        if callable(unwatch):
            with contextlib.suppress(Exception):  # a probe already failing; its hooks are all it could leave
                unwatch()

    def _make_probe(self, devices: list[torch.device], settings: Any) -> MemoryProbe | None:
        if self.choice != "auto":
            return self.choice  # type: ignore[return-value]
        try:
            return NvmlProbe(devices if len(devices) > 1 else devices[0])
        except ProbeUnavailable as error:
            if settings.mode == "auto":
                self.warn(
                    "no-probe",
                    f"no device memory reading ({error}); offload follows the sequence-length trigger alone "
                    f"(AUTOOFFLOAD_SEQ_HIGH={settings.seq_high})",
                )
            return None

    def begin_step(self) -> None:
        """A step's peak starts here (the probe's ``reset()``, where it has one)."""
        self.begun = True
        self.state_at_start = optimizer_state_bytes(self.optimizer)[0] if self.optimizer is not None else 0
        self._watch_optimizer()
        reset = getattr(self.probe, "reset", None)
        if reset is None:
            return
        began = time.perf_counter()
        try:
            reset()
        except Exception as error:  # a probe's failure must not end the run; the reading still works
            if training_error(error):
                raise  # the device itself failed (a kernel's error surfacing here): the step's error, not the probe's
            self.warn("probe-reset", f"memory probe reset failed ({error!r}); a step's peak may include earlier work")
            return
        finally:
            self.read_seconds += time.perf_counter() - began
        self.side_work = False  # evaluation or saving before the reset is not in this step's reading

    def _watch_optimizer(self) -> None:
        """While the optimizer has no state yet, read the step's peak so far before its first ``step()`` (module
        docs): a hook on the torch optimizer, removed when the step ends."""
        self._unwatch_optimizer()
        self.before_optimizer = None
        inner = unwrap_optimizer(self.optimizer)
        peek = getattr(self.probe, "peek", None)
        # torch's step hooks run only where torch's Optimizer.__init__ ran: not in accelerate's wrapper of DeepSpeed's
        # optimizer (a torch Optimizer subclass around one that is none), where registering one raises.
        hooks = getattr(inner, "_optimizer_step_pre_hooks", None)
        if self.state_at_start or not callable(peek) or not isinstance(inner, torch.optim.Optimizer) or hooks is None:
            return

        def before_step(_: Any, args: tuple, kwargs: dict[str, Any]) -> None:
            # A closure (Lightning's) runs the step's forward and backward inside step(), after this: not read.
            closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0]: the optimizer
            if closure is None and self.before_optimizer is None and self.begun:
                self.before_optimizer = self._peek()

        self._optimizer_hook = inner.register_step_pre_hook(self.faults.shield(BEFORE_OPTIMIZER, before_step, nothing))

    def _unwatch_optimizer(self) -> None:
        hook, self._optimizer_hook = self._optimizer_hook, None
        if hook is not None:
            hook.remove()

    def _peek(self) -> int | None:
        """The running step's peak so far, in bytes; None where the probe cannot say (a failure here is no reason
        to drop the probe: the step's own reading will say)."""
        began = time.perf_counter()
        try:
            reading = self.probe.peek()  # type: ignore[union-attr]
            return None if reading is None else _checked(reading)[0]
        except Exception as error:
            if training_error(error):
                raise
            return None
        finally:
            self.read_seconds += time.perf_counter() - began

    def rescue(self, tried_bytes: int | None) -> None:
        """The running step ran out of device memory (``tried_bytes``: the allocation that failed, where known) and
        is rerun: its reading will be a lower bound of what it needed."""
        self.rescuing = True
        self.tried_bytes = max(self.tried_bytes or 0, tried_bytes or 0)

    def note_side_work(self) -> None:
        """Evaluation or a checkpoint save ran since the last reading: the next one is no sample of training alone,
        unless the probe's ``reset()`` at the next step's start keeps that work out of it."""
        self.side_work = True

    def mark(self, label: Any) -> None:
        """Start a segment of the running step's reading here, where the probe reads segments (``mark(label)`` and
        ``segments()``): the keep model's marks (:class:`~autooffload.apply.keep.Marks`). Called from a hook inside
        the backward, so nothing may raise: a probe whose mark fails is not asked again, with one warning."""
        mark = getattr(self.probe, "mark", None) if self.marking else None
        if mark is None:
            return
        try:
            mark(label)
        except Exception as error:
            self.marking = False
            self.warn("probe-mark", f"memory probe mark failed ({error!r}); kept layers are planned at what they save")

    def end_step(self) -> float | None:
        """Read the step's peak; returns the reading in bytes as the probe gave it (None: none), before a rescued
        step's is raised to what it needed (:attr:`last` holds that)."""
        rescued, self.begun, self.rescuing = self.rescuing, False, False
        self._unwatch_optimizer()
        fraction, used, total = self._read()
        self.segments = self._segments() if fraction is not None else None
        measured = used if fraction is not None else None
        pending = self._pending_optimizer_bytes(measured)
        if fraction is not None:
            self.peak_fraction = max(self.peak_fraction or 0.0, fraction)
        if rescued and used is not None and total:
            used = max(used + (self.tried_bytes or 0), total)  # the reading misses the allocation that failed
        self.tried_bytes = None
        self.last = Reading(fraction, used, total, rescued, not self.side_work, pending)
        self.side_work = False
        return measured

    def _read(self) -> tuple[float | None, int | None, int | None]:
        if self.probe is None:
            return None, None, self.last.total
        began = time.perf_counter()
        try:
            reading = self.probe.read()
            if reading is None:
                return None, None, self.last.total
            used, total = _checked(reading)
        except Exception as error:  # NVML can fail mid-run (driver reset, XID), a probe can read garbage
            if training_error(error):
                raise  # the device itself failed (a kernel's error surfacing here): the step's error, not the probe's
            self._drop()
            self.warn(
                "probe-failed",
                f"memory reading failed ({error!r}); the sequence-length trigger alone decides from now on",
            )
            return None, None, self.last.total
        finally:
            self.read_seconds += time.perf_counter() - began
        return used / total, used, total

    def _segments(self) -> list[tuple[Any, float]] | None:
        """The step's segments: None where the probe reads none (no ``segments()``, or its marks failed), [] where it
        has none for this step (nothing marked)."""
        segments = getattr(self.probe, "segments", None) if self.marking else None
        if not callable(segments) or not callable(getattr(self.probe, "mark", None)):
            return None
        try:
            return [(label, float(peak)) for label, peak in segments() or ()]
        except Exception as error:
            self.marking = False
            self.warn("probe-mark", f"memory probe segments failed ({error!r}); kept layers planned at what they save")
            return None

    def _pending_optimizer_bytes(self, used: int | None) -> int:
        """Optimizer state the next steps hold through their backward that the step just read (``used`` bytes)
        did not: the state, where it did not exist when the step began, less what the reading already holds.

        Only while the state is still empty at a step's start (torch's optimizers create it whole at their
        first ``step()``): once any exists, what the count says of it (ZeRO's partitions, a state restored
        on resume) is noise, not state still to come, and a resumed run must decide as the uninterrupted one.
        Where the optimizer stepped inside the step and the probe was read just before (module docs), what the
        backward's peak plus the state exceeds the reading by; otherwise the whole state.
        """
        if self.optimizer is None or self.state_at_start > 0:
            return 0
        held, expected = optimizer_state_bytes(self.optimizer)
        if held and self.before_optimizer is not None and used is not None:
            return max(0, self.before_optimizer + held - used)
        return max(0, expected) if expected is not None else 0

    def state_dict(self) -> dict[str, Any]:
        last = self.last
        return {
            "memory": {"fraction": last.fraction, "bytes": last.bytes, "total": last.total},
            "peak_memory_fraction": self.peak_fraction,
            "last_step_rescued": last.rescued,
            "last_step_clean": last.clean,
            "pending_bytes": last.pending_bytes,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        memory = state.get("memory") or {}
        self.last = Reading(
            memory.get("fraction"),
            memory.get("bytes"),
            memory.get("total"),
            bool(state.get("last_step_rescued", False)),
            bool(state.get("last_step_clean", True)),
            int(state.get("pending_bytes") or 0),  # a checkpoint after step 0: Adam's state to come
        )
        self.peak_fraction = state.get("peak_memory_fraction")


def _checked(reading: Any) -> tuple[int, int]:
    """A reading's (used, total) bytes as plain ints (a user's probe may hand numpy's; the state goes into Trainer's
    trainer_state.json); ValueError for what is no reading: not finite, a total that is not positive, a use below 0
    or above the total."""
    used, total = float(reading.used_bytes), float(reading.total_bytes)
    if not (math.isfinite(used) and math.isfinite(total) and total > 0 and 0 <= used <= total):
        raise ValueError(f"the probe read {reading.used_bytes!r} of {reading.total_bytes!r} bytes, which is no reading")
    return int(used), int(total)
