import pytest

from autooffload import AutoOffloadCallback, Settings, SettingsError
from autooffload.integrations.axolotl import AutoOffloadPlugin
from autooffload.settings import offload_mode, resolve


def test_defaults():
    s = Settings.from_env({})
    assert (s.mode, s.memory_high, s.memory_low, s.min_steps) == ("auto", 0.90, 0.80, 2)
    assert s.seq_low <= s.seq_high
    assert (s.policy, s.rescue) == ("predictive", True)
    assert s.keep_margin == 0.05


@pytest.mark.parametrize(("raw", "value"), [("0", False), ("off", False), ("FALSE", False), ("1", True), ("yes", True)])
def test_rescue_switch_spellings(raw, value):
    assert Settings.from_env({"AUTOOFFLOAD_RESCUE": raw}).rescue is value


def test_policy_from_env_and_argument():
    assert Settings.from_env({"AUTOOFFLOAD_POLICY": "Hysteresis"}).policy == "hysteresis"
    assert AutoOffloadCallback(policy="hysteresis", probe=None).controller.policy.__class__.__name__ == (
        "HysteresisPolicy"
    )
    assert AutoOffloadCallback(probe=None).controller.policy.__class__.__name__ == "PredictivePolicy"


def test_env_overrides_defaults_and_arguments_override_env():
    env = {"AUTOOFFLOAD_MEMORY_HIGH": "0.85", "AUTOOFFLOAD_SEQ_HIGH": "16384", "AUTOOFFLOAD_MODE": "ON"}
    s = Settings.from_env(env)
    assert (s.memory_high, s.seq_high, s.mode) == (0.85, 16384, "on")
    s = Settings.from_env(env, memory_high=0.95, mode=None)
    assert (s.memory_high, s.mode) == (0.95, "on")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"AUTOOFFLOAD_MEMORY_HIGH": "high"}, r"AUTOOFFLOAD_MEMORY_HIGH='high' is not a number"),
        (
            {"AUTOOFFLOAD_MEMORY_HIGH": "1.5"},
            r"AUTOOFFLOAD_MEMORY_HIGH=1.5 is not allowed: expected a fraction in \(0, 1\]",
        ),
        (
            {"AUTOOFFLOAD_MEMORY_LOW": "-0.1"},
            r"AUTOOFFLOAD_MEMORY_LOW=-0.1 is not allowed: expected a fraction in \[0, 1\]",
        ),
        ({"AUTOOFFLOAD_MEMORY_HIGH": "nan"}, r"AUTOOFFLOAD_MEMORY_HIGH='nan' is not a number"),
        ({"AUTOOFFLOAD_SEQ_HIGH": "4k"}, r"AUTOOFFLOAD_SEQ_HIGH='4k' is not an integer"),
        ({"AUTOOFFLOAD_SEQ_HIGH": "0"}, r"AUTOOFFLOAD_SEQ_HIGH=0 is not allowed: expected an integer >= 1"),
        ({"AUTOOFFLOAD_MIN_STEPS": "-1"}, r"AUTOOFFLOAD_MIN_STEPS=-1 is not allowed: expected an integer >= 0"),
        ({"AUTOOFFLOAD_COMPILE_MAX_SWITCHES": "x"}, r"AUTOOFFLOAD_COMPILE_MAX_SWITCHES='x' is not an integer"),
        (
            {"AUTOOFFLOAD_MODE": "sometimes"},
            r"AUTOOFFLOAD_MODE='sometimes' is not allowed: expected one of auto, on, off",
        ),
        ({"AUTOOFFLOAD_ENGINE": "magic"}, r"AUTOOFFLOAD_ENGINE='magic' is not allowed"),
        (
            {"AUTOOFFLOAD_POLICY": "oracle"},
            r"AUTOOFFLOAD_POLICY='oracle' is not allowed: expected one of predictive, hysteresis",
        ),
        ({"AUTOOFFLOAD_RESCUE": "maybe"}, r"AUTOOFFLOAD_RESCUE='maybe' is not a boolean"),
        (
            {"AUTOOFFLOAD_MEMORY_HI": "0.9"},
            r"unknown environment variable AUTOOFFLOAD_MEMORY_HI='0.9'; autooffload reads: ",
        ),
        (
            {"AUTOOFFLOAD_MEMORY_LOW": "0.95"},
            r"AUTOOFFLOAD_MEMORY_LOW=0.95 is above the default memory_high=0.9: the low threshold must be at or below",
        ),
        ({"AUTOOFFLOAD_SEQ_LOW": "65536"}, r"AUTOOFFLOAD_SEQ_LOW=65536 is above the default seq_high=32768"),
    ],
)
def test_bad_environment_value_fails_at_construction(env, message):
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


