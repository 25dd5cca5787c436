"""Apply: install, per planned layer, the checkpoint function the plan asks for.

The layers are those :mod:`~autooffload.observe.targets` found: a module that checkpoints its own forward gets
its function in its attribute; a *container* (a model file that calls ``self._gradient_checkpointing_func(layer,
...)`` once per layer) gets a dispatcher (:class:`LayerCalls`) that runs call i with layer i's function,
counting from 0 again at every forward of the container (a pre-forward hook on it) and of the attached model. A
layer module that runs several times in one forward (HRM's cycles) runs its function at every call, and every
call under grad is counted (:class:`ForwardState`). Of a layer call's saved inputs only the layer's own move (its
first positional tensor, and a second activation of its own: :mod:`.layer_inputs`): masks, position ids, position
embeddings and what several layers share that reach the checkpoint as
positional arguments stay, and so does an input already moved in the same forward.

Each module gets functions built on ``torch.utils.checkpoint.checkpoint`` with its own checkpoint kwargs, less
the keys that are not torch's (``offload``, ``every_n_layers``): a plain one, one that runs under the
saved-tensor hooks of the offload engine (``sync``: :class:`~autooffload.apply.offload.HostOffloadHooks`;
``stream``: :mod:`~autooffload.apply.stream_engine`), and the keep rung's (:mod:`~autooffload.apply.keep`).
They are closures (:mod:`.functions`), not partials: torch.compile guards a called function by its code object.

Under torch.compile (``compiled``) the functions take the forms that cost least there (measured in
``docs/compile.md``): a recomputing layer's function counts nothing, so that dynamo traces it into the model's
graph without a break (the calls of an offloading layer are still counted: they are the ones the bytes moved
are held to); an offloading or measuring function runs its own frame eagerly (saved-tensor hooks, which dynamo
cannot trace, and counters), and the layer it calls is compiled as a frame of its own, once per variant.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..guard import StepFaults, in_step
from ..observe.ours import register
from ..observe.saved import parameter_storages
from ..observe.targets import CheckpointTarget, Foreign, planned_layers
from ..observe.wrapped import rewrap
from ..warn import WarnOnce
from .compile_guard import CompiledFrames
from .engines import OffloadEngine, make_engine
from .forward import ForwardState, LayerCalls
from .functions import dispatch_function, eager_frame, offload_function, plain_function
from .host_memory import HostMemory
from .keep import Marks, keep_function, measuring_keep_function, measuring_plain_function
from .layer_inputs import argument_names
from .offload import OffloadStats

# Plans in a row without eager-frame functions before dynamo gets the model's frames back (see _give_frames_back).
RESUME_AFTER = 8
RESTART = in_step("a container's restart")


def _checkpoints_inside(module: torch.nn.Module) -> bool:
    """Does a module inside ``module`` checkpoint (a block under a function autooffload leaves, a test's wrapper)?"""
    return any(getattr(m, "gradient_checkpointing", False) for m in module.modules() if m is not module)


def _slot_module(slot: Any) -> torch.nn.Module:
    """The module a planned layer runs: the target itself, or a container's block ``slot.index``."""
    target = slot.target
    if target.kind != "container":
        return target.module
    prefix = target.name + "." if target.name else ""
    try:
        return target.module.get_submodule(target.stack[len(prefix) :])[slot.index]
    except Exception:  # a container laid out otherwise: its own forward names nothing of a layer's
        return target.module


class CheckpointSwitch:
    """Holds, for every planned layer, the plain, the offloading and the keep function, and installs one of them.

    ``apply(k, keep, measure, order)`` makes the first ``k`` layers of ``order`` offload (the controller's order:
    those whose saved inputs free the most first), the last ``keep`` layers in module order run without
    checkpointing (:mod:`~autooffload.apply.keep`: a container's call runs ``layer.__call__`` directly, a
    ``CheckpointWrapper`` its wrapped module) and the others recompute. With ``measure``, every kept or
    recomputing layer counts what it keeps (or would keep without checkpointing) and hands its position, the
    bytes, the autocast dtype's bytes (0: off) and its call's micro-batch (``begin_micro_batch``) to
    ``on_measured``. Each planned layer's first call in a
    micro-batch hands its position and its input's bytes to ``on_first_call`` (0: a call that passes no tensor
    positionally, with one warning). The planned layers are the layer targets of the planned stacks, or, for a
    container target, its calls in one forward (:class:`LayerCalls`); other stacks (a VLM's vision blocks) and
    outer targets keep plain checkpointing. ``engine``: ``"sync"``, ``"stream"`` or an
    :class:`~autooffload.apply.engines.OffloadEngine`; ``host``: where a named engine takes its host buffers
    (default: a manager of its own); ``watched``: without targets (checkpointing turned off), the attributes
    that held functions before, which :meth:`unchanged` watches, as it watches ``foreign``, the checkpointed
    modules whose functions it cannot steer (a wrapper around one of its own: once it is gone, the layer is read
    again and steered); ``frames``: given where the model runs under torch.compile, whose functions then take the
    forms that cost least there (module docs), and its frames are given back to dynamo when plans without
    eager-frame functions follow one with them (:class:`~autooffload.apply.compile_guard.CompiledFrames`);
    ``faults``: where its functions' and engine's failures inside a step are noted
    (:class:`~autooffload.guard.StepFaults`).
    """

    def __init__(
        self,
        targets: list[CheckpointTarget],
        stats: OffloadStats,
        engine: str | OffloadEngine = "sync",
        warn: WarnOnce | None = None,
        host: HostMemory | None = None,
        watched: list[tuple[torch.nn.Module, str]] | None = None,
        on_first_call: Callable[[int, int, tuple[int, int] | None], None] | None = None,
        on_measured: Callable[[int, int, int, Any], None] | None = None,
        frames: CompiledFrames | None = None,
        foreign: Sequence[Foreign] = (),
        faults: StepFaults | None = None,
        on_mark: Callable[[tuple], None] | None = None,
    ) -> None:
        self.targets = targets
        self._foreign = [(f.module, f.attribute, f.function) for f in foreign]
        self.faults = faults = faults if faults is not None else StepFaults()
        self.compiled, self.frames = frames is not None, frames
        compiled = self.compiled
        self._whole = 0  # micro-batches planned in a row without eager-frame functions
        eager = eager_frame if compiled else (lambda function: function)
        self.stats = stats
        self.on_first_call, self.on_measured, self.on_mark = on_first_call, on_measured, on_mark
        held = {(id(m), a) for m, a, _ in self._foreign}
        dormant = [(m, a) for m, a in watched or [] if (id(m), a) not in held] if not targets else []
        self._dormant = [(m, a, getattr(m, a, None)) for m, a in dormant]
        self.warn = warn if warn is not None else WarnOnce()
        modules = [t.module for t in targets]
        self.engine = make_engine(engine, stats, modules, host, faults) if isinstance(engine, str) else engine
        self._plain = {id(t): self._tag(plain_function(t.kwargs), t) for t in targets}
        self._calls: dict[int, LayerCalls] = {}
        self._hooks: list[Any] = []
        self.layers = planned_layers(targets)
        self.forward = ForwardState(len(self.layers))
        self._plain_layer = [
            self._tag(plain_function(s.target.kwargs, None if compiled else self.forward.counter(i), faults), s.target)
            for i, s in enumerate(self.layers)
        ]
        self._offload = [
            self._tag(
                eager(
                    offload_function(s.target.kwargs, self.engine, s is self.layers[-1], self.forward, i, stats, faults)
                ),
                s.target,
            )
            for i, s in enumerate(self.layers)
        ]
        self.forward.on_first_call = self._first_call
        self.forward.inputs.names = [argument_names(_slot_module(slot)) for slot in self.layers]
        self.forward.inputs.named_only = [slot.target.kind == "container" for slot in self.layers]
        retired = [plain_function(s.target.kwargs) for s in self.layers]  # a retired keep function's checkpoint
        self._keep = [self._tag(keep_function(retired[i], self.forward), s.target) for i, s in enumerate(self.layers)]
        self._keep_measured = [
            self._tag(
                eager(
                    measuring_keep_function(
                        functools.partial(parameter_storages, [s.target.module]),
                        functools.partial(self._reporter, i),
                        retired[i],
                        self.forward,
                        faults,
                        functools.partial(self._marks, i),
                    )
                ),
                s.target,
            )
            for i, s in enumerate(self.layers)
        ]
        self._plain_measured = [
            self._tag(
                eager(
                    measuring_plain_function(
                        plain_function(s.target.kwargs, self.forward.counter(i), faults),
                        functools.partial(parameter_storages, [s.target.module]),
                        functools.partial(self._reporter, i),
                        faults,
                        functools.partial(self._marks, i),
                    )
                ),
                s.target,
            )
            for i, s in enumerate(self.layers)
        ]
        for target in targets:
            if target.kind == "container" and target.text:
                calls = LayerCalls(target, self._plain[id(target)])
                self._calls[id(target)] = calls
                self.forward.calls.append(calls)
                setattr(target.module, target.attribute, self._tag(dispatch_function(calls), target, wrap=False))
                self._hooks.append(target.module.register_forward_pre_hook(self._container_forward(calls)))
            else:
                self._install(target, self._plain[id(target)])
        self._functions: list[Callable[..., Any] | None] = [None] * len(self.layers)  # installed, per position
        self.offloaded = -1
        self.kept = 0
        self.measuring = False
        self.order: tuple[int, ...] = tuple(range(len(self.layers)))
        self.apply(0)

    @staticmethod
    def _tag(function: Callable[..., Any], target: CheckpointTarget, wrap: bool = True) -> Callable[..., Any]:
        """Register ``function`` as autooffload's for ``target`` (:mod:`~autooffload.observe.ours`); with ``wrap``,
        inside the target's own wrappers (a container's dispatcher is not wrapped: it must count every call; the
        functions it dispatches to are)."""
        if wrap and target.wrappers:
            function = rewrap(target.wrappers, function)
        return register(function, target.original, target.kwargs)

    def apply(self, k: int, keep: int = 0, measure: bool = False, order: tuple[int, ...] | None = None) -> None:
        """Offload the first ``k`` layers of ``order`` (positions in :attr:`layers`; default: module order, the
        earliest first), keep the last ``keep`` layers in module order, recompute the others."""
        k = max(0, min(k, len(self.layers)))
        keep = max(0, min(keep, len(self.layers) - k))
        measure = measure and k < len(self.layers)
        order = tuple(range(len(self.layers))) if order is None else tuple(order)
        self._give_frames_back(eager=self.compiled and (k > 0 or measure))
        if (k, keep, measure, order) == (self.offloaded, self.kept, self.measuring, self.order):
            return
        first_kept = len(self.layers) - keep
        offloading = set(order[:k])
        for position, slot in enumerate(self.layers):
            if position >= first_kept:
                function = (self._keep_measured if measure else self._keep)[position]
            else:
                plain = self._plain_measured[position] if measure else self._plain_layer[position]
                function = self._offload[position] if position in offloading else plain
            if self._functions[position] is function:
                continue
            self._functions[position] = function
            calls = self._calls.get(id(slot.target))
            if calls is not None:
                calls.functions[slot.index] = function
            else:
                self._install(slot.target, function)
        self.offloaded, self.kept, self.measuring, self.order = k, keep, measure, order
        self._installed = [(t.module, t.attribute, getattr(t.module, t.attribute)) for t in self.targets]

    def _give_frames_back(self, eager: bool) -> None:
        """Under torch.compile, one call per micro-batch's plan: after ``RESUME_AFTER`` plans in a row without
        eager-frame functions, give dynamo back the frames an earlier one made it give up on
        (:class:`~autooffload.apply.compile_guard.CompiledFrames`): the whole graph runs again. Not sooner: the
        next eager-frame plan after that costs a trace up to its graph break (measured: 0.7-0.9 s on a 2-layer
        Qwen3 on a CPU), which plans that come and go (one long micro-batch in five) would pay every time."""
        if eager:
            self._whole = 0
            if self.frames is not None:
                self.frames.give_up()
            return
        self._whole += 1
        if self._whole >= RESUME_AFTER and self.frames is not None and self.frames.given_up:
            self.frames.resume(recompile=True)

    def _first_call(self, position: int, nbytes: int, shape: tuple[int, int] | None = None) -> None:
        """Layer ``position``'s first call in a micro-batch saves an input of ``nbytes``; 0 where the call passes no
        tensor positionally (its hidden states go as a keyword argument), which nothing can move."""
        if nbytes == 0:
            target = self.layers[position].target
            self.warn(
                "keyword-input",
                f"{target.name or type(target.module).__name__} passes no tensor positionally to its checkpoint "
                "(its hidden states go as a keyword argument, which torch's checkpoint does not save): none of its "
                "input can move to host memory, so autooffload counts it as freeing nothing",
            )
        if self.on_first_call is not None:
            self.on_first_call(position, nbytes, shape)

    @property
    def offloading(self) -> frozenset[int]:
        """The positions of the layers that offload now."""
        return frozenset(self.order[: max(self.offloaded, 0)])

    @property
    def calls_per_forward(self) -> list[int]:
        """Per layer, its calls in the last forward that ran it (the counts of the micro-batch before must be taken
        first)."""
        return self.forward.calls_per_forward

    def begin_micro_batch(self, batch: Any = None) -> None:
        """A micro-batch's forward is next (``batch``: how the controller names it, handed back with each of its
        measurements): the engine starts a new chain of layer calls."""
        self.forward.batch = batch
        self.engine.begin_forward()

    def _reporter(self, position: int) -> Callable[[int, int], None]:
        """At a measuring layer call: where its count goes, with the micro-batch the call belongs to."""
        batch = self.forward.batch

        def report(nbytes: int, cast_bytes: int) -> None:
            if self.on_measured is not None:
                self.on_measured(position, nbytes, cast_bytes, batch)

        return report

    def _marks(self, position: int) -> Marks:
        """At a measuring layer call: the marks it makes (``on_mark``), naming the micro-batch the call belongs to."""
        return Marks(self.on_mark, self.forward.batch, position, self.faults)

    def new_forward(self) -> None:
        """A forward of the attached model begins: container calls count from layer 0 again. Warns once if a
        container called its function more often in one forward than its stack has layers."""
        for calls in self._calls.values():
            self._restart(calls)
        self.forward.new_forward()

    def end_forward(self, raised: bool = False) -> None:
        """A forward of the attached model ended: what its layer calls deferred moves if it was theirs alone. One
        that ``raised`` moves nothing and teaches nothing: its calls stopped part way (an out-of-memory error the
        rescue reruns), so a tensor the layers after would have received looks like one layer's own."""
        own = self.forward.abandon() if raised else self.forward.settle()
        self.engine.settle(own)
        for calls in self._calls.values():
            target = calls.target  # CLVP's conditioning encoder calls torch's checkpoint itself, its encoders none
            if calls.ran and calls.count == 0 and not raised and not _checkpoints_inside(target.module):
                name = target.name or type(target.module).__name__
                self.warn(f"container-silent:{target.name}", f"{name} ran in training without calling its checkpoint "
                          f"function: its {len(calls.functions)} layer(s) run without it (checkpointed by torch's "
                          "checkpoint called directly, or not at all); nothing of them is offloaded")  # fmt: skip
            calls.ran = False

    def _container_forward(self, calls: LayerCalls) -> Callable[..., None]:
        """A pre-forward hook on the container itself: its calls count from layer 0 at each of its forwards,
        also when something calls it without the attached model (TRL's Liger-loss paths call ``model.model``)."""

        def restart(module: torch.nn.Module, args: Any) -> None:
            self._restart(calls)
            calls.ran = calls.ran or (module.training and torch.is_grad_enabled())

        return self.faults.shield(RESTART, restart, lambda module, args: setattr(calls, "count", 0))

    def _restart(self, calls: LayerCalls) -> None:
        if calls.count > len(calls.functions):
            target = calls.target
            self.warn(
                f"container-calls:{target.name}",
                f"{target.name or type(target.module).__name__} called its checkpoint function {calls.count} "
                f"times in one forward, but {target.stack} has {len(calls.functions)} layers; the calls beyond "
                "those run plain checkpointing",
            )
        calls.count = 0

    def close(self) -> None:
        """The switch is being replaced or detached: remove the hooks it put on container modules, and retire its
        functions. One of them may live on inside a wrapper that is not autooffload's (a test's ``MagicMock``, a
        plain function): called there, it runs plain checkpointing with its layer's kwargs, and counts, reports and
        moves nothing."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.forward.retired = True
        self.on_first_call = self.on_measured = None

    def _install(self, target: CheckpointTarget, function: Callable[..., Any]) -> None:
        setattr(target.module, target.attribute, function)

    def unchanged(self) -> bool:
        """True while nobody replaced the checkpoint functions since this switch was built: its own are in place,
        or, where there were none to control, the watched attributes still hold what they held, checkpointing off;
        and the functions it could not steer are the ones it found."""
        if any(getattr(m, a, None) is not f for m, a, f in self._foreign):
            return False
        if self.targets:
            return self.intact()
        return all(
            getattr(m, a, None) is f and not getattr(m, "gradient_checkpointing", False) for m, a, f in self._dormant
        )

    def rebuilt(self, targets: list[CheckpointTarget], foreign: Sequence[Foreign] = ()) -> CheckpointSwitch:
        """A switch for ``targets`` and ``foreign``, what the model holds now, in place of this one: the same engine
        and byte counts; without targets, it watches the attributes this one controlled."""
        on_first_call, on_measured = self.on_first_call, self.on_measured
        self.close()
        watched = [(t.module, t.attribute) for t in self.targets] or [(m, a) for m, a, _ in self._dormant]
        switch = CheckpointSwitch(
            targets, self.stats, self.engine, self.warn, None, watched, on_first_call, on_measured, self.frames,
            foreign, self.faults, self.on_mark,
        )  # fmt: skip
        switch.forward.open = self.forward.open  # rebuilt as a forward begins: its end settles what it defers
        return switch

    def checkpointing_off(self) -> bool:
        """Every target has checkpointing turned off (a reference forward between a trainer's disable and enable)."""
        off = [getattr(t.module, "gradient_checkpointing", True) is False for t in self.targets]
        return bool(off) and all(off)

    def intact(self) -> bool:
        """True while every target still runs the function this switch installed last, with checkpointing on.

        Identity checks only, no allocation: it runs before every training forward, to notice a trainer that
        disabled and re-enabled checkpointing (TRL's reference forward), which installs new functions.
        """
        for module, attribute, function in self._installed:
            if getattr(module, attribute, None) is not function:
                return False
            if getattr(module, "gradient_checkpointing", True) is False:
                return False
        return True

    def restore(self) -> None:
        """Put back the functions found at construction."""
        for target in self.targets:
            setattr(target.module, target.attribute, target.original)
        self.offloaded, self.kept, self.measuring = -1, 0, False
        self._functions = [None] * len(self.layers)
