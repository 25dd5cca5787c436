"""torch.compile: detect a compiled model and bound the recompilations that switching causes.

Measured with torch 2.13 (CPU, inductor): saved-tensor hooks inside a compiled checkpoint function are a
graph break, not an error, and the hooks still fire. A swapped checkpoint function is picked up through a
guard on its code object: the first switch to each variant recompiles, later switches hit the cache. More
variants than dynamo's ``recompile_limit`` (8) make the frame fall back to eager silently; the budget here
(``compile_max_switches`` switches that triggered a compilation) keeps the controller well inside that.
"""

from __future__ import annotations

import os

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


def compiled_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile(model)`` wrapper (an ``OptimizedModule``) compiled, else ``model``: the controller
    attaches there, as Trainer hands it over. On the wrapper, its forward hooks traced inside the compiled frame read
    the wrapper, which dynamo refuses (the module it compiled is already tracked: a crash at the first forward)."""
    optimized = _optimized_module_type()
    return model._orig_mod if optimized is not None and isinstance(model, optimized) else model  # type: ignore[return-value]


def _optimized_module_type() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return None
    return OptimizedModule


def compiled_graphs() -> int:
    """Graphs dynamo has handed to a backend in this process so far: what a recompilation costs. (Its count of
    frames also counts frames it only looked at and skipped, an eager-frame function at every call.)"""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


class CompileBudget:
    """Counts the switches that were followed by a compilation, against a limit.

    ``switched()`` marks a switch; ``settle()``, called once the micro-batch after it has run, looks at
    dynamo's graph counter and charges the switch if anything was compiled in between (``recompiles``: the
    graphs compiled after charged switches).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.spent = 0
        self.recompiles = 0
        self._graphs_at_switch: int | None = None

    @property
    def exhausted(self) -> bool:
        return self.spent >= self.limit

    def switched(self) -> None:
        if self._graphs_at_switch is None:
            self._graphs_at_switch = compiled_graphs()

    def settle(self) -> None:
        if self._graphs_at_switch is None:
            return
        compiled = compiled_graphs() - self._graphs_at_switch
        self._graphs_at_switch = None
        if compiled > 0:
            self.spent += 1
            self.recompiles += compiled


class CompiledFrames:
    """The frames of a compiled model that dynamo gave up on, given back to it.

    An offloading or measuring layer function runs its own frame eagerly (saved-tensor hooks): a graph break
    inside the loop over the layers. Dynamo cannot resume inside a loop, so it gives up on the whole frame that
    holds the loop (transformers' ``Qwen3Model.forward``) for good: from then on, every micro-batch of the model,
    also those that offload nothing, runs that frame eagerly and its layers as graphs of their own (measured:
    10% slower steps on a 4-layer Qwen3 at 256 tokens). :meth:`resume` lets dynamo compile those frames again;
    the switch calls it once enough plans in a row had no such functions (``RESUME_AFTER``), so that the whole
    graph, compiled once and cached, runs again. The next plan with them makes dynamo trace up to the break and
    give up once more (a trace, not a compilation, but not free). Private dynamo entry points (torch 2.13):
    where they are missing, nothing happens.

    Whether the frames are given up is dynamo's, per code object and for the process: it outlives a switch (a
    rebuild, a detach and a new attach for a second ``train()``) and is shared by the models of one class, so it
    is kept here per code (``GIVEN_UP``), not per switch.
    """

    GIVEN_UP: set = set()  # codes an eager-frame plan ran in since they were last given back (ids of live codes)

    def __init__(self, model: torch.nn.Module) -> None:
        codes: dict[int, object] = {}
        outer: dict[int, object] = {}  # the frames around a stack of layers (a ModuleList below them)
        torch_files = os.path.dirname(torch.__file__) + os.sep  # torch's own frames: dynamo's rules decide those
        for module in model.modules():
            stacked = any(isinstance(inner, torch.nn.ModuleList) for inner in module.modules())
            function = getattr(type(module), "forward", None)
            while function is not None:
                code = getattr(function, "__code__", None)
                if code is not None and not code.co_filename.startswith(torch_files):
                    codes[id(code)] = code
                    if stacked:
                        outer[id(code)] = code
                function = getattr(function, "__wrapped__", None)
        self.codes, self.outer = list(codes.values()), list(outer.values())
        self.resumed = 0
        self.recompiled = False  # the frames' compiled code was dropped once, at a resume

    @property
    def given_up(self) -> bool:
        """An eager-frame plan ran in some of these frames (this model's or another's of the same class) since they
        were last given back."""
        return any(id(code) in self.GIVEN_UP for code in self.codes)

    def give_up(self) -> None:
        """An eager-frame plan runs: dynamo gives up these frames."""
        self.GIVEN_UP.update(id(code) for code in self.codes)

    def resume(self, recompile: bool = False) -> None:
        """Give the frames back to dynamo. With ``recompile``, the first time, also drop what it compiled of them
        so far of the frames around the layers' stack: a frame that called into a given-up one was compiled with a
        graph break at that call, and its compiled code stays valid for every later plan (its guards end at the
        break), so the model would run as
        two graphs for good (the loss apart from the layers: 5% slower with every layer kept, on the peers
        benchmark's (a)). Dropped once, they compile whole for the plan in place (one compilation), and the
        compiled code of other models of the same classes compiles again once too (dynamo's cache is per code).
        Later plans with a break (an offload, a new length measured) give up and resume without it."""
        self.GIVEN_UP.difference_update(id(code) for code in self.codes)
        try:
            from torch._C._dynamo.eval_frame import reset_code, set_code_exec_strategy
            from torch._dynamo.types import FrameAction, FrameExecStrategy
        except ImportError:
            return
        default = FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT)
        for code in self.codes:
            set_code_exec_strategy(code, default)
        for code in self.outer if recompile and not self.recompiled else ():
            reset_code(code)
        self.recompiled = self.recompiled or recompile
        self.resumed += 1
