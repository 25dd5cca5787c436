"""Apply: the hooks through which a model's forwards and backwards reach the controller.

A micro-batch is decided before its forward, at the first module it enters that autooffload watches: the attached
model, or a planned stack's entry called without it (TRL's Liger-loss path calls ``model.model``; an
encoder-decoder's base model). The entries inside one call (its encoder and decoder) then find it decided: a
post-forward hook on the module that decided, which runs even when its forward raises, opens the way for the next
call. A call that carries no tokens while a watched entry lies inside it (TRL's ``DistillationTrainer`` calls the
top model through a redirection, its loss function as the forward, and the backbone inside it with the tokens)
is passed by: ``enter`` returns False, and the entry inside decides where the tokens are. With
``recompute="auto"``, a hook on the last trainable parameter counts the backwards, so that the keep planner knows
how many forwards were alive together.

The call that decides is where the ranks make their agreement (:mod:`autooffload.distributed`): ``deciding(True)``
before ``enter`` for a call in train mode under grad, ``deciding(False)`` once it returned, so the agreement is due
exactly while a training micro-batch is being decided. A controller that gives up hands the hooks over
(:meth:`ForwardHooks.hand_over`) to what then stands at that point (:class:`autooffload.fallback.RankNotice`): the
same modules, the same call that decides, so a rank that gave up makes the collective it owes where the other ranks
make theirs, never inside a forward already running. Given up inside ``enter``, the call being decided is offered to
the new ``enter`` at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..guard import StepFaults, in_step, training_error
from ..observe.stacks import Stack
from .keep import count_backwards

ENTRY = in_step("a watched call's entry")
END = in_step("a watched call's end")

Enter = Callable[[torch.nn.Module, Sequence[Stack] | None, tuple, dict, bool], "bool | None"]


class ForwardHooks:
    """Calls ``enter(module, stacks, args, kwargs, deferrable)`` once per call of ``model`` or of a module of
    ``entries`` (each with the stacks it runs) that is not inside another watched call that decided; ``stacks`` is
    None for the model itself (the controller's planned stacks, whatever they are when it is called);
    ``deferrable``: a watched entry lies inside ``module``, so a call without tokens may leave the decision to it
    (``enter`` returns False). ``on_backward``: called once per backward that reaches the model's last trainable
    parameter; ``deciding(True)`` and ``deciding(False)``: around ``enter`` for a call in train mode under grad (a
    training micro-batch: a call passed by and the entry inside it each), and must not raise;
    ``leave(raised)``: called when the call that ``enter`` took ends (its forward ran, or raised); ``faults``: where
    the backward counter's failures are noted (:class:`~autooffload.guard.StepFaults`).
    :meth:`follow` watches the entries of a layout read again (a trainer that reinstalled checkpointing may plan
    other stacks)."""

    def __init__(
        self,
        model: torch.nn.Module,
        entries: Sequence[tuple[torch.nn.Module, Sequence[Stack]]],
        enter: Enter,
        on_backward: Callable[[], None] | None = None,
        deciding: Callable[[bool], None] | None = None,
        leave: Callable[[bool], None] | None = None,
        faults: StepFaults | None = None,
    ) -> None:
        self.active: torch.nn.Module | None = None  # the module whose call decided the running micro-batch
        self.model = model
        self._enter = enter
        self._deciding = deciding
        self._leave = leave
        self._faults = faults or StepFaults()
        self.stacks: dict[torch.nn.Module, Sequence[Stack]] = {}  # each entry's stacks (the model: None)
        self.deferrable: dict[torch.nn.Module, bool] = {}  # whether a watched entry lies inside (the model too)
        self._handles: list[Any] = []  # each hook's handle as it is put on, so that a failure leaves none behind
        self._entry_handles: list[Any] = []
        self._backward: Any = None
        try:
            self._watch(model, self._handles)
            self.follow(entries)
            if on_backward is not None:
                self._backward = count_backwards(model, on_backward, faults)
        except BaseException:
            self.remove()
            raise

    def hand_over(self, enter: Enter) -> None:
        """From now on ``enter`` decides each call, and nothing else of the old owner runs (its ``leave``, its
        backward counter): the modules watched, the call running and ``deciding`` stay."""
        self._enter, self._leave = enter, None
        if self._backward is not None:
            self._backward.remove()
            self._backward = None

    def follow(self, entries: Sequence[tuple[torch.nn.Module, Sequence[Stack]]]) -> None:
        """Watch ``entries`` (and no other entry) from the next call on."""
        for handle in self._entry_handles:
            handle.remove()
        self._entry_handles = []
        self.stacks = {module: stacks for module, stacks in entries if module is not self.model}
        watched = list(self.stacks)
        self.deferrable = {
            module: any(other is not module and _holds(module, other) for other in watched) for module in watched
        }
        self.deferrable[self.model] = bool(watched)
        for module in self.stacks:
            self._watch(module, self._entry_handles)

    def _watch(self, module: torch.nn.Module, handles: list[Any]) -> None:
        """Put the two hooks on ``module``, each handle into ``handles`` as soon as the hook is on."""
        # Under torch.compile the hooks are traced: each only reads ``active`` there, and runs eagerly (a graph break)
        # where it has something to do. An entry inside the model's call (the decoder inside a causal LM) then
        # breaks nothing: a break there split the compiled model into two graphs, the loss apart from the layers
        # (tests/test_compile.py). Each runs shielded; where it fails, the call is entered or left the shortest way
        # (:meth:`_entered_anyway`, :meth:`_left_anyway`), so that the controller's entry point gives up at once.
        before = self._faults.shield(ENTRY, self._before, self._entered_anyway)
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        after = self._faults.shield(END, self._after, self._left_anyway)
        handles.append(module.register_forward_hook(after, with_kwargs=True, always_call=True))

    def _before(self, entered: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.active is None:
            self._begin(entered, args, kwargs)

    def _after(self, entered: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.active is entered:
            self._end(output is None)  # torch hands an always-call hook no output when forward raised

    @torch.compiler.disable
    def _entered_anyway(self, entered: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """The entry hook failed (noted in the run's faults): ``enter`` takes the call as its stacks' entry, under
        ``deciding`` as a training micro-batch, so that the controller's pre-forward hook gives up there with the
        failure and hands over, and the rank owes no collective the others make at this call. This call failed past
        its start (:meth:`_begin` set ``active``): entered again, its agreement left as it was, due or made. A call
        around it being decided: nothing, the next entry point gives up."""
        started = self.active is entered
        if self.active is not None and not started:
            return
        self.active = entered
        deciding = self._deciding if entered.training and torch.is_grad_enabled() else None
        if deciding is not None and not started:
            deciding(True)
        try:
            enter = self._enter
            enter(entered, None if entered is self.model else (), args, kwargs, False)
            if self._enter is not enter:
                self._enter(entered, None if entered is self.model else (), args, kwargs, False)
        finally:
            if deciding is not None:
                deciding(False)

    @torch.compiler.disable
    def _left_anyway(self, entered: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """The end hook failed (noted): the call is left, and ``leave`` told (the controller's post-forward hook, which
        gives up with the failure)."""
        if self.active is not entered:
            return
        self.active = None
        if self._leave is not None:
            self._leave(output is None)

    @torch.compiler.disable
    def _begin(self, entered: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Decide the call ``entered``. Its agreement falls due before ``active`` is set, and stays due where this
        fails before ``enter`` made it: the shield's :meth:`_entered_anyway` then enters the call once more, and the
        controller's entry gives up there making the agreement the other ranks make (a failure before ``active`` is
        set: the whole way, due again)."""
        stacks, deferrable = self.stacks.get(entered), self.deferrable.get(entered, False)
        deciding = self._deciding if entered.training and torch.is_grad_enabled() else None
        if deciding is not None:
            deciding(True)
        self.active = entered  # from here on the call is being decided, its agreement due (or made)
        try:
            enter = self._enter
            decided = enter(entered, stacks, args, kwargs, deferrable)
            if self._enter is not enter:  # handed over while deciding (the controller gave up): offered again
                decided = self._enter(entered, stacks, args, kwargs, deferrable)
        except BaseException as error:
            if deciding is not None and (not isinstance(error, Exception) or training_error(error)):
                deciding(False)  # the step's own error, not noted: nothing enters the call again
            raise
        if deciding is not None:
            deciding(False)
        if decided is False:
            self.active = None

    @torch.compiler.disable
    def _end(self, raised: bool) -> None:
        self.active = None
        if self._leave is not None:
            self._leave(raised)

    def remove(self) -> None:
        backward = [self._backward] if self._backward is not None else []
        for handle in self._handles + self._entry_handles + backward:
            handle.remove()
        self._handles, self._entry_handles, self.stacks, self.deferrable = [], [], {}, {}
        self.active, self._backward = None, None


def _holds(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    """Is ``inner`` a submodule of ``outer``? (Read once, when the hooks are put on.)"""
    return any(module is inner for module in outer.modules())
