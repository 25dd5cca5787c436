"""Training frameworks that cannot share the suite's environment, through the real Trainer on a tiny Qwen3.

LLaMA-Factory 0.9.5 pins transformers <= 5.6: a stand-in reproduces how it wires checkpointing, and the run with
autooffload must equal the run without it, bit for bit, with the bytes moved equal to the arithmetic. axolotl
0.21 needs Python >= 3.12: its plugin's hooks are called here the way axolotl calls them.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import pytest
import torch
import transformers
from conftest import InOrderTrainer, dataset, expected_bytes, model, training_args
from packaging.version import Version
from test_layers import gemma2
from torch.utils.checkpoint import checkpoint
from transformers import TrainerCallback

from autooffload import AutoOffloadCallback, AutoOffloadWarning, SettingsError
from autooffload.rescue import rescuing

# From transformers 5.23 a checkpointed layer hands ``partial(forward, layer)`` to the checkpoint function, with no
# ``__self__`` to find the layer by; LLaMA-Factory 0.9.5 (transformers <= 5.6) reads it from ``__call__``'s.
LAYER_CALL_HAS_SELF = Version(transformers.__version__).release < (5, 23)


def llamafactory_checkpointing(net: torch.nn.Module, inner) -> None:
    """Checkpointing as LLaMA-Factory 0.9.5 turns it on (``_gradient_checkpointing_enable`` with
    ``get_custom_gradient_checkpointing_func`` in src/llamafactory/model/model_utils/checkpointing.py),
    reproduced for these tests: ``inner`` (``partial(checkpoint, use_reentrant=...)``, or an autograd
    Function's ``apply`` with ``use_unsloth_gc``) behind a function made with
    ``functools.wraps(inner, assigned=WRAPPER_ASSIGNMENTS + ("__self__",))`` that runs a layer with no
    trainable parameter directly, and otherwise marks the first floating-point tensor argument (the hidden
    states) as requiring grad and calls ``inner``; handed to ``_set_gradient_checkpointing``."""

    @functools.wraps(inner, assigned=(*functools.WRAPPER_ASSIGNMENTS, "__self__"))
    def trainable_layers_only(layer_call, *args, **kwargs):
        layer = (layer_call.func if isinstance(layer_call, functools.partial) else layer_call).__self__
        if not any(parameter.requires_grad for parameter in layer.parameters()):
            return layer_call(*args, **kwargs)
        hidden = next((arg for arg in args if torch.is_tensor(arg) and torch.is_floating_point(arg)), None)
        if hidden is not None:
            hidden.requires_grad_(True)
        return inner(layer_call, *args, **kwargs)

    net._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=trainable_layers_only)
    net.config.use_cache = False


def freeze_all_but_the_last(net: torch.nn.Module, layers: int) -> None:
    """LLaMA-Factory's freeze tuning: only the last ``layers`` decoder layers train (embeddings frozen too)."""
    trainable = {f"model.layers.{index}." for index in range(len(net.model.layers) - layers, len(net.model.layers))}
    for name, parameter in net.named_parameters():
        parameter.requires_grad_(any(name.startswith(prefix) for prefix in trainable))


def wrapper_of(inner):
    """A framework's wrapper as ``functools.wraps`` makes one, simpler than LLaMA-Factory's and so fit for every
    transformers release: it marks the hidden states as requiring grad and calls ``inner``."""

    @functools.wraps(inner)
    def mark_hidden_states(layer_call, *args, **kwargs):
        hidden = next((arg for arg in args if torch.is_tensor(arg) and torch.is_floating_point(arg)), None)
        if hidden is not None:
            hidden.requires_grad_(True)
        return inner(layer_call, *args, **kwargs)

    return mark_hidden_states


def generic_checkpointing(net: torch.nn.Module, inner) -> None:
    net._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=wrapper_of(inner))


def run(tmp_path, lengths, callbacks=(), frozen=None, inner=None, build=model, wiring=llamafactory_checkpointing):
    net = build()
    if frozen is not None:
        freeze_all_but_the_last(net, frozen)
    wiring(net, inner or functools.partial(checkpoint, use_reentrant=True))
    args = training_args(tmp_path, len(lengths), checkpointing=False)  # LLaMA-Factory enables it, not Trainer
    trainer = InOrderTrainer(model=net, args=args, train_dataset=dataset(lengths), callbacks=list(callbacks))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, net, [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]


class Moved(TrainerCallback):
    """The bytes each optimizer step moved."""

    def __init__(self, callback: AutoOffloadCallback) -> None:
        self.controller = callback.controller
        self.rows: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.rows.append(self.controller.last_step_bytes)


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name


needs_layer_self = pytest.mark.skipif(
    not LAYER_CALL_HAS_SELF, reason="LLaMA-Factory's wrapper needs transformers < 5.23 (0.9.5 pins <= 5.6)"
)


