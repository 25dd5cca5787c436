"""autooffload: keep activation checkpointing's saved inputs on the device while they fit, and move them to
pinned host memory, per micro-batch, when a long sequence or a full device says they must go."""

from typing import TYPE_CHECKING, Any

from .apply.offload import OffloadStats
from .controller import OffloadController
from .decide.policy import HysteresisPolicy, Observation, Policy
from .decide.predictive import PredictivePolicy
from .observe.probe import MemoryProbe, MemoryReading, NvmlProbe, ProbeUnavailable, ScriptedProbe
from .observe.simulated import SimulatedDevice
from .rescue import Rescue
from .settings import Settings, SettingsError
from .warn import AutoOffloadWarning

if TYPE_CHECKING:  # imported on first use (below): the callback imports transformers
    from .callback import AutoOffloadCallback, attach

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


def __getattr__(name: str) -> Any:
    # The callback imports transformers; a custom loop or the policy alone should not pay for that.
    if name == "AutoOffloadCallback":
        from .callback import AutoOffloadCallback

        return AutoOffloadCallback
    if name == "attach":
        from .callback import attach

        return attach
    raise AttributeError(f"module 'autooffload' has no attribute {name!r}")
