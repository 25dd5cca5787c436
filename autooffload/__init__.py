"""autooffload: keep activation checkpointing's saved inputs on the device while they fit, and move them to
pinned host memory, per micro-batch, when a long sequence or a full device says they must go."""

import importlib
from typing import TYPE_CHECKING, Any

from .settings import Settings, SettingsError
from .warn import AutoOffloadWarning

if TYPE_CHECKING:  # imported on first use (below)
    from .apply.offload import OffloadStats
    from .callback import AutoOffloadCallback, attach
    from .controller import OffloadController
    from .decide.policy import HysteresisPolicy, Observation, Policy
    from .decide.predictive import PredictivePolicy
    from .observe.probe import MemoryProbe, MemoryReading, NvmlProbe, ProbeUnavailable, ScriptedProbe
    from .observe.simulated import SimulatedDevice
    from .rescue import Rescue

__version__ = "0.2.0.dev0"  # the one place: pyproject.toml reads it; CHANGELOG.md says what changed

__all__ = [
    "AutoOffloadCallback",
    "AutoOffloadWarning",
    "HysteresisPolicy",
    "MemoryProbe",
    "MemoryReading",
    "NvmlProbe",
    "Observation",
    "OffloadController",
    "OffloadStats",
    "Policy",
    "PredictivePolicy",
    "ProbeUnavailable",
    "Rescue",
    "ScriptedProbe",
    "Settings",
    "SettingsError",
    "SimulatedDevice",
    "attach",
]

# Where each name that imports torch (or transformers: the callback) lives. Imported on first use, so that
# `autooffload --version`, `--help` and `estimate` (pure arithmetic) and a script that needs only the settings
# answer without loading torch: seconds, where the command itself takes milliseconds.
_LAZY = {
    "OffloadStats": ".apply.offload",
    "AutoOffloadCallback": ".callback",
    "attach": ".callback",
    "OffloadController": ".controller",
    "HysteresisPolicy": ".decide.policy",
    "Observation": ".decide.policy",
    "Policy": ".decide.policy",
    "PredictivePolicy": ".decide.predictive",
    "MemoryProbe": ".observe.probe",
    "MemoryReading": ".observe.probe",
    "NvmlProbe": ".observe.probe",
    "ProbeUnavailable": ".observe.probe",
    "ScriptedProbe": ".observe.probe",
    "SimulatedDevice": ".observe.simulated",
    "Rescue": ".rescue",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'autooffload' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