@needs_layer_self
def test_llamafactory_wrapper_is_steered_and_trains_as_without_autooffload(tmp_path):
    lengths = [64, 96, 80]
    reference, reference_net, _ = run(tmp_path / "plain", lengths)
    callback = AutoOffloadCallback(mode="on", probe=None)
    moved = Moved(callback)
    trainer, net, warned = run(tmp_path / "auto", lengths, [callback, moved])
    assert warned == []
    assert moved.rows == [expected_bytes(s) for s in lengths]
    assert losses(trainer) == losses(reference)
    assert_same_parameters(net, reference_net)
    assert (
        net.model.layers[0]._gradient_checkpointing_func.__code__
        is reference_net.model.layers[0]._gradient_checkpointing_func.__code__
    )


class Fixed:
    """A policy that always asks for the same number of layers."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    def decide(self, observation) -> int:
        return self.layers


@needs_layer_self
@pytest.mark.parametrize("build", [model, gemma2], ids=["qwen3", "gemma2"])  # Gemma2 on 4.x: the model calls it
def test_llamafactory_freeze_tuning_keeps_the_wrappers_frozen_layer_skip_and_requires_grad(tmp_path, build):
    # Reentrant checkpointing gives no parameter gradients unless an input requires grad: only the wrapper's
    # requires_grad_() on the frozen layers' output lets the two trainable layers learn.
    lengths = [64, 96]
    layers, hidden = build().config.num_hidden_layers, build().config.hidden_size
    reference, reference_net, _ = run(tmp_path / "plain", lengths, frozen=2, build=build)
    callback = AutoOffloadCallback(probe=None, policy=Fixed(layers - 1))
    trainer, net, warned = run(tmp_path / "auto", lengths, [callback], frozen=2, build=build)
    assert warned == []
    # The frozen layers run without checkpoint (the wrapper's skip). In the first micro-batch the earliest layers
    # offload, the first trainable one among them: one layer's inputs move. From the second on, the layers that never
    # called the checkpoint hold nothing and offload last: both trainable layers' inputs move.
    first, second = lengths
    moved = expected_bytes(first, layers=1, hidden=hidden) + expected_bytes(second, layers=2, hidden=hidden)
    assert callback.controller.stats.total_bytes == moved
    assert losses(trainer) == losses(reference)
    assert_same_parameters(net, reference_net)
    untouched = build()
    frozen, trained = net.model.layers[layers - 3], net.model.layers[layers - 1]
    assert torch.equal(frozen.mlp.up_proj.weight, untouched.model.layers[layers - 3].mlp.up_proj.weight)
    assert not torch.equal(trained.mlp.up_proj.weight, untouched.model.layers[layers - 1].mlp.up_proj.weight)


def frozen_layers_skip(inner):
    """LLaMA-Factory's freeze-tuning skip, for every transformers release: a layer without a trainable parameter
    runs directly, without calling the checkpoint (the layer is the call's ``__self__``, or, from transformers
    5.23, the first argument of the ``partial(forward, layer)`` it hands over)."""

    @functools.wraps(inner)
    def trainable_layers_only(layer_call, *args, **kwargs):
        layer = getattr(layer_call, "__self__", None)
        if isinstance(layer_call, functools.partial):
            layer = getattr(layer_call.func, "__self__", None) or layer_call.args[0]
        if not any(parameter.requires_grad for parameter in layer.parameters()):
            return layer_call(*args, **kwargs)
        hidden = next((arg for arg in args if torch.is_tensor(arg) and torch.is_floating_point(arg)), None)
        if hidden is not None:
            hidden.requires_grad_(True)
        return inner(layer_call, *args, **kwargs)

    return trainable_layers_only


def skipping_checkpointing(net: torch.nn.Module, inner) -> None:
    net._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=frozen_layers_skip(inner))
    net.config.use_cache = False


def test_layers_a_wrapper_runs_without_checkpoint_are_offloaded_last(tmp_path):
    """Freeze tuning behind a framework's wrapper: the three frozen layers never call the checkpoint, so offloading
    them moves nothing. Before: autooffload offloaded the earliest layers first, the frozen ones (a decision to
    offload 1 layer moved 0 bytes, and memory stayed over memory_high until it offloaded all but one). Now a layer
    that has never called the checkpoint counts as holding nothing, and one layer offloaded is the trainable one,
    from the first micro-batch after one that showed it."""
    lengths = [64, 96, 80]
    reference, reference_net, _ = run(tmp_path / "plain", lengths, frozen=1, wiring=skipping_checkpointing)
    callback = AutoOffloadCallback(probe=None, policy=Fixed(1))
    moved = Moved(callback)
    trainer, net, warned = run(tmp_path / "auto", lengths, [callback, moved], frozen=1, wiring=skipping_checkpointing)
    assert warned == []
    assert moved.rows == [0, expected_bytes(96, layers=1), expected_bytes(80, layers=1)]
    assert losses(trainer) == losses(reference)
    assert_same_parameters(net, reference_net)


def test_a_wrapper_of_torchs_checkpoint_is_steered_on_every_release(tmp_path):
    lengths = [64, 96]
    reference, reference_net, _ = run(tmp_path / "plain", lengths, wiring=generic_checkpointing)
    callback = AutoOffloadCallback(probe=None, policy=Fixed(2))
    moved = Moved(callback)
    trainer, net, warned = run(tmp_path / "auto", lengths, [callback, moved], wiring=generic_checkpointing)
    assert warned == []
    assert moved.rows == [expected_bytes(s, layers=2) for s in lengths]
    assert losses(trainer) == losses(reference)
    assert_same_parameters(net, reference_net)


class WrapsAtTrainBegin(TrainerCallback):
    """Another tool that wraps each layer's checkpoint function with ``functools.wraps`` as training begins, after
    autooffload installed its own (a tracer, a profiler): it counts the calls and calls what it found."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        for layer in model.model.layers:
            layer._gradient_checkpointing_func = self.tracing(layer._gradient_checkpointing_func)

    def tracing(self, inner):
        @functools.wraps(inner)
        def traced(layer_call, *args, **kwargs):
            self.calls += 1
            return inner(layer_call, *args, **kwargs)

        return traced


