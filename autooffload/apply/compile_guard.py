"""torch.compile: detect a compiled model and bound the recompilations that switching causes.

Measured with torch 2.13 (CPU, inductor): saved-tensor hooks inside a compiled checkpoint function are a
graph break, not an error, and the hooks still fire. A swapped checkpoint function is picked up through a
guard on its code object: the first switch to each variant recompiles, later switches hit the cache. More
variants than dynamo's ``recompile_limit`` (8) make the frame fall back to eager silently; the budget here
(``compile_max_switches`` switches that triggered a compilation) keeps the controller well inside that.
"""

from __future__ import annotations

import torch


def is_compiled(model: torch.nn.Module) -> bool:
    """True for an ``OptimizedModule``, a module compiled in place (``module.compile()``) or one holding either."""
    optimized = _optimized_module_type()
    for module in model.modules() if isinstance(model, torch.nn.Module) else ():
        if optimized is not None and isinstance(module, optimized):
            return True
        if getattr(module, "_compiled_call_impl", None) is not None:
            return True
    return False


def _optimized_module_type() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return None
    return OptimizedModule


def compiled_frames() -> int:
    """Frames dynamo has compiled in this process so far."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["frames"]["ok"])


class CompileBudget:
    """Counts the switches that were followed by a compilation, against a limit.

    ``switched()`` marks a switch; ``settle()``, called once the micro-batch after it has run, looks at
    dynamo's frame counter and charges the switch if anything was compiled in between.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.spent = 0
        self.recompiles = 0
        self._frames_at_switch: int | None = None

    @property
    def exhausted(self) -> bool:
        return self.spent >= self.limit

    def switched(self) -> None:
        if self._frames_at_switch is None:
            self._frames_at_switch = compiled_frames()

    def settle(self) -> None:
        if self._frames_at_switch is None:
            return
        compiled = compiled_frames() - self._frames_at_switch
        self._frames_at_switch = None
        if compiled > 0:
            self.spent += 1
            self.recompiles += compiled