def test_bad_environment_value_fails_when_the_callback_is_built(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_MIN_STEPS", "two")
    with pytest.raises(SettingsError, match="AUTOOFFLOAD_MIN_STEPS='two' is not an integer"):
        AutoOffloadCallback()


def test_bad_argument_names_the_argument_not_a_variable_nobody_set():
    # Before: "AUTOOFFLOAD_MEMORY_HIGH=2 is not allowed", for an argument.
    with pytest.raises(SettingsError, match=r"^argument memory_high=2 is not allowed: expected a fraction in \(0, 1\]"):
        AutoOffloadCallback(memory_high=2)
    with pytest.raises(SettingsError, match="unknown setting"):
        Settings.from_env({}, memory_hgih=0.5)
    with pytest.raises(SettingsError, match=r"^argument rescue='yes' is a string, not a boolean"):
        AutoOffloadCallback(rescue="yes")
    with pytest.raises(SettingsError, match=r"^argument min_steps=-1 is not allowed"):
        Settings(min_steps=-1)
    with pytest.raises(SettingsError, match=r"^argument memory_low=0.95 is above the default memory_high=0.9"):
        Settings.from_env({}, memory_low=0.95)  # a default is named as a default, not as a variable nobody set


def test_a_high_threshold_set_alone_takes_its_low_one_with_it():
    """Issue 37, item 4.3: ``AutoOffloadCallback(seq_high=8192)`` and the axolotl mapping of docs/frameworks.md
    (``seq_high: 8192``) raised "AUTOOFFLOAD_SEQ_LOW=16384 is above argument seq_high=8192" although no variable was
    set. A low threshold nobody set follows its high one as the defaults stand (half the length; 0.10 below the
    fraction); one that was set is kept, and checked."""
    assert AutoOffloadCallback(seq_high=8192).controller.settings.seq_low == 4096
    plugin = AutoOffloadPlugin()
    mapping = {"autooffload": {"mode": "auto", "host_memory": 0.5, "seq_high": 8192}}  # docs/frameworks.md
    plugin.register(mapping)
    (callback,) = plugin.add_callbacks_pre_trainer(mapping, None)
    assert (callback.controller.settings.seq_high, callback.controller.settings.seq_low) == (8192, 4096)
    assert Settings(seq_high=8192).seq_low == 4096 and Settings(memory_high=0.7).memory_low == 0.6
    assert Settings.from_env({"AUTOOFFLOAD_SEQ_HIGH": "65536"}).seq_low == 32768
    assert Settings.from_env({}, memory_high=0.5).memory_low == 0.4
    assert Settings.from_env({"AUTOOFFLOAD_SEQ_LOW": "100"}, seq_high=8192).seq_low == 100  # set: kept
    with pytest.raises(SettingsError, match=r"^argument seq_low=10000 is above argument seq_high=8192"):
        Settings.from_env({}, seq_high=8192, seq_low=10000)


@pytest.mark.parametrize(
    ("high", "low", "value", "follows"),
    [
        ("seq_high", "seq_low", 8192, 4096),
        ("seq_high", "seq_low", 65536, 32768),
        ("seq_high", "seq_low", 1, 0),
        ("memory_high", "memory_low", 0.7, 0.6),
        ("memory_high", "memory_low", 0.95, 0.85),
        ("memory_high", "memory_low", 0.08, 0.0),
    ],
)
def test_a_low_threshold_not_set_follows_its_high_one_by_one_rule_from_every_source(high, low, value, follows):
    """Issue 54: ``Settings(seq_high=65536).seq_low`` was 16384 (the constructor followed only a high set below the
    default low) while ``from_env`` gave 32768. One rule, the README's table's: a low not set is half the high
    length, 0.10 below the high fraction (at least 0), wherever the high came from; a low that was set is kept, even
    at its default's value."""
    built = [
        Settings(**{high: value}),
        Settings.from_env({"AUTOOFFLOAD_" + high.upper(): str(value)}),
        Settings.from_env({}, **{high: value}),
        Settings.from_source("axolotl config autooffload", {high: value}, {}),
        resolve(None, **{high: value}),
        resolve(Settings(), **{high: value}),
    ]
    assert [getattr(s, low) for s in built] == [follows] * len(built)
    default = getattr(Settings(), low)
    assert getattr(Settings(**{high: value, low: min(default, follows)}), low) == min(default, follows)
    assert getattr(Settings.from_env({}, **{high: value, low: min(default, follows)}), low) == min(default, follows)


def test_a_low_threshold_set_stays_set_when_a_high_one_is_overridden():
    assert resolve(Settings(seq_low=100), seq_high=65536).seq_low == 100
    assert resolve(Settings(seq_high=8192), seq_high=65536).seq_low == 32768
    assert Settings(seq_high=65536, seq_low=16384).seq_low == 16384
    assert (Settings().seq_low, Settings().memory_low) == (16384, 0.8)


def test_each_source_is_named_in_its_error(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_SEQ_HIGH", "100")
    with pytest.raises(SettingsError, match=r"^argument seq_low=200 is above AUTOOFFLOAD_SEQ_HIGH=100"):
        AutoOffloadCallback(seq_low=200)
    axolotl = r"^axolotl config autooffload.seq_low=200 is above AUTOOFFLOAD_SEQ_HIGH=100"
    with pytest.raises(SettingsError, match=axolotl):
        Settings.from_source("axolotl config autooffload", {"seq_low": 200})
    with pytest.raises(SettingsError, match=r"^AUTOOFFLOAD_HOST_MEMORY='2.5' is not allowed"):
        Settings.from_env({"AUTOOFFLOAD_HOST_MEMORY": "2.5"})
    with pytest.raises(SettingsError, match=r"^argument host_memory='2.5' is not allowed: expected 'auto', a fraction"):
        AutoOffloadCallback(host_memory=2.5)
    with pytest.raises(SettingsError, match=r"unknown setting\(s\) \['seq_hi'\] in axolotl config autooffload"):
        Settings.from_source("axolotl config autooffload", {"seq_hi": 1}, {})


@pytest.mark.parametrize("value", [0.5, "0.5", 1, "1", "64GiB", "512MiB", "auto", "AUTO"])
def test_host_memory_takes_every_documented_form_from_every_source(monkeypatch, value):
    """The README's forms (a fraction, a size, auto) as an argument, a variable and a YAML value (a float there).
    Before: the number 0.5 was refused, naming AUTOOFFLOAD_HOST_MEMORY, which nobody had set."""
    from autooffload.integrations.axolotl import plugin_settings
    from autooffload.settings import parse_host_memory

    expected = parse_host_memory(str(value))
    assert parse_host_memory(Settings(host_memory=value).host_memory) == expected
    assert parse_host_memory(AutoOffloadCallback(host_memory=value, probe=None).controller.settings.host_memory) == (
        expected
    )
    assert parse_host_memory(Settings.from_env({"AUTOOFFLOAD_HOST_MEMORY": str(value)}).host_memory) == expected
    assert plugin_settings({"autooffload": {"host_memory": value}}) == {"host_memory": value}
    monkeypatch.setenv("AUTOOFFLOAD_HOST_MEMORY", str(value))
    assert parse_host_memory(AutoOffloadCallback(probe=None).controller.settings.host_memory) == expected


@pytest.mark.parametrize("probe", ["nvml", "NVML", "none", "", "Auto", 5])
def test_a_probe_that_is_not_one_is_refused_at_construction(probe):
    """Before: accepted; training started without a memory signal and the only sign was a misleading
    probe-failed warning after the first step."""
    message = rf"^argument probe={probe!r} is not allowed: expected 'auto' \(NVML on the model's CUDA device\), None"
    with pytest.raises(SettingsError, match=message):
        AutoOffloadCallback(probe=probe)
    from autooffload import OffloadController

    with pytest.raises(SettingsError, match=message):
        OffloadController(probe=probe)


@pytest.mark.parametrize("policy", [5, object(), "oracle"])
def test_a_policy_that_is_not_one_is_refused_at_construction(policy):
    message = "^argument policy=.* is not allowed: expected one of"
    message = "policy='oracle' is not allowed" if policy == "oracle" else message
    with pytest.raises(SettingsError, match=message):
        AutoOffloadCallback(policy=policy, probe=None)


@pytest.mark.parametrize(
    ("value", "mode"),
    [(True, "on"), (False, "off"), ("auto", "auto"), ("AUTO", "auto"), ("false", "off"), ("true", "on"), (None, None)],
)
def test_offload_kwarg_values(value, mode):
    assert offload_mode(value) == mode


@pytest.mark.parametrize("value", ["maybe", 2, 0.5])
def test_offload_kwarg_rejects_other_values(value):
    with pytest.raises(SettingsError, match="offload="):
        offload_mode(value)


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("AUTOOFFLOAD_SEQ_HIGH", "\u0661\u0662"),  # Arabic-Indic digits: int() reads 12
        ("AUTOOFFLOAD_SEQ_HIGH", "\uff11\uff12"),  # full-width digits: int() reads 12
        ("AUTOOFFLOAD_SEQ_HIGH", "1_000"),
        ("AUTOOFFLOAD_MIN_STEPS", "+1"),
        ("AUTOOFFLOAD_MEMORY_HIGH", "9e-1"),
        ("AUTOOFFLOAD_MEMORY_HIGH", "0_9"),
        ("AUTOOFFLOAD_MEMORY_LOW", "\uff10.5"),
        ("AUTOOFFLOAD_MEMORY_HIGH", "inf"),
    ],
)
def test_numbers_are_read_only_in_their_documented_form(name, raw):
    """Integers are ASCII digits and fractions decimals: int() and float() accept other scripts' digits,
    underscores and a sign, which the README never promised (issue 31)."""
    with pytest.raises(SettingsError, match=rf"{name}=.* is not (an integer|a number): write it in "):
        Settings.from_env({name: raw})


