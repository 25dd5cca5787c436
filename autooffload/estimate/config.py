"""Reading a model's local ``config.json`` for ``autooffload estimate``: the layer count and hidden size it needs,
and what the arithmetic uses where the config says it (residual streams per token, an encoder-decoder's two
stacks, the layer's sizes for the keep figures).

No network and no torch work: a file, or a folder holding one, read as JSON. Only the layer count and hidden
size are required; the other readers answer one stream, one stack and no layer shape where the file cannot be
read, so that :func:`read_config` alone says what is wrong with it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from ..decide.activations import STREAM_KEYS, LayerShape
from ..settings import shown
from .arithmetic import LARGEST, EstimateError

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers")
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
# Where a composite config keeps its language model's (transformers' get_text_config, and common remote code).
TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config", "decoder", "generator")


def read_config(path: str | Path) -> tuple[int, int]:
    """(layers, hidden) of a transformers ``config.json`` (or a folder holding one). A composite config's text
    section (``text_config``, ``llm_config``, ``language_config``, ``decoder``) wins over its top level, whose
    ``hidden_size`` is absent or None in a VLM: the plan counts the language model's layers."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise EstimateError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise EstimateError(f"cannot read {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise EstimateError(f"{path} is not valid JSON: {error}") from None
    except RecursionError:
        raise EstimateError(f"{path} cannot be read as a config: its JSON is nested too deeply") from None
    except ValueError:  # an integer of more digits than Python converts (4300)
        raise EstimateError(f"{path} cannot be read as a config: it holds a number too long to read") from None
    if not isinstance(config, dict):
        raise EstimateError(f"{path} holds a JSON {type(config).__name__}, not a config object")
    text = [config[key] for key in TEXT_CONFIG_KEYS if isinstance(config.get(key), dict)]
    scopes = [*text, config]
    layers = _first_int(scopes, LAYER_KEYS, path)
    hidden = _first_int(scopes, HIDDEN_KEYS, path)
    missing = [what for what, value in (("layer count", layers), ("hidden size", hidden)) if value is None]
    keys = {"layer count": LAYER_KEYS, "hidden size": HIDDEN_KEYS}
    for key in (key for what in missing for key in keys[what]):  # present, but not a count: say so
        value = next((scope[key] for scope in scopes if scope.get(key) is not None), None)
        if value is not None:
            raise EstimateError(f"{path}: {key}={shown(value)} is not a whole number; pass --layers/--hidden")
    if missing:
        wanted = "; ".join(f"{m} ({'/'.join(keys[m])})" for m in missing)
        raise EstimateError(f"{path} has no {wanted}; pass --layers/--hidden")
    return layers, hidden  # type: ignore[return-value]


# A Hub model id: owner/name, as transformers' from_pretrained takes it.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def local_config(name: str | Path) -> Path:
    """The ``config.json`` that ``name`` names on this machine: a file, a folder holding one, or a Hub id
    (``Qwen/Qwen3-8B``) whose config is in the local Hugging Face cache. Never the network: the estimate answers
    offline, in well under a second. A Hub id not in the cache is an error that says so, not "not found"."""
    path = Path(name)
    try:
        if path.exists():
            return path / "config.json" if path.is_dir() else path
    except OSError as error:  # a name too long to look up
        raise EstimateError(f"cannot read {shown(str(name))}: {error.strerror or error}") from None
    if not _HUB_ID.fullmatch(str(name)):
        return path  # read_config names it as not found
    hub = hub_cache()
    repo = hub / f"models--{str(name).replace('/', '--')}"
    revision = repo / "refs" / "main"
    snapshots = [repo / "snapshots" / revision.read_text().strip()] if revision.is_file() else []
    snapshots += sorted((repo / "snapshots").glob("*"), key=lambda folder: folder.stat().st_mtime, reverse=True)
    for snapshot in snapshots:
        if (snapshot / "config.json").is_file():
            return snapshot / "config.json"
    raise EstimateError(
        f"{name} is not a local file or folder, and the local Hugging Face cache ({hub}) holds no config of it: "
        f"the estimate reads only a local config.json (no network); fetch it first (hf download {name} "
        "config.json) or pass its path"
    )


def hub_cache() -> Path:
    """Where huggingface_hub keeps downloads: HF_HUB_CACHE, HF_HOME/hub, or the default under ~/.cache."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "huggingface" / "hub"


def _config_or_none(path: str | Path) -> dict[str, Any] | None:
    """A ``config.json`` (or a folder holding one) as a dict, or None where it cannot be read: for the optional
    figures, once :func:`read_config` has said what is wrong with a file that is."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return config if isinstance(config, dict) else None


def read_streams(path: str | Path) -> int:
    """Residual streams per token of a layer input (``hc_mult``/``hc_count``, text config first); 1 if none."""
    config = _config_or_none(path)
    if config is None:
        return 1
    text = [config[key] for key in TEXT_CONFIG_KEYS if isinstance(config.get(key), dict)]
    streams = _first_int([*text, config], STREAM_KEYS, path)
    return streams if streams is not None and streams > 0 else 1


def read_encoder_decoder(path: str | Path) -> tuple[int, int] | None:
    """(encoder layers, decoder layers) of an encoder-decoder ``config.json`` (``is_encoder_decoder``: BART's and
    Whisper's ``encoder_layers``/``decoder_layers``, T5's ``num_layers``/``num_decoder_layers``); None otherwise."""
    config = _config_or_none(path)
    if config is None or config.get("is_encoder_decoder") is not True:
        return None
    encoder = _first_int([config], ("encoder_layers", "num_layers", "num_hidden_layers"), path)
    decoder = _first_int([config], ("decoder_layers", "num_decoder_layers"), path) or encoder
    return (encoder, decoder) if encoder and decoder else None


# The fields of a config the keep figures read (LayerShape.from_config), checked before the arithmetic uses them.
SHAPE_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "attention_dropout")


def read_layer_shape(path: str | Path, hidden: int, dtype_bytes: int) -> LayerShape | None:
    """The layer's sizes for the keep figures from a ``config.json`` (text config first); None where it has none."""
    config = _config_or_none(path)
    if config is None:
        return None
    scope = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    fields = {k: v for k, v in scope.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    for key in SHAPE_KEYS:
        if isinstance(fields.get(key), (int, float)):
            _checked(key, fields[key], path)
    fields["hidden_size"] = hidden
    return LayerShape.from_config(argparse.Namespace(**fields), dtype_bytes)


def _first_int(scopes: list[dict[str, Any]], keys: tuple[str, ...], path: str | Path) -> int | None:
    for scope in scopes:
        for key in keys:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return int(_checked(key, value, path))
    return None


def _checked(key: str, value: float, path: str | Path) -> float:
    """``value`` of ``key`` where the arithmetic can use it: finite and at most 2**40 either way."""
    if abs(value) > LARGEST or (isinstance(value, float) and not math.isfinite(value)):
        raise EstimateError(f"{path}: {key}={shown(value)} is out of range (at most 2**40)")
    return value
