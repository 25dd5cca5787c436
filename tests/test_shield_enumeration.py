"""Issue 49, section 2: one shield, checked by enumeration. autooffload is attached to a real tiny model under
transformers' Trainer, a custom loop through an optimizer, an accelerate loop and (where installed) Lightning, and
every callable of autooffload's that torch, transformers, accelerate or Lightning can call is collected while they
train: module hooks (forward pre/post, backward, state-dict), tensor and parameter gradient hooks, saved-tensor hooks,
the functions installed in a module's attributes (checkpoint functions), the optimizer's step hooks, the Trainer's
attributes (its wrapped ``log``), callback methods, finalizers (``__del__``, ``weakref.finalize``) and ``atexit``.
Each must be behind the shield (:mod:`autooffload.guard`): a guarded entry point, a shielded place inside a step, or
a checkpoint function whose own work runs in shielded places, known by the name the guard writes on what it returns
(``guard.SHIELD``). Registrations are recorded as they are made (a hook put on and taken off within one forward is
seen too), the rest read off the objects after each step and after a give-up (plain checkpointing's own hook)."""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import pkgutil
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import InOrderTrainer, dataset, model, training_args

import autooffload
from autooffload import OffloadController, Settings, SimulatedDevice
from autooffload.callback import AutoOffloadCallback
from autooffload.guard import SHIELD

LENGTHS = [64, 192, 64, 192]
MODULE_HOOKS = (
    "register_forward_pre_hook", "register_forward_hook", "register_full_backward_hook",
    "register_full_backward_pre_hook", "register_backward_hook", "register_state_dict_pre_hook",
    "register_load_state_dict_post_hook", "_register_state_dict_hook", "_register_load_state_dict_pre_hook",
)  # fmt: skip
OPTIMIZER_HOOKS = (
    "register_step_pre_hook", "register_step_post_hook", "register_state_dict_pre_hook",
    "register_state_dict_post_hook", "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook",
)  # fmt: skip
HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)  # fmt: skip


PACKAGE = str(Path(autooffload.__file__).resolve().parent)


def ours(name: str) -> bool:
    return name == "autooffload" or name.startswith("autooffload.")


def defined_here(function: Any) -> bool:
    """Is ``function`` autooffload's: by its module, or by its code's file (``functools.wraps`` over a function of
    Trainer's copies Trainer's module onto a wrapper of ours)?"""
    if ours(getattr(function, "__module__", None) or ""):
        return True
    code = getattr(function, "__code__", None)
    return code is not None and str(Path(code.co_filename).resolve()).startswith(PACKAGE)


def unshielded(function: Any) -> str | None:
    """None where ``function`` is not autooffload's or is behind the shield; else the name of the callable of
    autooffload's that would run unshielded. Followed from the outside in: through ``functools.partial``, bound
    methods and wrappers (``__wrapped__``) that are not autooffload's, to the first callable that is; a callable
    object by its ``__call__``."""
    seen: set[int] = set()
    while function is not None and id(function) not in seen:
        seen.add(id(function))
        if getattr(function, SHIELD, None):
            return None
        if isinstance(function, functools.partial):
            function = function.func
            continue
        module = getattr(function, "__module__", None) or ""
        if (inspect.isfunction(function) or inspect.ismethod(function)) and defined_here(function):
            return f"{module}.{getattr(function, '__qualname__', repr(function))}"
        if inspect.ismethod(function):
            function = function.__func__
        elif hasattr(function, "__wrapped__"):
            function = function.__wrapped__
        elif not inspect.isfunction(function) and not inspect.isbuiltin(function) and callable(function):
            call = type(function).__call__
            if call is None or not ours(getattr(call, "__module__", "") or ""):
                return None
            function = call.__get__(function)
        else:
            return None
    return None


