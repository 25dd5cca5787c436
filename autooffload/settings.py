"""Settings: one validated object, built from defaults, then ``AUTOOFFLOAD_*`` variables, then arguments.

Everything that can be wrong with a setting is found here, at construction, before any training starts:
a typo in a variable name, a value that is not a number, a threshold out of range, a low threshold above
its high one. The error names where the value came from (an argument, ``argument memory_high``; a variable,
``AUTOOFFLOAD_MEMORY_HIGH``; a config key, ``axolotl config autooffload.memory_high``), the value and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from typing import Any

ENV_PREFIX = "AUTOOFFLOAD_"
MODES = ("auto", "on", "off")
ENGINES = ("sync", "stream")
POLICIES = ("predictive", "hysteresis")
RECOMPUTES = ("always", "auto")
DEFAULT_HOST_SHARE = 0.5  # of the host memory available at start, for the node: AUTOOFFLOAD_HOST_MEMORY=auto
PAGE = 4096
MAX_HOST_BYTES = 2**62


class SettingsError(ValueError):
    """A setting (argument or environment variable) has a value autooffload cannot use."""


class _Follows:
    """The default of a low threshold: it follows its high one (:data:`FOLLOWS`). A value of its own, not the
    number it stands for, so that a low set to 16384 stays 16384 whatever the high is."""

    def __repr__(self) -> str:
        return "FOLLOW"

    def __reduce__(self) -> str:  # copied and pickled as itself: dataclasses.asdict deep-copies
        return "FOLLOW"


FOLLOW: Any = _Follows()


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the controller is allowed to do and when.

    ``mode``: ``"auto"`` lets the policy decide per micro-batch, ``"on"`` always offloads, ``"off"`` never does.
    Offload turns on when the last step's memory fraction reaches ``memory_high`` or a micro-batch's sequence
    length reaches ``seq_high``; it turns off only when memory is below ``memory_low``, the sequence length is
    below ``seq_low`` and ``min_steps`` optimizer steps have passed since the last switch. A low threshold not set
    follows its high one, wherever the high came from (argument, variable, default): ``seq_low`` is half of
    ``seq_high`` (16384 by default) and ``memory_low`` is ``memory_high - 0.10``, at least 0 (0.80 by default);
    one that was set is kept (:data:`FOLLOWS`). Under torch.compile,
    at most ``compile_max_switches`` switches may trigger a recompilation; then offload latches on.
    ``engine``: ``"sync"`` copies on the compute stream; ``"stream"`` overlaps the copies with compute
    (:mod:`autooffload.apply.stream_engine`).

    ``policy`` picks who decides in ``auto`` mode: ``"predictive"`` plans each micro-batch from its token count
    and the memory seen so far, offloading only the layers it needs; ``"hysteresis"`` is the all-or-nothing
    threshold policy described above. ``rescue``: rerun a step that ran out of device memory once, with every
    layer offloaded (only where :func:`autooffload.attach` or :class:`autooffload.rescue.Rescue` is in place).
    ``sync_ranks``: under torch.distributed with more than one rank, agree on one level per micro-batch (the
    ranks' maximum) with one small collective, and gather the worst rank's memory at the end of training;
    off means autooffload makes no collective at all (ranks that do not run the same model, e.g. pipeline stages).
    ``recompute``: ``"always"`` (every checkpointed layer recomputes its forward in the backward, as plain
    checkpointing does) or ``"auto"`` (in ``auto`` mode, the last checkpointed layers may run without
    checkpointing, their activations kept, when the predicted peak leaves room: :mod:`autooffload.decide.ladder`).
    ``keep_margin``: what keep leaves free below ``memory_high``, a share of the device: room for what the
    prediction misses (fragmentation, transient buffers). A reading above a prediction that a correction already
    covered widens it by 0.05 (at most four times); 16 clean steps without a miss narrow it back by one.
    ``host_memory``: the host memory offload may hold on this node, shared by its ranks (``LOCAL_WORLD_SIZE``):
    a fraction of host RAM (``"0.5"``, or the number ``0.5``), a size (``"64GiB"``, ``"512MiB"``), or ``"auto"``,
    half of the host memory available at start. Every level is capped at what fits
    (:mod:`autooffload.apply.host_memory`). A number is kept as its text (``0.5`` -> ``"0.5"``).
    """

    mode: str = "auto"
    memory_high: float = 0.90
    memory_low: float = FOLLOW  # memory_high - 0.10
    seq_high: int = 32768
    seq_low: int = FOLLOW  # seq_high // 2
    min_steps: int = 2
    compile_max_switches: int = 4
    engine: str = "sync"
    policy: str = "predictive"
    rescue: bool = True
    sync_ranks: bool = True
    recompute: str = "always"
    keep_margin: float = 0.05
    host_memory: str = "auto"

    def __post_init__(self) -> None:
        values = _as_settings(dataclasses.asdict(self))
        _check_values(values, {})
        object.__setattr__(self, "_followed", frozenset(low for low in FOLLOWS if values[low] is FOLLOW))
        values = _followed(values)
        for name in ("host_memory", *FOLLOWS):
            object.__setattr__(self, name, values[name])
        _check_order(values, {})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, /, **overrides: Any) -> Settings:
        """Defaults, overridden by ``AUTOOFFLOAD_*`` variables in ``env``, overridden by ``overrides``.

        ``None`` in ``overrides`` means "not given". An ``AUTOOFFLOAD_`` variable that names no setting is an
        error, so that a typo cannot silently leave a default in force. Errors name an override as an argument
        (``argument seq_high=...``); :meth:`from_source` names another source.
        """
        return cls.from_source("argument", overrides, env)

    @classmethod
    def from_source(cls, source: str, overrides: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Settings:
        """:meth:`from_env`, with ``overrides`` from ``source`` as errors name it: ``"argument"`` or a config key
        (``"axolotl config autooffload"``: ``axolotl config autooffload.seq_high=...``)."""
        env = os.environ if env is None else env
        names = {_env_name(f.name): f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        labels = {f.name: f"the default {f.name}" for f in dataclasses.fields(cls)}  # what nobody set
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            if key not in names:
                raise SettingsError(
                    f"unknown environment variable {shown(key)[1:-1]}={shown(raw)}; autooffload reads: "
                    f"{', '.join(sorted(names))}"
                )
            values[names[key].name] = _parse(key, raw, _TYPES[str(names[key].type)])
            labels[names[key].name] = key
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            where = "" if source == "argument" else f" in {source}"
            raise SettingsError(
                f"unknown setting(s) {[shown(name)[1:-1] for name in sorted(unknown)]}{where}; known: "
                f"{[f.name for f in dataclasses.fields(cls)]}"
            )
        given = {k: v for k, v in overrides.items() if v is not None}
        values.update(given)
        labels.update({name: _label(source, name) for name in given})
        _check_values(_as_settings({**_DEFAULTS, **values}), labels)  # each error names its value's source
        _check_order(_followed(_as_settings({**_DEFAULTS, **values})), labels)
        return cls(**_as_settings(values))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}


def resolve(settings: Settings | None, **overrides: Any) -> Settings:
    """``settings`` with ``overrides`` (``None``: not given) in force; without ``settings``, ``Settings.from_env``.
    A low threshold ``settings`` did not set follows an overridden high one, as everywhere else."""
    given = {key: value for key, value in overrides.items() if value is not None}
    if settings is None:
        return Settings.from_env(**given)
    for low, (high, _) in FOLLOWS.items():
        if high in given and low not in given and low in getattr(settings, "_followed", ()):
            given[low] = FOLLOW
    return dataclasses.replace(settings, **given) if given else settings


def offload_mode(value: Any) -> str | None:
    """Map the ``offload`` value of the checkpointing kwargs to a mode: True -> on, False -> off, "auto" -> auto.

    ``None`` (key absent) maps to ``None``. Strings are accepted case-insensitively, including the spellings
    that transformers' own truthiness test would silently treat as on (``"false"``, ``"0"``).
    """
    if value is None:
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text in ("true", "1", "yes", "on"):
            return "on"
        if text in ("false", "0", "no", "off"):
            return "off"
    raise SettingsError(f"checkpointing kwarg offload={shown(value)} is not one of True, False, 'auto'")


_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$")


def parse_host_memory(text: str) -> tuple[str, float]:
    """``"auto"``, a fraction of host RAM in (0, 1] (``"0.5"``) or a size (``"64GiB"``, ``"512MiB"``, ``"8GB"``).

    Returns ``("auto", DEFAULT_HOST_SHARE)``, ``("fraction", f)`` or ``("bytes", n)``; ValueError otherwise.
    """
    text = text.strip().lower()
    if text == "auto":
        return "auto", DEFAULT_HOST_SHARE
    match = _SIZE.match(text)
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(text)
    number, unit = float(match.group(1)), match.group(2)
    if unit == "":
        if not 0.0 < number <= 1.0:
            raise ValueError(text)
        return "fraction", number
    size = number * _UNITS[unit]
    if not PAGE <= size <= MAX_HOST_BYTES:  # a size beyond any machine's is a typo (and would overflow an int)
        raise ValueError(text)
    return "bytes", size


def _env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _label(source: str, name: str) -> str:
    """How an error names setting ``name`` given by ``source`` ("argument", or a config key)."""
    return f"argument {name}" if source == "argument" else f"{source}.{name}"


def _as_settings(values: dict[str, Any]) -> dict[str, Any]:
    """``host_memory`` given as a number (YAML's ``0.5``, an argument's ``0.5``) is its text, as the variable's is."""
    value = values.get("host_memory")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        values = {**values, "host_memory": str(value)}
    return values


# A low threshold nobody set follows its high one, whatever set the high (0.80 under 0.90, 16384 half of 32768 by
# default): a user who sets only the high threshold gets a working pair, not an error about a default, and one rule
# predicts the low from the README's table.
FOLLOWS = {
    "memory_low": ("memory_high", lambda high: round(max(high - 0.10, 0.0), 6)),
    "seq_low": ("seq_high", lambda high: high // 2),
}


def _followed(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each low threshold left at :data:`FOLLOW` computed from its (checked) high one."""
    lows = {low: follow(values[high]) for low, (high, follow) in FOLLOWS.items() if values[low] is FOLLOW}
    return {**values, **lows}


def _check_values(values: dict[str, Any], labels: Mapping[str, str]) -> None:
    """Check every setting in ``values``; an error names a value by ``labels`` (its variable, argument or config
    key)."""
    for field in dataclasses.fields(Settings):
        if field.name in values and values[field.name] is not FOLLOW:
            _check(field.name, values[field.name], _named(field.name, labels), _TYPES[str(field.type)])


def _check_order(values: dict[str, Any], labels: Mapping[str, str]) -> None:
    """Each low threshold at or below its high one, and keep's margin below memory_high (else nothing could ever
    keep); an error names each by ``labels`` (a default as a default)."""
    for low, (high, _) in FOLLOWS.items():
        if values[low] > values[high]:
            raise SettingsError(
                f"{_named(low, labels)}={values[low]} is above {_named(high, labels)}={values[high]}: "
                f"the low threshold must be at or below the high one (hysteresis)"
            )
    if values["keep_margin"] >= values["memory_high"]:
        raise SettingsError(
            f"{_named('keep_margin', labels)}={values['keep_margin']} is not below "
            f"{_named('memory_high', labels)}={values['memory_high']}: keep would never have room under memory_high"
        )


def _named(name: str, labels: Mapping[str, str]) -> str:
    return labels.get(name, _label("argument", name))


# The documented forms of a number in a variable: ASCII digits (an integer setting: 32768), with a decimal point for
# a fraction (0.9). int() and float() take more: other scripts' digits (Arabic-Indic, full-width), underscores
# ('1_000'), a sign ('+1', and '-0', a float -0.0), exponents and 'nan'. A minus sign is read, to be refused by
# the setting's range.
_INTEGER = re.compile(r"-?[0-9]+")
_DECIMAL = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
SHOWN_CHARACTERS = 60


def shown(value: Any) -> str:
    """``repr(value)`` for a message, shortened when long: a 100,000-character value is not echoed whole."""
    text = repr(value)
    if len(text) <= SHOWN_CHARACTERS:
        return text
    length = len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else len(text)
    return f"{text[: SHOWN_CHARACTERS - 20]}... ({length:,} characters)"


def _parse(key: str, raw: str, kind: type) -> Any:
    text = raw.strip()
    if kind in (int, float):
        name = "an integer" if kind is int else "a number"
        form = "ASCII digits, such as 32768" if kind is int else "a decimal in ASCII digits, such as 0.9"
        if not (_INTEGER if kind is int else _DECIMAL).fullmatch(text):
            raise SettingsError(f"{key}={shown(raw)} is not {name}: write it in {form}")
        if text.startswith("-"):  # every number setting is at least 0; '-0' is not a documented 0
            allowed = _ALLOWED[key[len(ENV_PREFIX) :].lower()][0]
            raise SettingsError(f"{key}={text} is not allowed: expected {allowed}")
        try:
            return kind(text)
        except ValueError:  # more digits than Python converts (4300)
            raise SettingsError(f"{key}={shown(raw)} is not allowed: it has too many digits") from None
    if kind is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise SettingsError(f"{key}={shown(raw)} is not a boolean: expected 1 or 0 (true or false)")
    return text.lower()


def _host_memory_ok(value: str) -> bool:
    try:
        parse_host_memory(value)
    except ValueError:
        return False
    return True


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

_ALLOWED = {
    "mode": ("one of " + ", ".join(MODES), lambda v: v in MODES),
    "engine": ("one of " + ", ".join(ENGINES), lambda v: v in ENGINES),
    "policy": ("one of " + ", ".join(POLICIES), lambda v: v in POLICIES),
    "recompute": ("one of " + ", ".join(RECOMPUTES), lambda v: v in RECOMPUTES),
    "rescue": ("a boolean (1 or 0)", lambda v: isinstance(v, bool)),
    "memory_high": ("a fraction in (0, 1]", lambda v: 0.0 < v <= 1.0),
    "memory_low": ("a fraction in [0, 1]", lambda v: 0.0 <= v <= 1.0),
    "keep_margin": ("a fraction in [0, 0.5]", lambda v: 0.0 <= v <= 0.5),
    "seq_high": ("an integer >= 1", lambda v: v >= 1),
    "seq_low": ("an integer >= 0", lambda v: v >= 0),
    "min_steps": ("an integer >= 0", lambda v: v >= 0),
    "compile_max_switches": ("an integer >= 0", lambda v: v >= 0),
    "sync_ranks": ("a boolean (1 or 0)", lambda v: isinstance(v, bool)),
    "host_memory": ("'auto', a fraction of host RAM in (0, 1] or a size such as 64GiB or 512MiB", _host_memory_ok),
}


_TYPES = {"str": str, "int": int, "float": float, "bool": bool}  # field annotations are strings here


_KINDS = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
_GIVEN = {**_KINDS, float: "a float"}


def _check(name: str, value: Any, env_name: str, expected: type) -> None:
    """The type first, then the range: a quoted ``'0.9'`` (YAML) is named a string, not a number out of range."""
    allowed, ok = _ALLOWED[name]
    well_typed = isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
    if expected is float:
        well_typed = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not well_typed:
        kind = _GIVEN.get(type(value), f"a {type(value).__name__}")
        raise SettingsError(f"{env_name}={shown(value)} is {kind}, not {_KINDS[expected]} (expected {allowed})")
    if expected is float and not math.isfinite(value):
        raise SettingsError(f"{env_name}={shown(value)} is not a finite number (expected {allowed})")
    if not ok(value):
        raise SettingsError(f"{env_name}={shown(value)} is not allowed: expected {allowed}")