def test_a_host_memory_size_beyond_any_machine_is_refused():
    with pytest.raises(SettingsError, match=r"AUTOOFFLOAD_HOST_MEMORY=.* is not allowed"):
        Settings.from_env({"AUTOOFFLOAD_HOST_MEMORY": "9" * 400 + "GiB"})
    assert Settings(host_memory="4096GiB").host_memory == "4096GiB"


def test_a_negative_zero_is_not_a_documented_zero():
    with pytest.raises(SettingsError, match=r"AUTOOFFLOAD_MEMORY_LOW=-0 is not allowed: expected a fraction in"):
        Settings.from_env({"AUTOOFFLOAD_MEMORY_LOW": "-0"})
    with pytest.raises(SettingsError, match=r"AUTOOFFLOAD_SEQ_LOW=-0 is not allowed: expected an integer >= 0"):
        Settings.from_env({"AUTOOFFLOAD_SEQ_LOW": "-0"})
    env = {"AUTOOFFLOAD_MEMORY_LOW": " 0 ", "AUTOOFFLOAD_SEQ_LOW": "00", "AUTOOFFLOAD_MEMORY_HIGH": ".9"}
    s = Settings.from_env(env)
    assert (s.memory_low, s.seq_low, s.memory_high) == (0.0, 0, 0.9)
    assert str(s.memory_low) == "0.0"


