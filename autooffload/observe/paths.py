"""Checkpointing paths: which ones autooffload steers, and one warning for each one it cannot.

Steered (switch.py): transformers' ``_gradient_checkpointing_func`` (Trainer's and ``*_checkpointing_enable``'s
path, under DDP, FSDP and DeepSpeed alike) and torch's ``CheckpointWrapper.checkpoint_fn`` (accelerate's FSDP
``activation_checkpointing``: FSDP1 wraps after sharding with ``apply_activation_checkpointing``, FSDP2 wraps
before ``fully_shard`` with ``checkpoint_wrapper(layer, preserve_rng_state=False)``).

Not steered, each named in one warning when the controller attaches (the start of training):

- DeepSpeed's activation checkpointing (``deepspeed.checkpointing.checkpoint``). Trainer and accelerate never
  call it (read in transformers 5.23 and accelerate 1.16): under DeepSpeed, ZeRO-3 included, transformers'
  checkpointing runs torch's checkpoint, which autooffload steers, and the ``activation_checkpointing``
  section of a DeepSpeed config (``cpu_checkpointing``, ``partition_activations``) acts on nothing unless the
  model calls DeepSpeed's function itself. A model whose checkpoint function was set to DeepSpeed's by hand
  is left alone, and a DeepSpeed config that asks for that section gets a warning through the callback.
- torch's ``OffloadWrapper`` around a checkpointed layer (accelerate's FSDP2 ``activation_checkpointing_offload``,
  torch's ``offload_wrapper``): ``save_on_cpu`` on every call, whatever autooffload decides.
- A trainer's own activation offload (TRL's ``activation_offloading``): the whole training step runs under its
  saved-tensor hooks; autooffload stays out of that training (:func:`trainer_offload_warning`).
- Any other checkpoint function autooffload does not recognise, a framework's wrapper included when what it
  wraps is not torch's checkpoint (LLaMA-Factory's ``use_unsloth_gc``); wrappers of torch's checkpoint are
  steered through the wrapper (wrapped.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .wrapped import defined_name


def describe(function: Callable[..., Any], depth: int = 0) -> str:
    """``module.qualname`` of a checkpoint function, looking through ``functools.partial``; a wrapper made with
    ``functools.wraps`` by where it was defined, and what it wraps (wrapped.py)."""
    inner = function
    while isinstance(inner, functools.partial):
        inner = inner.func
    if inner is checkpoint:
        return "torch.utils.checkpoint.checkpoint"
    defined = defined_name(inner) if hasattr(inner, "__wrapped__") and depth < 4 else None
    if defined is not None:
        return f"{defined} (wrapping {describe(inner.__wrapped__, depth + 1)})"
    owner = getattr(inner, "__self__", None)
    if isinstance(owner, type):  # a classmethod, e.g. an autograd Function's ``apply``
        return f"{owner.__module__}.{owner.__qualname__}.{getattr(inner, '__name__', '?')}"
    module = getattr(inner, "__module__", None) or "?"
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    return f"{module}.{name}"


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return shown if len(names) <= 3 else f"{shown} and {len(names) - 3} more"


def _offload_wrapper_type() -> type | None:
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import OffloadWrapper
    except ImportError:  # torch built without distributed
        return None
    return OffloadWrapper


def uncontrolled(model: torch.nn.Module, unknown: Sequence[tuple[str, Callable[..., Any]]]) -> list[tuple[str, str]]:
    """(warning key, message) for each checkpointing path in ``model`` that autooffload cannot steer (``unknown``:
    each module's name and function first, as :class:`~autooffload.observe.targets.Foreign` holds them)."""
    by_function: dict[str, list[str]] = {}
    for name, function, *_ in unknown:
        by_function.setdefault(describe(function), []).append(name)
    found = []
    for what, names in by_function.items():
        deepspeed = what.startswith("deepspeed")
        kind = f"DeepSpeed's activation checkpointing ({what})" if deepspeed else what
        message = (
            f"the checkpoint function of {_names(names)} is not torch.utils.checkpoint.checkpoint but {kind}; "
            f"autooffload leaves {len(names)} module(s) as they are and does not control them"
        )
        if deepspeed:
            message += (
                " (DeepSpeed's cpu_checkpointing is set once by deepspeed.checkpointing.configure). To let "
                "autooffload decide, keep transformers' own checkpointing: it runs torch's checkpoint under "
                "DeepSpeed too"
            )
        found.append((f"unknown:{what}", message))
    wrapper_type = _offload_wrapper_type()
    wrapped = [name for name, module in model.named_modules() if wrapper_type and isinstance(module, wrapper_type)]
    if wrapped:
        found.append(
            (
                "offload-wrapper",
                f"torch's OffloadWrapper (accelerate's FSDP activation_checkpointing_offload, torch's "
                f"offload_wrapper) wraps {_names(wrapped)}: those {len(wrapped)} module(s) move their saved "
                "inputs to host memory on every step, whatever autooffload decides. Set "
                "activation_checkpointing_offload=False (fsdp_activation_checkpointing_offload) to let autooffload "
                "decide",
            )
        )
    return found


def deepspeed_config_warning(config: Mapping[str, Any] | None) -> str | None:
    """A warning when a DeepSpeed config asks for DeepSpeed's activation checkpointing, which Trainer never runs."""
    section = (config or {}).get("activation_checkpointing")
    if not isinstance(section, Mapping):
        return None
    asked = sorted(key for key, value in section.items() if value is True)
    if not asked:
        return None
    return (
        f"the DeepSpeed config's activation_checkpointing section ({', '.join(asked)}) is not applied: Trainer "
        "and accelerate never call deepspeed.checkpointing, so transformers' checkpointing runs torch's "
        "checkpoint, and autooffload decides when its saved inputs go to host memory"
    )


def trainer_offload_warning(args: Any) -> str | None:
    """A warning when the trainer moves activations to host memory itself: TRL's ``activation_offloading`` (SFT,
    DPO, KTO and reward configs) runs each training step under saved-tensor hooks that copy every activation saved
    in it, the checkpointed layers' inputs included. Two offloaders cannot share the saved tensors: autooffload
    would copy some of the same tensors, or report nothing moved while TRL moves them, so it stays out."""
    if getattr(args, "activation_offloading", False) is not True:
        return None
    return (
        "TRL's activation_offloading moves every activation of each training step to host memory itself, so "
        "autooffload stays out of this training (it installs nothing and reports nothing); set "
        "activation_offloading=False to let autooffload decide"
    )
