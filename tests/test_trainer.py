"""The controller through the real Trainer on a tiny random Qwen3: bytes, switching steps, equal results."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import LAYERS, NEW_NAMES, dataset, expected_bytes, model, train, training_args
from transformers import TrainerCallback

from autooffload import AutoOffloadCallback, AutoOffloadWarning, ScriptedProbe


class StepRecorder(TrainerCallback):
    """Records, after every optimizer step, what the controller did in it."""

    def __init__(self, callback: AutoOffloadCallback) -> None:
        self.controller = callback.controller
        self.rows: list[tuple[int, float, int]] = []

    def on_step_end(self, args, state, control, **kwargs):
        c = self.controller
        self.rows.append((c.sizes.batch.seq_len, c.record.active, c.last_step_bytes))


def run_with(tmp_path, lengths, callback, **kwargs):
    recorder = StepRecorder(callback)
    trainer, net = train(tmp_path, lengths, callbacks=[callback, recorder], **kwargs)
    return trainer, net, recorder.rows


def test_bytes_offloaded_equal_the_arithmetic(tmp_path):
    callback = AutoOffloadCallback(mode="on", probe=None)
    _, _, rows = run_with(tmp_path, [64, 128, 96], callback)
    assert [moved for *_, moved in rows] == [expected_bytes(64), expected_bytes(128), expected_bytes(96)]
    assert callback.controller.stats.total_bytes == expected_bytes(64 + 128 + 96)


def test_bytes_with_batches_and_every_n_layers(tmp_path):
    callback = AutoOffloadCallback(mode="on", probe=None)
    recorder = StepRecorder(callback)
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    args = training_args(tmp_path, 2, checkpointing=False, per_device_train_batch_size=2)
    from conftest import InOrderTrainer

    InOrderTrainer(model=net, args=args, train_dataset=dataset([80] * 4), callbacks=[callback, recorder]).train()
    assert [moved for *_, moved in recorder.rows] == [expected_bytes(80, batch=2)] * 2


def test_sequence_trigger_switches_on_the_right_micro_batches(tmp_path):
    lengths = [64, 256, 64, 64, 64, 200, 64, 256, 150, 64]
    callback = AutoOffloadCallback(seq_high=200, seq_low=128, min_steps=2, probe=None)
    _, _, rows = run_with(tmp_path, lengths, callback)
    # on at 256 (step 1); off at step 3 once two steps have passed; on at 200 (step 5); the 256 at step 7
    # keeps it on; 150 is between the thresholds so it holds; off at step 9 (dwell since step 5 passed).
    expected_on = [False, True, True, False, False, True, True, True, True, False]
    assert [active == 1.0 for _, active, _ in rows] == expected_on
    assert [moved for *_, moved in rows] == [
        expected_bytes(s) if on else 0 for s, on in zip(lengths, expected_on, strict=True)
    ]
    assert callback.controller.record.switches == 4


def test_decision_is_per_micro_batch_with_gradient_accumulation(tmp_path):
    callback = AutoOffloadCallback(seq_high=200, seq_low=128, min_steps=1, probe=None)
    decisions = []
    original = callback.controller.before_forward

    def spy(seq_len, tokens, *lengths):
        level = original(seq_len, tokens, *lengths)
        decisions.append((seq_len, level))
        return level

    callback.controller.before_forward = spy
    run_with(tmp_path, [64, 256, 64, 64, 64, 256], callback, steps=3, gradient_accumulation_steps=2)
    # A long micro-batch offloads in its own forward, even as the second of its step; the next step is past
    # the one-step dwell and runs plain again.
    assert decisions == [(64, 0), (256, LAYERS), (64, 0), (64, 0), (64, 0), (256, LAYERS)]


def test_memory_curve_switches_on_and_off_on_the_right_steps(tmp_path):
    curve = [0.50, 0.70, 0.91, 0.95, 0.85, 0.82, 0.79, 0.60, 0.92, 0.50]
    callback = AutoOffloadCallback(min_steps=2, probe=ScriptedProbe(curve), policy="hysteresis")
    _, _, rows = run_with(tmp_path, [64] * 11, callback)
    # A reading at the end of step n decides step n + 1: on after 0.91 (step 2) -> steps 3..6; off after 0.79
    # (step 6, dwell since step 3 passed) -> step 7 plain; on again after 0.92 (step 8) -> step 9, and the
    # 0.50 after it cannot switch it off at step 10: the dwell (2 steps) has not passed.
    on = [active == 1.0 for _, active, _ in rows]
    assert on == [False, False, False, True, True, True, True, False, False, True, True]
    assert callback.controller.memory_fraction == pytest.approx(0.50)


@pytest.mark.parametrize("mode", ["on", "off", "auto"])
def test_losses_and_parameters_bit_identical(tmp_path, mode):
    lengths = [64, 256, 64, 128]
    reference_trainer, reference = train(tmp_path / "plain", lengths, offload=None)
    callback = AutoOffloadCallback(mode=mode, seq_high=200, seq_low=100, min_steps=0, probe=None)
    trainer, net = train(tmp_path / mode, lengths, callbacks=[callback])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses == [h["loss"] for h in reference_trainer.state.log_history if "loss" in h]
    for (name, a), (_, b) in zip(net.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert (callback.controller.stats.total_bytes > 0) == (mode != "off")


def test_log_keys_reach_log_history_and_reporting_callbacks(tmp_path):
    class Reporter(TrainerCallback):  # stands where TensorBoard and W&B stand: before user callbacks
        def __init__(self):
            self.seen = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append(dict(logs))

    reporter = Reporter()
    callback = AutoOffloadCallback(mode="on", probe=ScriptedProbe([0.5, 0.6]))
    trainer, _ = train(tmp_path, [64, 128], callbacks=[reporter, callback])
    keys = {"autooffload/active", "autooffload/offloaded_bytes", "autooffload/memory_fraction", "autooffload/switches"}
    training_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(training_logs) == 2 and all(keys <= h.keys() for h in training_logs)
    assert [h["autooffload/offloaded_bytes"] for h in training_logs] == [expected_bytes(64), expected_bytes(128)]
    assert [h["autooffload/memory_fraction"] for h in training_logs] == pytest.approx([0.5, 0.6])
    assert [r["autooffload/active"] for r in reporter.seen if "loss" in r] == [1.0, 1.0]


def test_a_mock_over_trainer_log_is_called_with_the_keys_and_trainers_log_still_runs(tmp_path):
    """A test that captures a run's logs patches ``trainer.log`` with a ``MagicMock`` calling the real one. A mock
    answers every attribute: it must not be taken for autooffload's own log wrapper (whose inner log would then be
    one of the mock's children, called instead of the mock and of Trainer's log: no loss in the history)."""
    import unittest.mock

    from conftest import InOrderTrainer

    callback = AutoOffloadCallback(mode="on", probe=None)
    args = training_args(tmp_path, 2)
    trainer = InOrderTrainer(model=model(), args=args, train_dataset=dataset([64, 128]), callbacks=[callback])
    with unittest.mock.patch.object(trainer, "log", side_effect=trainer.log) as log:
        trainer.train()
    training_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["autooffload/offloaded_bytes"] for h in training_logs] == [expected_bytes(64), expected_bytes(128)]
    assert [call.args[0]["autooffload/active"] for call in log.call_args_list if "loss" in call.args[0]] == [1.0] * 2


def test_a_failure_reading_the_metrics_lets_the_log_go_out_without_our_keys(tmp_path):
    """Issue 49, 1.3: the wrapper of ``Trainer.log`` was not guarded: ``controller.metrics()`` raising ended
    ``trainer.train()``. Now every log goes out without autooffload's keys, with one warning, and the run ends with
    plain checkpointing's losses and parameters."""
    lengths = [64, 128, 64]
    reference_trainer, reference = train(tmp_path / "plain", lengths, offload=None)
    callback = AutoOffloadCallback(mode="on", probe=None)

    def metrics():
        raise RuntimeError("injected in metrics")

    callback.controller.metrics = metrics
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoOffloadWarning)
        trainer, net = train(tmp_path / "failing", lengths, callbacks=[callback])
    ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert len(ours) == 1 and "internal error in the Trainer's log (RuntimeError: injected in metrics)" in ours[0]
    training_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(training_logs) == len(lengths)
    assert not [key for h in trainer.state.log_history for key in h if key.startswith("autooffload/")]
    assert [h["loss"] for h in training_logs] == [h["loss"] for h in reference_trainer.state.log_history if "loss" in h]
    for (name, a), (_, b) in zip(net.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_no_memory_reading_gives_one_warning_and_a_working_run(tmp_path):
    callback = AutoOffloadCallback(seq_high=200, seq_low=100)  # probe "auto": NVML, absent on this machine
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, rows = run_with(tmp_path, [64, 256, 64], callback)
    ours = [w for w in caught if issubclass(w.category, AutoOffloadWarning)]
    assert len(ours) == 1 and "no device memory reading" in str(ours[0].message)
    assert [active for _, active, _ in rows] == [0.0, 1.0, 1.0]


def test_failing_probe_mid_run_warns_once_and_training_goes_on(tmp_path):
    class Flaky:
        def __init__(self):
            self.calls = 0

        def read(self):
            self.calls += 1
            if self.calls >= 2:
                raise RuntimeError("NVML: GPU is lost")
            return None

    callback = AutoOffloadCallback(probe=Flaky())
    with pytest.warns(AutoOffloadWarning, match="memory reading failed"):
        trainer, _ = train(tmp_path, [64] * 4, callbacks=[callback])
    assert trainer.state.global_step == 4 and callback.controller.memory.probe is None


def test_nothing_checkpointed_warns_with_the_way_to_enable_it(tmp_path):
    callback = AutoOffloadCallback(probe=None)
    net = model()
    args = training_args(tmp_path, 2, checkpointing=False)
    from conftest import InOrderTrainer

    with pytest.warns(AutoOffloadWarning, match="no checkpointed layers found.*checkpointing=True"):
        InOrderTrainer(model=net, args=args, train_dataset=dataset([64, 64]), callbacks=[callback]).train()


def test_a_raising_policy_falls_back_to_plain_checkpointing(tmp_path):
    class Broken:
        def decide(self, observation):
            raise ZeroDivisionError("oops")

    callback = AutoOffloadCallback(policy=Broken(), probe=None)
    with pytest.warns(AutoOffloadWarning, match="policy Broken raised"):
        _, _, rows = run_with(tmp_path, [64, 256], callback)
    assert [active for _, active, _ in rows] == [0.0, 0.0]


def test_summary_is_logged_at_the_end(tmp_path):
    import logging

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    collect = Collect()
    callback = AutoOffloadCallback(mode="on", probe=None)
    logger = logging.getLogger("transformers.autooffload")
    logger.addHandler(collect)
    logger.setLevel(logging.INFO)
    try:
        train(tmp_path, [64, 64], callbacks=[callback])
    finally:
        logger.removeHandler(collect)
        logger.setLevel(logging.NOTSET)
    summary = [m for m in collect.messages if "step(s)" in m]
    assert summary == ["autooffload: mode=on, 2 step(s), offload in 2 (100%), 0 switch(es), 0.1 MiB moved to host"]


@pytest.mark.skipif(not NEW_NAMES, reason="activation_checkpointing_* names arrived in transformers 5.23")
def test_both_kwarg_names_carry_auto(tmp_path):
    from conftest import InOrderTrainer
    from transformers import TrainingArguments

    for name in ("activation_checkpointing", "gradient_checkpointing"):
        callback = AutoOffloadCallback(seq_high=200, seq_low=100, probe=None)
        recorder = StepRecorder(callback)
        args = TrainingArguments(
            output_dir=str(tmp_path / name),
            per_device_train_batch_size=1,
            max_steps=2,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            **{name: True, f"{name}_kwargs": {"offload": "auto"}},
        )
        InOrderTrainer(
            model=model(), args=args, train_dataset=dataset([64, 256]), callbacks=[callback, recorder]
        ).train()
        assert callback.controller.settings.mode == "auto"
        assert [moved for *_, moved in recorder.rows] == [0, expected_bytes(256)], name


@pytest.mark.parametrize(
    ("offload", "mode", "moved"), [(True, "on", True), (False, "off", False), ("auto", "auto", False)]
)
def test_offload_kwarg_sets_the_mode(tmp_path, offload, mode, moved):
    callback = AutoOffloadCallback(probe=None, seq_high=10_000, seq_low=100)
    train(tmp_path, [64, 64], callbacks=[callback], offload=offload)
    assert callback.controller.settings.mode == mode
    assert (callback.controller.stats.total_bytes > 0) == moved


def test_environment_mode_overrides_the_kwarg_and_arguments_override_both(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_MODE", "off")
    callback = AutoOffloadCallback(probe=None)
    train(tmp_path / "env", [64], callbacks=[callback], offload=True)
    assert callback.controller.settings.mode == "off"
    callback = AutoOffloadCallback(mode="on", probe=None)
    train(tmp_path / "arg", [64], callbacks=[callback], offload=False)
    assert callback.controller.settings.mode == "on"


def native_offload_runs() -> bool:
    """Whether torch's ``save_on_cpu(pin_memory=True)`` runs here as transformers' native offload calls it (the
    device type of the current accelerator, else cpu). Not on a CPU-only build: torch.cpu is available and
    cannot pin. Yes on a CUDA build without a GPU: torch.cuda is not available, so nothing is pinned."""
    try:
        current = torch.accelerator.current_accelerator()
    except RuntimeError:  # torch 2.6 raises where later releases return None
        current = None
    x = torch.ones(2, requires_grad=True)
    try:
        with torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=(current or torch.device("cpu")).type):
            (x * x).sum().backward()
    except RuntimeError:
        return False
    return True


def test_without_the_callback_auto_is_not_autooffloads_business(tmp_path):
    # What the callback repairs. Before 5.17 the bare kwarg reaches torch's checkpoint and fails. From 5.17
    # any truthy value is transformers' own always-on offload, save_on_cpu with pinned memory: it fails where
    # that cannot run on this torch build, and otherwise trains with transformers' function on every layer.
    import transformers
    from packaging.version import Version

    from autooffload.observe.paths import describe

    native_offload = Version(transformers.__version__) >= Version("5.17")
    if not (native_offload and native_offload_runs()):
        with pytest.raises((ValueError, RuntimeError), match=r"offload|pin_memory|pinned"):
            train(tmp_path, [64], offload="auto")
        return
    _, net = train(tmp_path, [64], offload="auto")
    functions = {describe(layer._gradient_checkpointing_func) for layer in net.model.layers}
    assert len(functions) == 1 and functions.pop().startswith("transformers.")


def test_bad_offload_kwarg_fails_before_training(tmp_path):
    from conftest import InOrderTrainer

    from autooffload import SettingsError

    args = training_args(tmp_path, 1, offload="sometimes")
    with pytest.raises(SettingsError, match="offload='sometimes' is not one of True, False, 'auto'"):
        InOrderTrainer(model=model(), args=args, train_dataset=dataset([64]), callbacks=[AutoOffloadCallback()])


class ForwardProbe:
    """A probe whose reading is the longest forward (training or evaluation) since its last reset, 1000 bytes
    per token: evaluation's long batches show in it unless the step's peak starts at the step's start."""

    def __init__(self, net):
        self.longest, self.readings = 0, []
        net.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        self.longest = max(self.longest, kwargs["input_ids"].shape[-1])

    def reset(self):
        self.longest = 0

    def read(self):
        from autooffload import MemoryReading

        self.readings.append(self.longest * 1000)
        self.longest = 0
        return MemoryReading(self.readings[-1], 10**9)


def test_evaluation_and_saving_stay_out_of_the_next_steps_reading(tmp_path):
    from conftest import InOrderTrainer

    from autooffload import PredictivePolicy

    net = model()
    probe = ForwardProbe(net)
    seen = []

    class Recording(PredictivePolicy):
        def decide(self, observation):
            seen.append(observation)
            return super().decide(observation)

    callback = AutoOffloadCallback(probe=probe, policy=Recording())
    args = training_args(
        tmp_path,
        7,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=3,
        per_device_eval_batch_size=1,
    )
    trainer = InOrderTrainer(
        model=net, args=args, train_dataset=dataset([64] * 7), eval_dataset=dataset([512] * 2), callbacks=[callback]
    )
    trainer.train()
    # Every step's peak starts at the step's start: evaluation's 512-token batches never reach a reading.
    assert probe.readings == [64_000] * 7
    # Evaluations after steps 2 and 4, saves after 3 (Trainer's count), all before the next step's reset: every
    # reading is a sample of training.
    assert [o.last_step_clean for o in seen] == [True] * 7
    assert len(callback.controller.policy.samples) == 6


class RisingProbe:
    """A device at 50% in the first step and 95% after, with a ``reset()`` (as NvmlProbe has): what ran before a
    reset is out of the next reading."""

    def __init__(self):
        self.reads = 0

    def reset(self):
        pass

    def read(self):
        from autooffload import MemoryReading

        self.reads += 1
        return MemoryReading((50 if self.reads == 1 else 95) * 10**10, 10**12)


def test_saving_every_step_still_lets_the_reading_decide(tmp_path):
    # The probe's reset at the step's start already keeps the save out of the step's reading, so the step after
    # a save is a sample like any other: with a save after every step the memory signal must still switch on.
    callback = AutoOffloadCallback(probe=RisingProbe(), min_steps=1)
    _, _, rows = run_with(tmp_path, [64] * 4, callback, save_strategy="steps", save_steps=1)
    assert [active for _, active, _ in rows] == [0.0, 0.0, 1.0, 1.0]
