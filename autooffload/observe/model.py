"""Observe: what the model and the optimizer say about sizes, read once at attach.

The controller's first guesses (bytes per token of a layer input, the keep model's layer shape, the logits and
recompute working-set terms, the devices, the optimizer state to come) come from the model's config and
parameters. Configs are not plain records: a per-layer config (Gemma-4's) raises on a global read of
``head_dim``, a composite one may raise in ``get_text_config()``, a remote-code one may raise anything. So every
config read here goes through :class:`ConfigView`, where an attribute that raises is an attribute that is
absent; what the config does not say is then read from each planned layer's first call (the controller's
``_on_first_call``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..decide.activations import STREAM_KEYS, LayerShape
from ..decide.peak import layer_work_bytes_per_token, logits_bytes_per_token, optimizer_state_factor


class ConfigView:
    """A config whose attribute reads never raise: an attribute that raises reads as absent (``getattr``'s
    default), and a nested config comes back wrapped too."""

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "_config", config)

    def __getattr__(self, name: str) -> Any:
        try:
            value = getattr(object.__getattribute__(self, "_config"), name)
        except Exception as error:  # a per-layer config's global read, or anything a remote config does
            raise AttributeError(name) from error
        return ConfigView(value) if _is_config(value) else value

    def get_text_config(self, *args: Any, **kwargs: Any) -> ConfigView:
        config = object.__getattribute__(self, "_config")
        try:
            return ConfigView(config.get_text_config(*args, **kwargs))
        except Exception:  # no text config, or an ambiguous composite one
            return self


def _is_config(value: Any) -> bool:
    return hasattr(type(value), "to_json_string") and hasattr(value, "model_type")


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def text_config(model: torch.nn.Module) -> ConfigView | None:
    """The config of the stack that consumes the tokens: the model's own, or its text config where the top
    level has no hidden size (a VLM's top-level ``hidden_size`` is None on transformers 5.x)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    view = ConfigView(config)
    if _positive_int(getattr(view, "hidden_size", None)) is None:
        view = view.get_text_config()
    return view


def dtype_bytes(model: torch.nn.Module) -> int | None:
    """Bytes per element of the first floating parameter: the dtype the activations take."""
    return next((p.element_size() for p in model.parameters() if p.is_floating_point()), None)


def hidden_size(model: torch.nn.Module) -> int | None:
    config = text_config(model)
    return _positive_int(getattr(config, "hidden_size", None)) if config is not None else None


def streams(model: torch.nn.Module) -> int:
    """Residual streams a layer input carries per token (hyper-connections), 1 where the config names none."""
    config = text_config(model)
    for key in STREAM_KEYS:
        count = _positive_int(getattr(config, key, None)) if config is not None else None
        if count is not None:
            return count
    return 1


def layer_token_bytes(model: torch.nn.Module) -> float | None:
    """Bytes one token's checkpointed layer input takes, from the config: streams x hidden size x parameter
    dtype bytes. A first guess only: the first call of the first planned layer replaces it, and the
    controller with what the hooks measure once a step has offloaded."""
    hidden, size = hidden_size(model), dtype_bytes(model)
    return float(streams(model) * hidden * size) if hidden and size else None


def layer_shape(model: torch.nn.Module) -> LayerShape | None:
    """The text stack's layer sizes from the model's config: the seed of the keep model."""
    config, size = text_config(model), dtype_bytes(model)
    if config is None or size is None:
        return None
    try:
        return LayerShape.from_config(config, size)
    except Exception:  # sizes that make no arithmetic (a zero head count): no seed
        return None


def token_terms(model: torch.nn.Module) -> tuple[float | None, float | None]:
    """(logits, one layer's recompute working set) in bytes per token, from the config; None where unknown."""
    config, size = text_config(model), dtype_bytes(model)
    if config is None or not size:
        return None, None
    vocab = _positive_int(getattr(config, "vocab_size", None))
    hidden = _positive_int(getattr(config, "hidden_size", None))
    logits = logits_bytes_per_token(vocab, size) if vocab else None
    if hidden is None:
        return logits, None
    intermediate = _positive_int(getattr(config, "intermediate_size", None)) or 4 * hidden
    work = layer_work_bytes_per_token(hidden, intermediate, size)
    shape = layer_shape(model)
    # A layer's recompute makes again what it would save kept (the keep seed), and its backward works on that.
    return logits, max(work, shape.bytes_per_token()) if shape is not None else work


def matrix_weights(module: torch.nn.Module, calls: int = 1) -> int:
    """Elements of the module's floating-point parameters of two or more dimensions (what autocast casts for
    its matmuls), per call when a container module runs ``calls`` layers."""
    count = sum(p.numel() for p in module.parameters() if p.is_floating_point() and p.dim() >= 2)
    return count // max(calls, 1)


def model_devices(model: torch.nn.Module) -> list[torch.device]:
    """Every device the parameters are on (several with ``device_map="auto"``); the CPU when there are none."""
    devices = {parameter.device for parameter in model.parameters()}
    return sorted(devices, key=str) or [torch.device("cpu")]


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (and alike)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def optimizer_state_bytes(optimizer: Any) -> tuple[int, int | None]:
    """(bytes the optimizer's state holds now, bytes it holds once every trainable parameter has its state).

    The second is None when the optimizer's kind is unknown. torch's Adam and SGD allocate their state lazily,
    at the first ``step()``, so before it the first number is 0 and the difference is still to come.
    """
    inner = unwrap_optimizer(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        return 0, None
    groups = inner.param_groups
    factor = optimizer_state_factor(type(inner).__name__, groups[0].get("momentum") if groups else None)
    held = sum(
        t.numel() * t.element_size()
        for state in inner.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    if factor is None:
        return held, None
    trainable = sum(p.numel() * p.element_size() for g in groups for p in g["params"] if p.requires_grad)
    if any(g.get("amsgrad") for g in groups):
        factor += 1.0
    return held, round(factor * trainable)