class Collector:
    """Every callable of autooffload's handed to torch and the others, with where it was registered."""

    def __init__(self) -> None:
        self.found: dict[int, tuple[str, Any]] = {}  # id -> (where, callable), the callable kept alive

    def add(self, where: str, function: Any) -> None:
        known = callable(function) and id(function) not in self.found
        if known and (unshielded(function) is not None or getattr(function, SHIELD, None) or _ours_inside(function)):
            self.found[id(function)] = (where, function)

    def failures(self) -> list[str]:
        """Each unshielded callable of autooffload's by its name (closures made per layer once), and one place it
        was registered."""
        bad: dict[str, str] = {}
        for where, function in self.found.values():
            name = unshielded(function)
            if name is not None:
                bad.setdefault(name, where)
        return sorted(f"{name}, registered as {where}" for name, where in bad.items())

    def count(self) -> int:
        return len(self.found)

    def record(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Record the registrations torch offers, as they are made."""
        methods = [(torch.nn.Module, name) for name in MODULE_HOOKS] + [
            (torch.optim.Optimizer, n) for n in OPTIMIZER_HOOKS
        ]
        methods += [(torch.Tensor, "register_hook"), (torch.Tensor, "register_post_accumulate_grad_hook")]
        for owner, name in methods:
            original = getattr(owner, name)

            def recording(self_, *args, _name=name, _original=original, **kwargs):
                self.add(f"{type(self_).__name__}.{_name}", args[0] if args else kwargs.get("hook"))
                return _original(self_, *args, **kwargs)

            monkeypatch.setattr(owner, name, recording)
        push = torch._C._autograd._push_saved_tensors_default_hooks

        def saved_tensor_hooks(pack, unpack):
            self.add("saved-tensor pack hook", pack)
            self.add("saved-tensor unpack hook", unpack)
            return push(pack, unpack)

        monkeypatch.setattr(torch._C._autograd, "_push_saved_tensors_default_hooks", saved_tensor_hooks)
        for owner, name in ((atexit, "register"), (weakref, "finalize")):
            original = getattr(owner, name)

            def registering(function, *args, _original=original, _where=f"{owner.__name__}.{name}", **kwargs):
                self.add(_where, args[0] if _where == "weakref.finalize" else function)
                return _original(function, *args, **kwargs)

            monkeypatch.setattr(owner, name, registering)

    def read(self, *objects: Any) -> None:
        """What the objects hold now: hooks of every module and optimizer, callables in their attributes, the
        methods of callbacks of autooffload's."""
        for thing in objects:
            for where, function in held(thing):
                self.add(where, function)


def _ours_inside(function: Any) -> bool:
    inner = function
    for _ in range(8):
        if isinstance(inner, functools.partial):
            inner = inner.func
        elif inspect.ismethod(inner):
            inner = inner.__func__
        elif hasattr(inner, "__wrapped__"):
            inner = inner.__wrapped__
        else:
            break
        if ours(getattr(inner, "__module__", "") or ""):
            return True
    return False


def held(thing: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(thing, torch.nn.Module):
        for name, module in thing.named_modules():
            label = f"{type(module).__name__} {name or '(top)'}"
            for attribute in HOOK_DICTS:
                for function in (getattr(module, attribute, None) or {}).values():
                    yield f"{label}.{attribute}", function
            for attribute, value in vars(module).items():
                if callable(value) and not isinstance(value, (torch.nn.Module, torch.Tensor, type)):
                    yield f"{label}.{attribute}", value
        for parameter in thing.parameters():
            for attribute in ("_backward_hooks", "_post_accumulate_grad_hooks"):
                for function in (getattr(parameter, attribute, None) or {}).values():
                    yield f"a parameter's {attribute}", function
    elif isinstance(thing, torch.optim.Optimizer):
        for attribute, value in vars(thing).items():
            if isinstance(value, dict):
                for function in value.values():
                    if callable(function):
                        yield f"{type(thing).__name__}.{attribute}", function
    else:
        for attribute, value in vars(thing).items():
            if callable(value) and not isinstance(value, type):
                yield f"{type(thing).__name__}.{attribute}", value
    if isinstance(thing, (torch.nn.Module, torch.optim.Optimizer)):
        return
    for name in dir(type(thing)):  # a callback's events, its state's save and load (a property's setter too)
        if name.startswith("on_") or name in ("state", "state_dict", "load_state_dict", "setup", "teardown"):
            method = getattr(type(thing), name, None)
            if callable(method) and defined_here(method):
                yield f"{type(thing).__name__}.{name}", getattr(thing, name)
        elif isinstance(getattr(type(thing), name, None), property):
            setter = getattr(type(thing), name).fset
            if setter is not None and defined_here(setter):
                yield f"{type(thing).__name__}.{name} (its setter)", setter


def finalizers() -> Iterator[tuple[str, Any]]:
    """Every ``__del__`` of a class of autooffload's (Python calls it, wherever the last reference goes)."""
    for info in pkgutil.walk_packages(autooffload.__path__, "autooffload."):
        if "integrations" in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and "__del__" in vars(cls):
                yield f"{cls.__qualname__}.__del__ (a finalizer)", vars(cls)["__del__"]


# ---- the clients --------------------------------------------------------------------------------------------


def trainer_run(tmp_path, collector: Collector) -> None:
    callback = AutoOffloadCallback(probe=SimulatedDevice("2.4MiB"), recompute="auto")
    args = training_args(tmp_path, len(LENGTHS), gradient_accumulation_steps=2, save_strategy="steps", save_steps=1)
    trainer = InOrderTrainer(model=model(), args=args, train_dataset=dataset(LENGTHS), callbacks=[callback])
    autooffload.attach(trainer)  # the rescue's and the clean-up's wrappers of the Trainer's methods

    class Reading(autooffload.callback.TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            collector.read(trainer.model, trainer.optimizer, trainer, callback)

    trainer.add_callback(Reading())
    trainer.train()
    collector.read(trainer.model, trainer, callback)


def custom_loop(collector: Collector, engine: str = "sync", give_up: bool = True) -> None:
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    controller = OffloadController(
        Settings(mode="on", engine=engine, host_memory="1GiB"), probe=SimulatedDevice("1GiB")
    )
    controller.attach(net, optimizer=optimizer)
    for seq in LENGTHS:
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
        net(input_ids=ids, labels=ids).loss.backward()
        collector.read(net, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        controller.end_step()
    if give_up:
        controller.give_up("a test", RuntimeError("given up on purpose"))
        net(input_ids=ids, labels=ids).loss.backward()
        collector.read(net, optimizer)
    controller.detach()


def accelerate_loop(collector: Collector) -> None:
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net, optimizer = accelerator.prepare(net, optimizer)
    controller = OffloadController(Settings(recompute="auto"), probe=SimulatedDevice("2.4MiB"))
    controller.attach(accelerator.unwrap_model(net), optimizer=optimizer)
    net.train()
    for seq in LENGTHS:
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
        with accelerator.accumulate(net):
            accelerator.backward(net(input_ids=ids, labels=ids).loss)
            collector.read(net, optimizer.optimizer)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            controller.end_step()
    controller.finish()
    controller.detach()


def lightning_run(tmp_path, collector: Collector) -> None:
    pytest.importorskip("lightning")
    from lightning_worker import fit, quiet

    from autooffload.integrations.lightning import AutoOffload

    quiet()
    callback = AutoOffload(seq_high=128, seq_low=96, min_steps=1)
    import lightning.pytorch as pl

    class Reading(pl.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            collector.read(module, trainer.optimizers[0], callback)

    _, module = fit(tmp_path, LENGTHS, [callback, Reading()])
    collector.read(module, callback)


CLIENTS = {
    "trainer": lambda tmp_path, c: trainer_run(tmp_path, c),
    "custom loop": lambda tmp_path, c: custom_loop(c),
    "custom loop, stream engine": lambda tmp_path, c: custom_loop(c, "stream", give_up=False),
    "accelerate": lambda tmp_path, c: accelerate_loop(c),
    "lightning": lambda tmp_path, c: lightning_run(tmp_path, c),
}


@pytest.mark.parametrize("client", list(CLIENTS))
def test_every_callable_of_ours_a_client_can_call_is_behind_the_shield(client, tmp_path, monkeypatch):
    collector = Collector()
    collector.record(monkeypatch)
    CLIENTS[client](tmp_path, collector)
    print(f"{client}: {collector.count()} callables of autooffload's found")
    assert collector.count() > 0
    assert collector.failures() == [], "\n".join(collector.failures())


def test_every_finalizer_of_ours_is_behind_the_shield():
    collector = Collector()
    for where, function in finalizers():
        collector.add(where, function)
    assert collector.count() > 0
    assert collector.failures() == []


def test_the_finder_names_a_callable_of_ours_that_is_not_shielded(monkeypatch):
    """The check itself: a hook of autooffload's registered without the shield is found and named, with where it
    was put, also inside a ``functools.partial`` and behind a wrapper of torch's; the shielded one beside it is not."""
    from autooffload.guard import StepFaults, in_step, nothing

    namespace: dict[str, Any] = {"__name__": "autooffload.apply.deliberate"}
    exec("def unshielded_hook(module, args):\n    return None\n", namespace)
    bare = namespace["unshielded_hook"]
    place = in_step("a deliberate test place")
    try:
        shielded = StepFaults().shield(place, bare, nothing)
        collector = Collector()
        collector.record(monkeypatch)
        net = model()
        net.register_forward_pre_hook(shielded)
        net.model.layers[0].register_forward_pre_hook(functools.partial(bare))
        net.model.norm.register_forward_pre_hook(torch.compiler.disable(bare))
        net(input_ids=torch.ones(1, 4, dtype=torch.long))
        collector.read(net)
    finally:
        del autooffload.guard.IN_STEP[place.where]
    (failure,) = collector.failures()  # one function, named once
    assert failure.startswith("autooffload.apply.deliberate.unshielded_hook, registered as "), failure
    places = sorted(where for where, function in collector.found.values() if unshielded(function) is not None)
    assert places == ["Qwen3DecoderLayer.register_forward_pre_hook", "Qwen3RMSNorm.register_forward_pre_hook"]
    assert collector.count() == 3