@pytest.mark.parametrize(
    ("env", "arguments"),
    [
        ({"AUTOOFFLOAD_SEQ_HIGH": "9" * 100_000 + "x"}, {}),
        ({"AUTOOFFLOAD_SEQ_HIGH": "9" * 100_000}, {}),
        ({"AUTOOFFLOAD_MODE": "x" * 100_000}, {}),
        ({"AUTOOFFLOAD_RESCUE": "y" * 100_000}, {}),
        ({"AUTOOFFLOAD_NOPE": "z" * 100_000}, {}),
        ({}, {"mode": "m" * 100_000}),
        ({}, {"host_memory": "1" * 100_000 + "XiB"}),
    ],
)
def test_a_long_bad_value_is_shortened_in_the_error(env, arguments):
    with pytest.raises(SettingsError) as error:
        Settings.from_env(env, **arguments)
    message = str(error.value)
    assert len(message) < 600 and "characters)" in message, message[:300]


@pytest.mark.parametrize(
    ("arguments", "env", "message"),
    [
        ({"memory_high": 0}, {}, r"^argument memory_high=0 is not allowed: expected a fraction in \(0, 1\]"),
        ({}, {"AUTOOFFLOAD_MEMORY_HIGH": "0"}, r"^AUTOOFFLOAD_MEMORY_HIGH=0\.0 is not allowed: expected a fraction in"),
        ({"seq_low": -1}, {}, r"^argument seq_low=-1 is not allowed: expected an integer >= 0"),
        ({}, {"AUTOOFFLOAD_SEQ_LOW": "-1"}, r"^AUTOOFFLOAD_SEQ_LOW=-1 is not allowed: expected an integer >= 0"),
        ({"compile_max_switches": -1}, {}, r"^argument compile_max_switches=-1 is not allowed: expected an integer"),
        ({}, {"AUTOOFFLOAD_COMPILE_MAX_SWITCHES": "-1"}, r"^AUTOOFFLOAD_COMPILE_MAX_SWITCHES=-1 is not allowed"),
        ({"keep_margin": 0.6}, {}, r"^argument keep_margin=0\.6 is not allowed: expected a fraction in \[0, 0\.5\]"),
        ({}, {"AUTOOFFLOAD_KEEP_MARGIN": "-0.01"}, r"^AUTOOFFLOAD_KEEP_MARGIN=-0\.01 is not allowed: expected a"),
    ],
)
def test_each_documented_bound_is_refused_from_every_source(monkeypatch, arguments, env, message):
    """The README's table: memory_high in (0, 1], seq_low and compile_max_switches >= 0. A memory_high of 0 would
    offload every step; a negative seq_low would never let hysteresis turn offload off."""
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env, **arguments)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=message):
        AutoOffloadCallback(probe=None, **arguments)