def test_a_wrapper_put_around_autooffloads_keeps_the_frameworks_wrapper_beneath(tmp_path):
    """Freeze tuning behind a framework's wrapper, reentrant: the frozen layers skip the checkpoint and only the
    wrapper's requires_grad_() lets the last layer learn. A tool wraps autooffload's functions (the framework's
    wrapper rebuilt around autooffload's) as training begins: both wrappers run, as they would without autooffload.
    Before, the functions installed under the new wrapper dropped the framework's (the run failed in its first
    backward: no input of the checkpoint required grad)."""
    lengths = [64, 96]
    plain = WrapsAtTrainBegin()
    reference, reference_net, _ = run(tmp_path / "plain", lengths, [plain], frozen=1, wiring=skipping_checkpointing)
    callback, wraps = AutoOffloadCallback(mode="on", probe=None), WrapsAtTrainBegin()
    moved = Moved(callback)
    trainer, net, warned = run(
        tmp_path / "auto", lengths, [callback, wraps, moved], frozen=1, wiring=skipping_checkpointing
    )
    assert warned == []
    assert wraps.calls == plain.calls == len(net.model.layers) * len(lengths)
    assert moved.rows == [expected_bytes(s, layers=1) for s in lengths]  # the trainable layer alone checkpoints
    assert losses(trainer) == losses(reference)
    assert_same_parameters(net, reference_net)


def test_a_failure_inside_autooffload_keeps_the_frameworks_wrapper(tmp_path, monkeypatch):
    """Giving up installs plain checkpointing: around it, the framework's wrapper autooffload steered through, not
    torch's checkpoint bare. Before, freeze tuning with reentrant checkpointing failed in its first backward after
    the failure (the wrapper's requires_grad_() gone)."""
    import autooffload.decide.planner as planner_module

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    lengths = [64, 96]
    reference, reference_net, _ = run(tmp_path / "plain", lengths, frozen=1, wiring=skipping_checkpointing)
    monkeypatch.setattr(planner_module, "host_cap", boom)
    callback = AutoOffloadCallback(mode="on", probe=None)
    trainer, net, warned = run(tmp_path / "auto", lengths, [callback], frozen=1, wiring=skipping_checkpointing)
    assert len(warned) == 1 and "internal error in the pre-forward hook" in warned[0], warned
    assert losses(trainer) == losses(reference)
    assert_same_parameters(net, reference_net)


def recompute_nothing(function, *args, **kwargs):
    """A checkpoint function that is not torch's: it just calls the layer."""
    return function(*args, **kwargs)


def test_a_wrapper_of_a_foreign_function_gets_one_warning_naming_both(tmp_path):
    callback = AutoOffloadCallback(mode="on", probe=None)
    _, net, warned = run(tmp_path, [64], [callback], inner=recompute_nothing, wiring=generic_checkpointing)
    assert len(warned) == 1, warned  # and not "no checkpointed layers found ... enable checkpointing first"
    assert "wrapper_of.<locals>.mark_hidden_states (wrapping test_frameworks.recompute_nothing)" in warned[0]
    assert "leaves 5 module(s) as they are" in warned[0]  # the model and its 4 layers
    assert net.model.layers[0]._gradient_checkpointing_func.__wrapped__ is recompute_nothing
    assert callback.controller.stats.total_bytes == 0


# ---- axolotl: the plugin, its hooks called as axolotl (0.21) calls them --------------------------------------

