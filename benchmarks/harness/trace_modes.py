"""The modes of a mixed-length trace (``mixed.py``, and the GPU check's seed part on its own model): every way to hold
checkpointed inputs, each installed on one shared model before its step and taken off after, and one measured step:
its time, its peak, the plan, Python's collections and autooffload's own costs."""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch

from autooffload import OffloadController, Settings
from autooffload.apply.host_memory import HostMemory
from autooffload.observe.allocations import AllocationPeak
from autooffload.observe.costs import GcWatch
from harness.forms import Installed
from harness.models import StepProbe
from harness.rounds import StepClock

MODES = ("plain", "offload=True", "torchtune", "on/sync", "on/stream", "auto", "auto/stream", "auto/stream/keep")
AUTOOFFLOAD = {  # mode -> (mode, engine, recompute)
    "on/sync": ("on", "sync", "always"),
    "on/stream": ("on", "stream", "always"),
    "auto": ("auto", None, None),
    "auto/stream": ("auto", "stream", None),
    "auto/stream/keep": ("auto", "stream", "auto"),
}
HIGH = 0.9


class Mode(Installed):
    """One mode on the shared model (:class:`harness.forms.Installed`; the modes: benchmarks/README.md)."""

    def __init__(self, name: str, model: torch.nn.Module, device: str, probe: StepProbe, tune: Any) -> None:
        self.host: HostMemory | None = None
        controller = None
        if name in AUTOOFFLOAD:
            mode, engine, recompute = AUTOOFFLOAD[name]
            given = {k: v for k, v in (("engine", engine), ("recompute", recompute)) if v is not None}
            settings = Settings(mode=mode, memory_high=HIGH, memory_low=HIGH - 0.1, **given)
            self.host = HostMemory(copy_cpu=device == "cpu")
            controller = OffloadController(settings, probe=probe, host=self.host)
        super().__init__(model, device, offload=name == "offload=True", controller=controller)
        self.name, self.probe = name, probe
        self.offloading: Any = None
        if name == "torchtune":
            offload, no_op = tune
            self.offloading = offload()
            quiet = no_op()  # the output head is not offloaded, as torchtune's recipes arrange
            model.lm_head.register_forward_pre_hook(lambda *a: quiet.__enter__() if self.active else None)
            model.lm_head.register_forward_hook(lambda *a: quiet.__exit__() if self.active else None, always_call=True)
        self.active = False
        self.steps: list[dict[str, Any]] = []

    def activate(self) -> None:
        super().activate()
        if self.controller is not None:
            self.controller.begin_step()  # the step's boundary, outside its clock (Trainer's on_step_begin)
        self.active = True

    def deactivate(self) -> None:
        self.active = False
        super().deactivate()

    def forward(self) -> contextlib.AbstractContextManager:
        return self.offloading if self.offloading is not None else contextlib.nullcontext()

    def plan(self) -> tuple[int, int]:
        switch = self.controller.switch if self.controller is not None else None
        if switch is not None:
            return switch.offloaded, switch.kept
        return (len(self.model.model.layers), 0) if self.name in ("offload=True", "torchtune") else (0, 0)

    def close(self) -> None:
        if self.host is not None:
            self.host.release_all()


def causal_lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def run_step(
    mode: Mode, ids: torch.Tensor, cpu_peaks: bool, watch: GcWatch, loss_of: Any = causal_lm_loss
) -> dict[str, Any]:
    """One forward (``loss_of(model, ids)``) and backward under ``mode``: time (CUDA events; a CPU: the process's
    CPU time), the step's peak, the plan, Python's collections, and autooffload's own costs."""
    model, cuda = mode.model, ids.device.type == "cuda"
    mode.activate()
    window = AllocationPeak() if cpu_peaks and not cuda else None
    try:
        if window is not None:
            gc.collect()  # a block freed by the collector inside the window would lower its count
        collections, gc_seconds = watch.collections, watch.seconds  # the step's own, not the collection above
        with StepClock(cuda) as clock:
            if window is not None:
                window.start()
            with mode.forward():
                loss = loss_of(model, ids)
            plan = mode.plan()
            loss.backward()
        seconds, peak = clock.seconds, clock.peak
        if window is not None:
            peak = sum(p.numel() * p.element_size() for p in model.parameters()) + window.stop()
        del loss
        model.zero_grad(set_to_none=True)
        row = dict(seq=int(ids.shape[-1]), seconds=seconds, peak=peak, offloaded=plan[0], kept=plan[1])
        row.update(gc_collections=watch.collections - collections, gc_seconds=round(watch.seconds - gc_seconds, 4))
        if mode.controller is not None:
            mode.probe.last = peak
            mode.controller.end_step()
            row["costs"] = mode.controller.last_step_costs
    finally:
        mode.deactivate()
    return row
