"""transformers' own gradient-checkpointing test, run on a model the conformance sweep built, with autooffload on.

transformers ships ``ModelTesterMixin.check_training_gradient_checkpointing`` in ``tests/test_modeling_common.py`` of
its source distribution (not in the wheel). The sweep (:mod:`conformance`) runs that very function, read from the
sdist of the installed release, on each model type it builds: the function builds the model again from the sweep's
tiny config, trains one step without checkpointing, enables checkpointing and trains again (on 5.25 under a
``MagicMock`` wrapped around the first checkpointed layer's function, which must count the layer's forwards), and
compares which parameters got gradients. autooffload is attached in mode ``on`` the moment the function enables
checkpointing. The three scenarios transformers runs are run (default kwargs, ``use_reentrant`` False and True);
where one fails with autooffload, it is run again without, to tell transformers' own failures (the sweep's batch or
build does not suit the test) from autooffload's.

The sdist: ``--transformers-sdist PATH`` (a ``.tar.gz`` or an unpacked directory) or ``$TRANSFORMERS_SDIST``; else
``~/.cache/autooffload/sdist/transformers-VERSION.tar.gz``, fetched there once with ``pip download --no-binary :all:
--no-deps transformers==VERSION`` (the package registry, not a model hub). Only the test module's imports that work
here are run (it imports sibling test packages the sdist lacks); the function is compiled from its source alone.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import functools
import os
import subprocess
import sys
import tarfile
import unittest
import unittest.mock
import warnings
from pathlib import Path
from typing import Any

COMMON = "tests/test_modeling_common.py"
CHECK = "check_training_gradient_checkpointing"
SCENARIOS = {"default": None, "reentrant=False": {"use_reentrant": False}, "reentrant=True": {"use_reentrant": True}}
CACHE = Path.home() / ".cache" / "autooffload" / "sdist"


class SdistUnavailable(RuntimeError):
    """No source distribution of the installed transformers could be found or fetched."""


def sdist_path(version: str, given: str | os.PathLike | None = None) -> Path:
    """The sdist of transformers ``version``: ``given``, ``$TRANSFORMERS_SDIST``, the cache, or fetched into it."""
    for candidate in (given, os.environ.get("TRANSFORMERS_SDIST")):
        if candidate:
            path = Path(candidate)
            if not path.exists():
                raise SdistUnavailable(f"{path} does not exist")
            return path
    cached = CACHE / f"transformers-{version}.tar.gz"
    if cached.exists():
        return cached
    CACHE.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--no-build-isolation"]
    command += ["--quiet", f"transformers=={version}", "-d", str(CACHE)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not cached.exists():
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
        raise SdistUnavailable(f"pip download transformers=={version} failed: {lines[-1]}")
    return cached


def _common_source(path: Path) -> str:
    if path.is_dir():
        return (path / COMMON).read_text(encoding="utf-8")
    with tarfile.open(path) as archive:
        member = next((m for m in archive.getmembers() if m.name.endswith("/" + COMMON)), None)
        if member is None:
            raise SdistUnavailable(f"{path} holds no {COMMON}")
        handle = archive.extractfile(member)
        assert handle is not None
        return handle.read().decode("utf-8")


@functools.cache
def load_check(path: str) -> Any:
    """transformers' ``check_training_gradient_checkpointing``, compiled from the sdist at ``path``, with the names
    its module imports that import here. Raises :class:`SdistUnavailable` where it is not there, or names something
    that did not import."""
    source = _common_source(Path(path))
    tree = ast.parse(source)
    namespace: dict[str, Any] = {"__name__": "transformers_tests_test_modeling_common"}
    for node in tree.body:
        absolute = not (isinstance(node, ast.ImportFrom) and node.level)
        if absolute and isinstance(node, (ast.Import, ast.ImportFrom, ast.If)):
            with contextlib.suppress(Exception), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exec(compile(ast.Module([node], []), path, "exec"), namespace)
    mixin = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelTesterMixin"), None)
    function = next((n for n in getattr(mixin, "body", []) if isinstance(n, ast.FunctionDef) and n.name == CHECK), None)
    if function is None:
        raise SdistUnavailable(f"{path}: ModelTesterMixin has no {CHECK}")
    assigned = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    assigned |= {a.arg for a in ast.walk(function) if isinstance(a, ast.arg)}
    assigned |= {d.name for d in ast.walk(function) if isinstance(d, (ast.FunctionDef, ast.ClassDef))}
    missing = {
        n.id
        for n in ast.walk(function)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
        and n.id not in namespace and n.id not in assigned and not hasattr(builtins, n.id)
    }  # fmt: skip
    if missing:
        raise SdistUnavailable(f"{CHECK} names what did not import here: {', '.join(sorted(missing))}")
    exec(compile(ast.Module([function], []), path, "exec"), namespace)
    return namespace[CHECK]


class _Tester:
    """What the check asks of ``self.model_tester``: a training model and its config and inputs."""

    is_training = True

    def __init__(self, config: Any, batch: dict[str, Any]) -> None:
        self.config, self.batch = config, batch

    def prepare_config_and_inputs_for_common(self) -> tuple[Any, dict[str, Any]]:
        return copy.deepcopy(self.config), dict(self.batch)


class UpstreamCase(unittest.TestCase):
    """The ``self`` of transformers' check: one model class, the sweep's tiny config and batch (with labels).
    ``every_parameter_learns``: the check's ``test_all_params_have_gradient``, which a model's own test turns off
    where its inputs leave parameters unused (:func:`every_parameter_learns`)."""

    def __init__(self, model_class: type, config: Any, batch: dict[str, Any], every_parameter_learns: bool) -> None:
        super().__init__("runTest")
        self.all_model_classes = (model_class,)
        self.model_tester = _Tester(config, batch)
        self.test_all_params_have_gradient = every_parameter_learns

    def runTest(self) -> None:  # unittest wants one; the check is called directly
        pass

    def _prepare_for_class(self, inputs_dict: dict[str, Any], model_class: type, return_labels: bool = False) -> dict:
        return dict(inputs_dict)


def every_parameter_learns(model_class: type, config: Any, batch: dict[str, Any]) -> bool:
    """Does every trainable parameter get a gradient from one step on ``batch``, without checkpointing? Not where
    the sweep's batch leaves a part unused (a VLM's vision layer after the one whose features it takes, a causal
    decoder's cross-attention without encoder states): transformers' own tests of such models set
    ``test_all_params_have_gradient = False``, and the check then compares only which gradients are non-zero."""
    model = model_class(copy.deepcopy(config)).train()
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    model(**batch).loss.backward()
    return all(parameter.grad is not None for parameter in model.parameters())


ENABLERS = ("activation_checkpointing_enable", "gradient_checkpointing_enable")


@contextlib.contextmanager
def autooffload_on(model_class: type, controllers: list[Any]):
    """While inside, a model of ``model_class`` that turns checkpointing on gets autooffload attached, mode ``on``
    (the sweep's settings: the sync engine, host buffers that pin with no-op calls), once; each controller is
    appended to ``controllers``."""
    from autooffload import OffloadController, Settings
    from autooffload.apply.host_memory import HostMemory

    attached: list[Any] = []

    def attaching(original: Any) -> Any:
        @functools.wraps(original)
        def enable(model: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(model, *args, **kwargs)
            if not any(seen is model for seen in attached):
                attached.append(model)
                host = HostMemory(pin=True, register=lambda t: None, unregister=lambda t: None, drain=lambda d: None)
                settings = Settings(mode="on", engine="sync", host_memory="1GiB")
                controller = OffloadController(settings, probe=None, host=host)
                controller.attach(model)
                controllers.append(controller)
            return result

        return enable

    with contextlib.ExitStack() as stack:
        for name in (name for name in ENABLERS if hasattr(model_class, name)):
            stack.enter_context(unittest.mock.patch.object(model_class, name, attaching(getattr(model_class, name))))
        yield


def _run(check: Any, case: UpstreamCase, kwargs: dict | None) -> str | None:
    """The check's outcome: None (passed), ``"skipped: ..."``, or the failure in a line."""
    try:
        check(case, gradient_checkpointing_kwargs=kwargs)
    except unittest.SkipTest as skip:
        return f"skipped: {skip}"
    except Exception as error:
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"
    return None


def run_upstream(model_class: type, config: Any, batch: dict[str, Any], sdist: str | None = None) -> dict[str, Any]:
    """transformers' check on ``model_class`` built from ``config`` and trained on ``batch``, in each scenario, with
    autooffload on. Returns ``verdict``: ``pass``; ``fail`` (autooffload's: the check passes without it);
    ``fails-plain`` (transformers' own test fails on this build without autooffload too); ``skipped`` (the check
    skips the class, or autooffload found nothing to control); ``unavailable`` (no sdist); with ``reason``, each
    scenario's outcome, and the warnings autooffload gave."""
    import transformers

    from autooffload.warn import AutoOffloadWarning

    try:
        check = load_check(str(sdist_path(transformers.__version__, sdist)))
    except SdistUnavailable as error:
        return {"verdict": "unavailable", "reason": str(error)}
    scenarios: dict[str, str] = {}
    warned: list[str] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            learns = every_parameter_learns(model_class, config, batch)
    except Exception:  # the check's own first step fails the same way, and says so
        learns = True

    def case() -> UpstreamCase:
        return UpstreamCase(model_class, config, batch, learns)

    for name, kwargs in SCENARIOS.items():
        controllers: list[Any] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with autooffload_on(model_class, controllers):
                outcome = _run(check, case(), kwargs)
        layers = [len(c.switch.layers) if c.switch is not None else 0 for c in controllers]
        for controller in controllers:
            controller.detach()
        warned += [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
        if outcome is None and not controllers:
            scenarios[name] = "skipped: the check turned no checkpointing on (it skips this class)"
        elif outcome is None and not all(layers):
            scenarios[name] = "skipped: autooffload found no layer to control"
        elif outcome is None:
            scenarios[name] = "pass"
        elif outcome.startswith("skipped"):
            scenarios[name] = outcome
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plain = _run(check, case(), kwargs)
            scenarios[name] = f"fail: {outcome}" if plain is None else f"fails-plain: {plain}"
    verdicts = {value.split(":")[0] for value in scenarios.values()}
    verdict = next((v for v in ("fail", "fails-plain", "skipped") if v in verdicts), "pass")
    reasons = [f"{name}: {value}" for name, value in scenarios.items() if value != "pass"]
    found = {"verdict": verdict, "reason": "; ".join(reasons), "scenarios": scenarios, "warnings": sorted(set(warned))}
    return {**found, "all_params_have_gradient": learns}
