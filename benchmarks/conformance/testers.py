"""The sweep's ``testers`` source: every model type with a ``ModelTester`` in transformers' test tree, trained with
that tester's own config and inputs (:func:`check_tester`), not the sweep's tiny ones.

The sweep's own configs and batches missed what only a model's own test inputs show (LUKE's entity inputs, views of
one storage at two offsets; the test's wrapper on the first layer's function; each tester's sizes: issue 50). Here,
per model class of the test class's ``all_model_classes`` that supports checkpointing, and per scenario (a counting
wrapper on the first checkpointed layer's function or none, x ``use_reentrant`` True and False), one step with plain
checkpointing and one with autooffload attached (mode ``on``, sync engine, the sweep's host buffers) from the same
weights and inputs: loss and every gradient must be bit-identical, the wrapper must see the same forwards, and the
bytes moved must be the layer inputs the sweep's own hooks saw checkpointed in the forward (:mod:`.calls`), with no
warning. Then transformers' own ``check_training_gradient_checkpointing`` (the installed release's, from its sdist)
runs class by class with autooffload on: an xfail or skip on the model's test does not apply here, and a class whose
check fails is run again without autooffload, so a failure of the tester's own is told from one autooffload adds.

The tree: the installed release's sdist holds ``tests/test_modeling_common.py`` but not ``tests/models/`` (5.25.0
ships none), so the per-model test modules come from a checkout of transformers' ``tests/`` (``--transformers-tests
DIR`` or ``$TRANSFORMERS_TESTS``, default ``~/.cache/autooffload/transformers-tests``): ``DIR/tests`` with the sdist's
top-level ``tests/*.py`` over it, ``DIR/utils`` (its ``test_module``), ``DIR/src`` (the sdist's, which
``test_pipeline_mixin`` reads), ``DIR/site`` (the tests' own dependencies, ``pip install --target``), and
``DIR/testing_utils.py`` (the tree's own release's ``transformers/testing_utils.py``: names its helpers import that the
installed release moved are taken from it). A test module that does not import is a skipped row with the error.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import logging
import os
import sys
import traceback
import types
import unittest
import warnings
import weakref
from pathlib import Path
from typing import Any

from .calls import CheckpointCalls

TREE = Path.home() / ".cache" / "autooffload" / "transformers-tests"
SCENARIOS = tuple((wrap, reentrant) for wrap in (False, True) for reentrant in (False, True))


class TreeUnavailable(RuntimeError):
    """No test tree with ``tests/models/`` at the given or default place."""


def tree_path(given: str | os.PathLike | None = None) -> Path:
    """The test tree: ``given``, ``$TRANSFORMERS_TESTS`` or :data:`TREE`; raises :class:`TreeUnavailable`."""
    path = Path(given or os.environ.get("TRANSFORMERS_TESTS") or TREE)
    if not (path / "tests" / "models").is_dir():
        raise TreeUnavailable(f"{path} holds no tests/models/ (see benchmarks/conformance/testers.py)")
    return path


def tester_types(tree: str | os.PathLike | None = None) -> list[str]:
    """The model types (test folder names) with a ``test_modeling_<type>.py`` in the tree (:func:`tree_path`)."""
    models = tree_path(tree) / "tests" / "models"
    return sorted(d.name for d in models.iterdir() if (d / f"test_modeling_{d.name}.py").is_file())


def prepare(tree: Path) -> None:
    """Make ``tests`` the tree's package, its dependencies importable after the environment's own, and the names its
    helpers import from ``transformers.testing_utils`` that the installed release lacks taken from the tree's own."""
    import transformers.testing_utils as installed

    if str(tree) not in sys.path:
        sys.path.insert(0, str(tree))
        sys.path.append(str(tree / "site"))
    loaded = sys.modules.get("tests")
    if loaded is not None and not str(getattr(loaded, "__file__", "") or "").startswith(str(tree)):
        for name in [n for n in sys.modules if n == "tests" or n.startswith("tests.")]:
            del sys.modules[name]
    if not (tree / "tests" / "distributed_testing_utils.py").is_file():
        sys.modules.setdefault("tests.distributed_testing_utils", _Unshipped("tests.distributed_testing_utils"))
    own = tree / "testing_utils.py"
    if not own.is_file():
        return
    for node in ast.parse(own.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if not hasattr(installed, name):
                with contextlib.suppress(Exception):
                    setattr(installed, name, ast.literal_eval(node.value))


class _Unshipped(types.ModuleType):
    """A helper module the sdist's mixins import and the sdist does not ship (5.25.0's
    ``tests/distributed_testing_utils.py``): importable, and its functions raise; only distributed tests call them."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def unshipped(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"{self.__name__}.{name} is not shipped in the sdist")

        return unshipped


def _test_classes(model_type: str) -> list[type]:
    module = importlib.import_module(f"tests.models.{model_type}.test_modeling_{model_type}")
    mixin = importlib.import_module("tests.test_modeling_common").ModelTesterMixin
    return [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, unittest.TestCase) and issubclass(c, mixin)
        and c.__module__ == module.__name__
    ]  # fmt: skip


def _case(test_class: type) -> Any:
    """The test class itself as the tester's ``parent`` (its ``setUp`` builds ``self.model_tester`` with the
    arguments the model's test gives it)."""
    case = test_class("setUp")
    case.setUp()
    return case


def _config_and_inputs(case: Any, model_class: type) -> tuple[Any, dict[str, Any]]:
    """What transformers' check trains on: the tester's config (no cache, no dropout) and inputs with labels."""
    config, inputs = case.model_tester.prepare_config_and_inputs_for_common()
    config.use_cache = False
    config.return_dict = True
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    return config, case._prepare_for_class(inputs, model_class, return_labels=True)


class _Step:
    loss: Any = None
    grads: dict[str, Any]
    measured = 0
    moved: int | None = None
    arithmetic: float | None = None
    forwards = 0  # the wrapped layer's forwards (its checkpoint's and its recompute's)
    left = 0  # the wrapped layer's inputs checkpointed in the forward (autooffload leaves a function it does not own)
    in_forward = False
    wrap = False
    wrapped: list[Any]
    warned: list[str]


def _wrap_first_layer(model: Any, step: _Step) -> None:
    """A counting wrapper on the first checkpointed layer's function, as transformers' check puts one (a function
    autooffload does not own, around whatever is installed)."""
    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer

    layer = next(m for m in model.modules() if isinstance(m, GradientCheckpointingLayer))
    inner = layer._gradient_checkpointing_func

    def counting(forward: Any, *args: Any, **kwargs: Any) -> Any:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if step.in_forward and first is not None and torch.is_grad_enabled():
            step.wrapped.append(weakref.ref(first))

        def counted(*a: Any, **k: Any) -> Any:
            step.forwards += 1
            return forward(*a, **k)

        return inner(counted, *args, **kwargs)

    layer._gradient_checkpointing_func = counting


def _loss(output: Any) -> Any:
    """The output's loss; without one (a base model, a backbone), the mean of every floating-point tensor it holds."""
    import torch
    from torch.utils._pytree import tree_leaves

    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    leaves = tree_leaves(output.to_tuple() if hasattr(output, "to_tuple") else output)
    return sum(t.float().mean() for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point())


def train(model_class: type, config: Any, inputs: dict[str, Any], wrap: bool, reentrant: bool, offload: bool) -> _Step:
    """One step of a fresh model (seed 42, every parameter trainable, as transformers' check builds it), checkpointed
    with ``use_reentrant=reentrant``, autooffload attached in mode ``on`` where ``offload``."""
    from transformers import set_seed

    from autooffload import OffloadController, Settings
    from autooffload.apply.host_memory import HostMemory
    from autooffload.warn import AutoOffloadWarning

    step = _Step()
    step.wrapped, step.wrap = [], wrap
    set_seed(42)
    model = model_class(copy.deepcopy(config)).train()
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    controller = None
    logs: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = logs.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers.autooffload")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if offload:
                host = HostMemory(pin=True, register=lambda t: None, unregister=lambda t: None, drain=lambda d: None)
                settings = Settings(mode="on", engine="sync", host_memory="1GiB")
                controller = OffloadController(settings, probe=None, host=host)
                controller.attach(model)
            if wrap:
                _wrap_first_layer(model, step)
            recorder = CheckpointCalls(held=True)
            set_seed(42)
            step.in_forward = True
            with recorder.watching():
                loss = _loss(model(**inputs))
            step.in_forward = False
            step.left = recorder.left([t for t in (ref() for ref in step.wrapped) if t is not None])
            loss.backward()
            if controller is not None:
                step.arithmetic = controller.planned_bytes()
                controller.end_step()
                record = controller.history[-1] if controller.history else None
                step.moved = record.bytes_moved if record is not None else controller.last_step_bytes
                controller.detach()
    finally:
        logger.removeHandler(handler)
    step.loss = loss.detach()
    step.grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    step.measured = recorder.bytes
    step.warned = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    step.warned += [r.getMessage() for r in logs]
    return step


def _differ(plain: _Step, on: _Step) -> str | None:
    import torch

    if not torch.equal(plain.loss, on.loss):
        return f"loss {plain.loss.item()!r} != {on.loss.item()!r}"
    if plain.grads.keys() != on.grads.keys():
        return f"gradients of different parameters ({len(plain.grads)} vs {len(on.grads)})"
    differ = [n for n in plain.grads if not torch.equal(plain.grads[n], on.grads[n])]
    if differ:
        return f"{len(differ)} gradient(s) differ, e.g. {differ[0]}"
    if plain.forwards != on.forwards:
        return f"the wrapper saw {on.forwards} forwards, {plain.forwards} without autooffload"
    warned = sorted(set(on.warned))
    expected = plain.measured - on.left  # a wrapped layer keeps plain checkpointing, and one warning says so
    if on.moved != expected:
        left = f" less the wrapped layer's {on.left}" if on.left else ""
        return f"moved {on.moved} != checkpointed inputs {plain.measured}{left} (arithmetic {on.arithmetic}); {warned}"
    if on.left and (len(warned) != 1 or "leaves 1 module" not in warned[0]):
        return f"the wrapped layer left without its one warning: {' | '.join(warned)[:300]}"
    if warned and not (on.wrap and len(warned) == 1 and "leaves 1 module" in warned[0]):
        return f"warned: {' | '.join(warned)[:300]}"  # one warning where the wrapped layer is left, else none
    return None


def _scenario(model_class: type, config: Any, inputs: dict[str, Any], wrap: bool, reentrant: bool) -> dict[str, Any]:
    try:
        plain = train(model_class, config, inputs, wrap, reentrant, offload=False)
    except Exception as error:
        return {"outcome": f"skipped: plain checkpointing fails: {type(error).__name__}: {str(error)[:200]}"}
    try:
        on = train(model_class, config, inputs, wrap, reentrant, offload=True)
    except Exception as error:
        trace = traceback.format_exc()[-1500:]
        return {"outcome": f"crash: {type(error).__name__}: {str(error)[:300]}", "traceback": trace}
    differ = _differ(plain, on)
    outcome = f"wrong: {differ}" if differ else "correct"
    said = sorted(set(on.warned))
    moved_none = differ and (differ.startswith("moved") or (differ.startswith("warned") and not plain.measured))
    if moved_none and on.moved == 0 and said and all("container-silent" in w for w in said):
        outcome = f"plain-with-warning: {' | '.join(said)[:300]}"  # it cannot steer them, and says so
    found = {"outcome": outcome, "measured": plain.measured, "moved": on.moved}
    return {**found, "forwards": on.forwards} if wrap else found


def _upstream(case: Any, model_class: type) -> str:
    """transformers' check on this class alone with autooffload on, in its scenarios (its default is the
    non-reentrant one on transformers 5, run once): ``pass``; ``fail: ...``
    (it passes without autooffload); ``fails-plain: ...`` (it fails without autooffload too); ``skipped: ...``."""
    from . import upstream

    outcomes = []
    for name, kwargs in upstream.SCENARIOS.items():
        if name == "default" and _default_is_non_reentrant():
            continue  # the same run as ``reentrant=False``
        case.all_model_classes = (model_class,)
        controllers: list[Any] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with upstream.autooffload_on(model_class, controllers):
                outcome = upstream._run(type(case).check_training_gradient_checkpointing, case, kwargs)
            for controller in controllers:
                controller.detach()
            if outcome is not None and not outcome.startswith("skipped"):
                plain = upstream._run(type(case).check_training_gradient_checkpointing, case, kwargs)
                outcome = f"fail: {outcome}" if plain is None else f"fails-plain: {plain}"
        if outcome is not None:
            outcomes.append(f"{name}: {outcome}")
    kinds = {o.split(": ")[1] for o in outcomes}
    worst = next((v for v in ("fail", "fails-plain", "skipped") if v in kinds), "pass")
    return worst if worst == "pass" else f"{worst}: {'; '.join(outcomes)}"


# The sweep's settings for this source: the test tree (None: :func:`tree_path`'s default), and whether transformers'
# own check runs too.
TESTERS: dict[str, Any] = {"tree": None, "upstream": True}


def _default_is_non_reentrant() -> bool:
    """transformers 5 turns checkpointing on with ``use_reentrant=False`` where no kwargs are given."""
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def check_tester(model_type: str, tree: str | os.PathLike | None = None, upstream_check: bool | None = None) -> dict:
    """One row: every class of ``model_type``'s test classes that supports checkpointing, in every scenario, with the
    tester's own config and inputs; ``verdict`` correct / wrong / crash / skipped with ``reason``."""
    row: dict[str, Any] = {"type": model_type, "mapping": "testers", "classes": {}, "checks": {}}
    try:
        prepare(tree_path(tree or TESTERS["tree"]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            test_classes = _test_classes(model_type)
    except Exception as error:
        lines = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {lines[0][:200] if lines else ''}"
        return {**row, "verdict": "skipped", "reason": f"the test module does not import: {reason}"}
    if not test_classes:
        return {**row, "verdict": "skipped", "reason": "no ModelTester test class"}
    for test_class in test_classes:
        try:
            case = _case(test_class)
        except Exception as error:
            row["classes"][test_class.__name__] = f"skipped: setUp: {type(error).__name__}: {str(error)[:200]}"
            continue
        for model_class in case.all_model_classes or ():  # a causal-LM test sets it in ``setUp``
            name = model_class.__name__
            if not getattr(model_class, "supports_gradient_checkpointing", False) or name in row["classes"]:
                continue
            try:
                config, inputs = _config_and_inputs(case, model_class)
            except Exception as error:
                row["classes"][name] = f"skipped: tester's inputs: {type(error).__name__}: {str(error)[:200]}"
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                row["classes"][name] = {
                    f"wrap={wrap} reentrant={reentrant}": _scenario(model_class, config, inputs, wrap, reentrant)
                    for wrap, reentrant in SCENARIOS
                }
            if TESTERS["upstream"] if upstream_check is None else upstream_check:
                row["checks"][name] = _upstream(case, model_class)
    return {**row, **_verdict(row), "upstream": _upstream_verdict(row["checks"])}


def _upstream_verdict(checks: dict[str, str]) -> dict[str, str]:
    """transformers' check over the row's classes, for the table: the worst class decides."""
    if not checks:
        return {}
    kinds = {outcome.split(":")[0] for outcome in checks.values()}
    verdict = next((v for v in ("fail", "fails-plain", "skipped") if v in kinds), "pass")
    reason = "; ".join(f"{name}: {outcome}" for name, outcome in checks.items() if outcome != "pass")
    return {"verdict": verdict, "reason": reason[:300]}


def _verdict(row: dict[str, Any]) -> dict[str, str]:
    """The row's verdict: a crash or a wrong scenario, or a check that fails only with autooffload, decides it."""
    found: dict[str, list[str]] = {"crash": [], "wrong": [], "skipped": [], "correct": [], "plain-with-warning": []}
    for name, scenarios in row["classes"].items():
        pairs = [("", scenarios)] if isinstance(scenarios, str) else [(s, v["outcome"]) for s, v in scenarios.items()]
        for scenario, outcome in pairs:
            found[outcome.split(":")[0]].append(f"{name} {scenario}: {outcome}".replace(" : ", ": "))
    for name, outcome in row["checks"].items():
        if outcome.startswith("fail:"):
            found["wrong"].append(f"{name} transformers' check {outcome}")
    if not row["classes"]:
        return {"verdict": "skipped", "reason": "no model class supports gradient checkpointing"}
    for verdict in ("crash", "wrong"):
        if found[verdict]:
            return {"verdict": verdict, "reason": f"{len(found[verdict])}: " + " || ".join(found[verdict])[:600]}
    if found["plain-with-warning"]:
        return {"verdict": "plain-with-warning", "reason": " || ".join(found["plain-with-warning"])[:600]}
    if not found["correct"]:
        return {"verdict": "skipped", "reason": " || ".join(found["skipped"])[:600]}
    skipped = f"{len(found['skipped'])} skipped: " + " || ".join(found["skipped"])[:300] if found["skipped"] else ""
    return {"verdict": "correct", "reason": skipped}
