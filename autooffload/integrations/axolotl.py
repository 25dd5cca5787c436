"""An axolotl plugin: autooffload in an axolotl run, switched on by the config's ``autooffload`` key::

    plugins:
      - autooffload.integrations.axolotl.AutoOffloadPlugin
    gradient_checkpointing: true
    autooffload: auto            # or true (the default mode), "on", "off", or a mapping of settings:
    # autooffload:
    #   mode: auto
    #   host_memory: 0.5         # a fraction of host RAM (a number or a string), a size (64GiB) or auto
    #   seq_high: 8192

axolotl (0.21) loads the plugins its config names under ``plugins:`` and also every installed one registered in
its ``axolotl.plugins`` entry-point group, so a plugin cannot take being loaded as a request: this one does
nothing unless ``autooffload`` is set (and not false). Its settings are :class:`~autooffload.AutoOffloadCallback`'s
arguments, checked when axolotl registers the plugin (at config load, before any model is built); YAML reads a
bare ``on``/``off`` as a boolean, so as ``mode`` they mean ``"on"``/``"off"`` (as the ``offload`` checkpointing
kwarg does) and as the whole value ``true`` means "on, with the default mode".

Hooks, in axolotl's order: ``get_input_args`` adds the key to axolotl's config schema (else its validation drops
it); ``register`` checks the settings; ``add_callbacks_pre_trainer`` hands Trainer the callback;
``post_trainer_create`` adds the rescue of out-of-memory steps (:func:`autooffload.attach`). axolotl's own
``activation_offloading`` (``gradient_checkpointing: offload``) moves every activation itself: with it on,
autooffload stays out, with one warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..settings import Settings, SettingsError, offload_mode
from ..warn import WarnOnce

try:
    from axolotl.integrations.base import BasePlugin
except ImportError:  # axolotl absent: the plugin still imports (and its hooks can be called as axolotl would)

    class BasePlugin:  # type: ignore[no-redef]
        """What axolotl's ``BasePlugin`` is to this plugin: a base with no behaviour of its own."""


try:
    from pydantic import BaseModel
except ImportError:  # only axolotl, which depends on pydantic, reads the schema
    BaseModel = object  # type: ignore[assignment,misc]

KEY = "autooffload"


class AutoOffloadArgs(BaseModel):
    """The config key axolotl's schema gains from this plugin."""

    autooffload: bool | str | dict[str, Any] | None = None


def plugin_settings(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The :class:`~autooffload.AutoOffloadCallback` arguments the config asks for; None when it asks for nothing.
    Raises :class:`~autooffload.SettingsError` on a value that is not a mode, a boolean or a mapping of settings."""
    value = cfg.get(KEY)
    if value is None or value is False:
        return None
    if value is True:
        settings: dict[str, Any] = {}
    elif isinstance(value, str):
        settings = {"mode": value.strip().lower()}
    elif isinstance(value, Mapping):
        settings = dict(value)
        if isinstance(settings.get("mode"), bool):
            settings["mode"] = offload_mode(settings["mode"])
    else:
        raise SettingsError(f"axolotl config {KEY}: {value!r} is not a mode, true or a mapping of settings")
    # The config's values alone (the environment is checked where it is read); an error names the config key.
    Settings.from_source(f"axolotl config {KEY}", settings, {})
    return settings


def axolotl_offloads(cfg: Mapping[str, Any]) -> bool:
    """axolotl's own activation offload is asked for (``gradient_checkpointing: offload`` sets it too)."""
    return bool(cfg.get("activation_offloading")) or cfg.get("gradient_checkpointing") in ("offload", "offload_disk")


class AutoOffloadPlugin(BasePlugin):
    """autooffload for axolotl; see the module documentation for the config."""

    def get_input_args(self) -> str:
        return f"{__name__}.AutoOffloadArgs"

    def register(self, cfg: Mapping[str, Any]) -> None:
        plugin_settings(cfg)

    def add_callbacks_pre_trainer(self, cfg: Mapping[str, Any], model: Any) -> list[Any]:
        settings = plugin_settings(cfg)
        if settings is None:
            return []
        if axolotl_offloads(cfg):
            WarnOnce()(
                "axolotl-offloading",
                "axolotl's activation_offloading moves every activation to host memory itself, so autooffload "
                "stays off; set activation_offloading: false (and gradient_checkpointing: true) to let autooffload "
                "decide",
            )
            return []
        from ..callback import AutoOffloadCallback

        return [AutoOffloadCallback(**settings)]

    def post_trainer_create(self, cfg: Mapping[str, Any], trainer: Any) -> None:
        from ..callback import AutoOffloadCallback, attach

        if any(isinstance(c, AutoOffloadCallback) for c in trainer.callback_handler.callbacks):
            attach(trainer)  # the callback above, and the rescue of out-of-memory steps
