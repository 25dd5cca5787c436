"""What dynamo did in a run of many compiled modes in one process: graphs and frames compiled, graph breaks, a backend
of each mode's own (its graphs kept apart from the other modes'), and frames given up on as dynamo gives them up."""

from __future__ import annotations

from typing import Any

import torch

from autooffload.apply.compile_guard import CompiledFrames


def budget_backend(backend: str, budget: float | None) -> Any:
    """A dynamo backend of its own (its graphs are kept apart from the other modes'), compiling under
    ``activation_memory_budget=budget`` (None: the default)."""
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx as compile_graph
    else:
        from torch._dynamo.backends.registry import lookup_backend

        compile_graph = lookup_backend(backend)

    def compile_mode(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        patch = {} if budget is None else {"activation_memory_budget": budget}
        with torch._functorch.config.patch(**patch):
            return compile_graph(gm, example_inputs)

    return compile_mode


def give_up(frames: CompiledFrames) -> None:
    """Dynamo gives up on these frames, as it does itself after a graph break in a loop."""
    from torch._C._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    for code in frames.codes:
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.DEFAULT))


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def frames_compiled() -> int:
    """Frames dynamo traced so far (a compilation, with or without a graph: with the layers compiled in place, the
    first step of an offloading form traces frames and compiles no graph, and its count held the tracing's own
    allocations, 1.0125 of (c)'s budget against 0.9875 counted again: that mode's controller offloaded a second
    layer for it)."""
    from torch._dynamo.utils import compilation_time_metrics

    return len(compilation_time_metrics.get("_compile.compile_inner", ()))


def graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))