def test_a_keep_margin_at_or_above_memory_high_is_refused_naming_both():
    """Review: keep plans under memory_high less keep_margin; a margin at or above memory_high was accepted and nothing
    ever kept, without a word."""
    with pytest.raises(SettingsError, match=r"^argument keep_margin=0\.4 is not below argument memory_high=0\.3: keep"):
        Settings.from_env({}, memory_high=0.3, keep_margin=0.4)
    with pytest.raises(SettingsError, match=r"^AUTOOFFLOAD_KEEP_MARGIN=0\.5 is not below argument memory_high=0\.5"):
        Settings.from_env({"AUTOOFFLOAD_KEEP_MARGIN": "0.5"}, memory_high=0.5)
    with pytest.raises(SettingsError, match=r"keep_margin=0\.3 is not below"):
        Settings(memory_high=0.2, memory_low=0.1, keep_margin=0.3)


def test_the_bounds_themselves_are_allowed():
    s = Settings(memory_high=1.0, memory_low=0.0, seq_low=0, compile_max_switches=0, min_steps=0)
    assert (s.memory_high, s.memory_low, s.seq_low, s.compile_max_switches, s.min_steps) == (1.0, 0.0, 0, 0, 0)
    assert Settings(keep_margin=0.0).keep_margin == 0.0 and Settings(keep_margin=0.5).keep_margin == 0.5
    assert Settings.from_env({"AUTOOFFLOAD_KEEP_MARGIN": "0.02"}).keep_margin == 0.02


def test_a_low_threshold_set_to_the_value_it_would_follow_is_still_set():
    assert resolve(Settings(seq_high=8192, seq_low=4096), seq_high=65536).seq_low == 4096
    assert resolve(Settings(memory_high=0.7), memory_high=0.95).memory_low == 0.85


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"memory_high": "0.9"}, r"^argument memory_high='0\.9' is a string, not a number \(expected a fraction in"),
        ({"seq_high": "8192"}, r"^argument seq_high='8192' is a string, not an integer"),
        ({"seq_high": 8192.0}, r"^argument seq_high=8192\.0 is a float, not an integer"),
        ({"rescue": "yes"}, r"^argument rescue='yes' is a string, not a boolean"),
        ({"mode": 1}, r"^argument mode=1 is an integer, not a string"),
        ({"memory_high": float("nan")}, r"^argument memory_high=nan is not a finite number"),
    ],
)
def test_a_value_of_the_wrong_type_is_named_as_such(arguments, message):
    """Issue 54: ``memory_high='0.9'`` (a string, from a quoted YAML value) said "not in (0, 1]"."""
    with pytest.raises(SettingsError, match=message):
        Settings.from_env({}, **arguments)
    with pytest.raises(SettingsError, match=message):
        Settings(**arguments)