PLUGIN = "autooffload.integrations.axolotl.AutoOffloadPlugin"


def load_plugin(name: str = PLUGIN):
    """What axolotl's ``load_plugin`` does with a name from ``plugins:``: import the module, make the class."""
    module_name, class_name = name.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), class_name)()


def axolotl_run(tmp_path, cfg: dict, lengths=(64, 96)):
    """axolotl's order: ``register(cfg)`` at config load, ``add_callbacks_pre_trainer(cfg, model)`` into
    Trainer's callbacks, ``post_trainer_create(cfg, trainer)``, then ``train()``. Returns (trainer, bytes per step)."""
    plugin = load_plugin()
    plugin.register(cfg)
    net = model()
    callbacks = plugin.add_callbacks_pre_trainer(cfg, net)
    args = training_args(tmp_path, len(lengths), offload=None)  # axolotl: gradient_checkpointing: true
    trainer = InOrderTrainer(model=net, args=args, train_dataset=dataset(list(lengths)), callbacks=callbacks)
    plugin.post_trainer_create(cfg, trainer)
    ours = [c for c in trainer.callback_handler.callbacks if isinstance(c, AutoOffloadCallback)]
    moved = Moved(ours[0]) if ours else None
    if moved is not None:
        trainer.add_callback(moved)
    trainer.train()
    return trainer, ours, moved.rows if moved is not None else None


@pytest.mark.parametrize("value", [None, False])
def test_axolotl_plugin_does_nothing_unless_its_key_asks(tmp_path, value):
    cfg = {"gradient_checkpointing": True} if value is None else {"autooffload": value, "gradient_checkpointing": True}
    trainer, ours, _ = axolotl_run(tmp_path, cfg, lengths=[64])
    assert ours == []
    assert "training_step" not in vars(trainer)  # no rescue either


@pytest.mark.parametrize(
    ("value", "mode"),
    [(True, "auto"), ("on", "on"), ({"mode": True, "engine": "sync"}, "on")],  # YAML reads a bare on as True
)
def test_axolotl_plugin_trains_with_the_settings_and_the_rescue(tmp_path, value, mode):
    trainer, ours, moved = axolotl_run(tmp_path, {"autooffload": value, "gradient_checkpointing": True})
    assert len(ours) == 1 and ours[0].controller.settings.mode == mode
    assert moved == ([expected_bytes(s) for s in (64, 96)] if mode == "on" else [0, 0])
    assert rescuing(trainer)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("sometimes", "^axolotl config autooffload.mode='sometimes' is not allowed"),
        ({"seq_hi": 4096}, r"unknown setting\(s\) \['seq_hi'\] in axolotl config autooffload"),
        ({"host_memory": 1.5}, "^axolotl config autooffload.host_memory='1.5' is not allowed: expected 'auto', a"),
        (3, "3 is not a mode, true or a mapping of settings"),
    ],
)
def test_axolotl_plugin_rejects_a_bad_setting_when_axolotl_registers_it(value, error):
    with pytest.raises(SettingsError, match=error):
        load_plugin().register({"autooffload": value})


def test_a_bad_environment_variable_is_not_blamed_on_the_axolotl_config(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_SEQ_HIGH", "lots")
    load_plugin().register({"autooffload": {"mode": "auto"}})  # the config is fine
    with pytest.raises(SettingsError, match="AUTOOFFLOAD_SEQ_HIGH") as raised:
        load_plugin().add_callbacks_pre_trainer({"autooffload": "auto"}, None)
    assert "axolotl config" not in str(raised.value)


def test_axolotl_plugin_stays_out_of_axolotls_own_activation_offloading():
    with pytest.warns(AutoOffloadWarning, match="axolotl's activation_offloading moves every activation") as caught:
        callbacks = load_plugin().add_callbacks_pre_trainer(
            {"autooffload": "auto", "activation_offloading": True}, None
        )
    assert callbacks == [] and len(caught) == 1


def test_axolotl_plugin_key_survives_axolotls_config_validation():
    import pydantic

    class AxolotlInputConfig(pydantic.BaseModel):  # stands for axolotl's schema: unknown keys are dropped
        gradient_checkpointing: bool | None = None

    plugin = load_plugin()
    module_name, class_name = plugin.get_input_args().rsplit(".", 1)
    merged = type("Merged", (AxolotlInputConfig, getattr(importlib.import_module(module_name), class_name)), {})
    raw = {"gradient_checkpointing": True, "autooffload": {"mode": "auto", "seq_high": 4096}}
    assert "autooffload" not in AxolotlInputConfig(**raw).model_dump(exclude_none=True)
    assert merged(**raw).model_dump(exclude_none=True)["autooffload"] == {"mode": "auto", "seq_high": 4096}
    assert merged(autooffload="auto").model_dump(exclude_none=True)["autooffload"] == "auto"
