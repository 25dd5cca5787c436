"""The table of per-type fixes, and the two calls the sweep makes into it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ConfigFix = Callable[[Any], None]
BatchFix = Callable[[Any, Any, dict], dict]

_BASE: dict[str, dict[str, Any]] = {}
_CONFIG: dict[tuple[str, str | None], ConfigFix] = {}
_BATCH: dict[tuple[str, str | None], tuple[str, BatchFix]] = {}
_CHECKPOINTING: dict[str, Callable[[Any], None]] = {}


def base_config(model_type: str, **kwargs: Any) -> None:
    """Build ``model_type``'s config from ``kwargs`` over its defaults: for a type whose default config does not
    validate (the sweep could not even start from it)."""
    _BASE[model_type] = kwargs


def base_kwargs(model_type: str) -> dict[str, Any]:
    return dict(_BASE.get(model_type, {}))


def config_fix(*types: str, mapping: str | None = None) -> Callable[[ConfigFix], ConfigFix]:
    """Register ``fix(config)``, run on the shrunk config of each of ``types`` (in ``mapping`` only, if named)
    before the model is built."""

    def register(fix: ConfigFix) -> ConfigFix:
        for model_type in types:
            _CONFIG[(model_type, mapping)] = fix
        return fix

    return register


def batch_fix(*types: str, mapping: str | None = None, kind: str = "text") -> Callable[[BatchFix], BatchFix]:
    """Register ``fix(model, config, batch) -> batch``: the batch each of ``types`` trains on, given the one the
    sweep built (``kind`` names what it holds for the table: text, image, audio, ...)."""

    def register(fix: BatchFix) -> BatchFix:
        for model_type in types:
            _BATCH[(model_type, mapping)] = (kind, fix)
        return fix

    return register


def _lookup(table: dict, model_type: str, mapping: str) -> Any:
    return table.get((model_type, mapping), table.get((model_type, None)))


def fix_config(model_type: str, mapping: str, config: Any) -> None:
    fix = _lookup(_CONFIG, model_type, mapping)
    if fix is not None:
        fix(config)


def fix_batch(model_type: str, mapping: str, model: Any, config: Any, batch: dict) -> tuple[str | None, dict]:
    """``(kind, batch)``: the registered fix's batch and kind, or ``(None, batch)`` where the type has none."""
    entry = _lookup(_BATCH, model_type, mapping)
    if entry is None:
        return None, batch
    kind, fix = entry
    return kind, fix(model, config, batch)


def checkpointing_fix(*types: str) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    """Register ``enable(model)``: how each of ``types`` is checkpointed for training, where turning it on for the
    whole model breaks transformers' own forward (said in the fix's docstring)."""

    def register(fix: Callable[[Any], None]) -> Callable[[Any], None]:
        for model_type in types:
            _CHECKPOINTING[model_type] = fix
        return fix

    return register


def enable_checkpointing(model_type: str, model: Any) -> None:
    """Turn checkpointing on as ``model_type`` trains with it: its registered fix, else the whole model
    (``activation_checkpointing_enable()`` where the release has it, ``gradient_checkpointing_enable()`` before)."""
    fix = _CHECKPOINTING.get(model_type)
    if fix is not None:
        fix(model)
    else:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


def registered() -> set[tuple[str, str | None]]:
    """Every (type, mapping) with a fix: the sweep's rows that need one."""
    return {(t, None) for t in _BASE} | set(_CONFIG) | set(_BATCH) | {(t, None) for t in _CHECKPOINTING}
