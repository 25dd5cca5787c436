"""Typed code that uses the public API as a user's would; not a test pytest runs, but a file mypy checks
(``[tool.mypy]`` in pyproject.toml, run by tests/test_package.py): the hints of what autooffload/__init__.py
exports must let a user's type checker accept this, and catch the misuse marked ``type: ignore`` below."""

from __future__ import annotations

import torch
from transformers import Trainer

import autooffload
from autooffload import (
    AutoOffloadCallback,
    AutoOffloadWarning,
    HysteresisPolicy,
    MemoryReading,
    Observation,
    OffloadController,
    OffloadStats,
    Policy,
    PredictivePolicy,
    Rescue,
    ScriptedProbe,
    Settings,
    SettingsError,
    SimulatedDevice,
    attach,
)


def settings() -> Settings:
    overrides: dict[str, float | int | str] = {"memory_high": 0.85, "seq_high": 8192}
    chosen = Settings.from_env(**overrides)
    assert isinstance(chosen.memory_high, float) and isinstance(chosen.mode, str)
    try:
        Settings.from_env({}, mode="sometimes")
    except SettingsError as error:
        print(f"{error}")
    return chosen


class Twice:
    """A user's policy: any object with ``decide(Observation) -> int``."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner

    def decide(self, observation: Observation) -> int:
        return min(2 * self.inner.decide(observation), observation.layers)


def custom_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    controller = OffloadController(settings(), probe=SimulatedDevice(8 << 20), policy=Twice(HysteresisPolicy()))
    attached: bool = controller.attach(model, optimizer=optimizer)
    level: int | None = controller.level
    controller.before_forward(128, 256)
    controller.end_step()
    stats: OffloadStats = controller.stats
    moved: int = controller.last_step_bytes + stats.total_bytes
    fraction: float | None = controller.memory_fraction
    metrics: dict[str, float] = controller.metrics()
    written: int = controller.write_history("/tmp/history.jsonl")
    state = controller.state_dict()
    controller.load_state_dict(state)
    rescued: int = Rescue(controller, model).run(lambda: 1)
    print(attached, level, moved, fraction, metrics, written, rescued, autooffload.__version__)
    controller.step = 3  # type: ignore[misc]  # read-only: the run counts its own steps
    return controller.finish()


def trainer(trainer: Trainer) -> None:
    callback: AutoOffloadCallback = attach(trainer, mode="auto")
    other = AutoOffloadCallback(memory_high=0.9, probe=ScriptedProbe([0.5, 0.95]), policy="hysteresis")
    predictive = PredictivePolicy()
    reading = MemoryReading(used_bytes=1 << 20, total_bytes=8 << 20)
    print(callback.controller.summary(), other.explicit, predictive, reading.fraction, AutoOffloadWarning.__name__)
    AutoOffloadCallback(memory_high="high")  # type: ignore[arg-type]
