"""The hysteresis policy with plain numbers: no torch, no clock."""

from autooffload.decide.policy import HysteresisPolicy, Observation
from autooffload.settings import Settings


def run(policy, readings, seqs=None, layers=8):
    seqs = seqs or [128] * len(readings)
    return [
        policy.decide(Observation(step, seq, seq, memory, layers))
        for step, (memory, seq) in enumerate(zip(readings, seqs, strict=True))
    ]


def test_memory_curve_switches_on_at_high_and_off_below_low():
    policy = HysteresisPolicy(memory_high=0.9, memory_low=0.8, seq_high=10_000, seq_low=5_000, min_steps=0)
    curve = [0.5, 0.85, 0.90, 0.95, 0.85, 0.81, 0.79, 0.85, 0.89]
    assert run(policy, curve) == [0, 0, 8, 8, 8, 8, 0, 0, 0]


def test_from_settings_takes_each_threshold_where_it_belongs():
    settings = Settings(memory_high=0.9, memory_low=0.8, seq_high=1000, seq_low=500, min_steps=1)
    policy = HysteresisPolicy.from_settings(settings)
    thresholds = (policy.memory_high, policy.memory_low, policy.seq_high, policy.seq_low, policy.min_steps)
    assert thresholds == (0.9, 0.8, 1000, 500, 1)
    # Memory: on at 0.9, held at 0.85, off below 0.8 after the dwell; length: on at 1000, held at 700, off below 500.
    assert run(policy, [0.5, 0.9, 0.85, 0.79, 0.79], [100] * 5) == [0, 8, 8, 0, 0]
    assert run(HysteresisPolicy.from_settings(settings), [None] * 5, [100, 1000, 700, 499, 499]) == [0, 8, 8, 0, 0]


def test_dwell_delays_switching_off_but_never_switching_on():
    policy = HysteresisPolicy(memory_high=0.9, memory_low=0.8, seq_high=10_000, seq_low=5_000, min_steps=3)
    curve = [0.95, 0.5, 0.5, 0.5, 0.5, 0.95]
    assert run(policy, curve) == [8, 8, 8, 0, 0, 8]


def test_sequence_trigger_with_hysteresis():
    policy = HysteresisPolicy(memory_high=0.9, memory_low=0.8, seq_high=1000, seq_low=500, min_steps=0)
    seqs = [100, 1000, 700, 499, 999, 1200]
    assert run(policy, [None] * 6, seqs) == [0, 8, 8, 0, 0, 8]


def test_off_needs_both_signals_calm():
    policy = HysteresisPolicy(memory_high=0.9, memory_low=0.8, seq_high=1000, seq_low=500, min_steps=0)
    assert run(policy, [0.95, 0.5, 0.5], [100, 800, 100]) == [8, 8, 0]


def test_state_round_trip():
    policy = HysteresisPolicy(min_steps=5)
    run(policy, [0.95])
    clone = HysteresisPolicy(min_steps=5)
    clone.load_state_dict(policy.state_dict())
    assert clone.decide(Observation(3, 1, 1, 0.1, 8)) == 8
    assert clone.decide(Observation(5, 1, 1, 0.1, 8)) == 0


def test_a_constant_load_does_not_flap_with_its_own_offload():
    # Every step needs 95% of the device without offload and 70% with every layer offloaded. Compared with the
    # reading after offload (70% < memory_low), the policy would switch off after its dwell, then on again.
    total, layers = 80 * 2**30, 8
    per_layer = round(0.25 * total / layers)
    policy = HysteresisPolicy(memory_high=0.9, memory_low=0.8, seq_high=10**6, seq_low=10**5, min_steps=2)
    levels, reading = [], None
    for step in range(10):
        observation = Observation(
            step,
            2048,
            2048,
            None if reading is None else reading / total,
            layers,
            memory_bytes=reading,
            total_bytes=total,
            bytes_per_layer=per_layer,
        )
        levels.append(policy.decide(observation))
        reading = round(0.95 * total) - levels[-1] * per_layer
    assert levels == [0] + [layers] * 9
