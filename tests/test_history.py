"""The per-step history through the real Trainer: it agrees with the logs and the arithmetic, a resumed run
appends to it, a custom loop writes it, and ``autooffload plot`` draws it or fails with one line."""

from __future__ import annotations

import itertools
import json
import logging
import sys

import pytest
from conftest import HIDDEN, LAYERS, InOrderTrainer, dataset, model, train, training_args

from autooffload import AutoOffloadCallback, AutoOffloadWarning, OffloadController, ScriptedProbe, Settings
from autooffload.__main__ import main as cli
from autooffload.history import REASONS, history_path, read_history

# Two micro-batches per step (gradient accumulation 2); the memory reading of step n decides step n + 1.
MICRO_BATCHES = [64, 64, 64, 256, 64, 64, 64, 64, 150, 64]
CURVE = [0.5, 0.6, 0.95, 0.7, 0.5]


@pytest.fixture(scope="module")
def hysteresis_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("history")
    callback = AutoOffloadCallback(
        seq_high=200, seq_low=128, min_steps=1, probe=ScriptedProbe(CURVE), policy="hysteresis"
    )
    trainer, _ = train(out, MICRO_BATCHES, callbacks=[callback], steps=5, gradient_accumulation_steps=2)
    return trainer, callback, out


def test_history_equals_the_logs_and_the_arithmetic_step_by_step(hysteresis_run):
    trainer, callback, out = hysteresis_run
    path = out / "autooffload" / "history.jsonl"
    assert callback.history_path == path and callback.controller.history == []  # all flushed
    records = read_history(path)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [r["step"] for r in records] == [h["step"] for h in logs] == [1, 2, 3, 4, 5]
    assert [r["seq_lens"] for r in records] == [MICRO_BATCHES[i : i + 2] for i in range(0, 10, 2)]
    # Step 2: the 256 turns it on; step 3: off once calm (dwell 1); after the 0.95 reading of step 3, on for
    # step 4; step 5: the 150 holds it (above seq_low), the 64 after it turns it off.
    assert [r["offloaded"] for r in records] == [[0, 0], [0, 4], [0, 0], [4, 4], [4, 0]]
    assert [r["reasons"] for r in records] == [
        ["below_high", "below_high"],
        ["below_high", "seq_high"],
        ["below_low", "below_high"],
        ["memory_high", "memory_high"],
        ["above_low", "below_low"],
    ]
    for record, log in zip(records, logs, strict=True):
        arithmetic = sum(k * t * HIDDEN * 4 for k, t in zip(record["offloaded"], record["tokens"], strict=True))
        assert record["bytes_moved"] == log["autooffload/offloaded_bytes"] == arithmetic
        assert record["memory_fraction"] == pytest.approx(log["autooffload/memory_fraction"])
        assert record["offloaded"][-1] / LAYERS == log["autooffload/active"]
        assert record["kept"] is None and record["keep_margin"] is None  # recompute="always": nothing keeps
        assert record["rescued"] is False and record["predicted_peak_bytes"] is None
    assert [r["memory_fraction"] for r in records] == pytest.approx(CURVE)
    assert list(itertools.accumulate(r["switches"] for r in records)) == [h["autooffload/switches"] for h in logs]
    settings = {"layers": LAYERS, "mode": "auto", "seq_high": 200, "seq_low": 128}
    settings |= {"memory_high": 0.9, "memory_low": 0.8}
    assert all({key: r[key] for key in settings} == settings for r in records)  # the plot's threshold lines
    assert {reason for r in records for reason in r["reasons"]} <= REASONS.keys()


def test_predicted_peak_and_reasons_of_the_predictive_and_of_a_users_policy(tmp_path):
    callback = AutoOffloadCallback(seq_high=200, seq_low=128, probe=ScriptedProbe([0.5, 0.6, 0.7]))
    train(tmp_path / "predictive", [64, 96, 128], callbacks=[callback])
    records = read_history(tmp_path / "predictive" / "autooffload" / "history.jsonl")
    # Step 1 has no reading yet: the hysteresis fallback decides and nothing is predicted; then the fit
    # predicts at least the last reading (an upper line of what was seen), far under memory_high.
    assert [r["reasons"] for r in records] == [["below_high"], ["predicted_fits"], ["predicted_fits"]]
    assert records[0]["predicted_peak_bytes"] is None
    for before, record in itertools.pairwise(records):
        assert before["memory_bytes"] <= record["predicted_peak_bytes"] < 0.9 * record["total_bytes"]

    class Mine:  # a user's policy: no last_reason, and a predict with another signature
        def decide(self, observation):
            return observation.layers if observation.seq_len > 100 else 0

        def predict(self):
            raise AssertionError("never called with this signature")

    callback = AutoOffloadCallback(policy=Mine(), probe=None)
    train(tmp_path / "mine", [64, 128], callbacks=[callback])
    records = read_history(tmp_path / "mine" / "autooffload" / "history.jsonl")
    assert [(r["offloaded"], r["reasons"], r["predicted_peak_bytes"]) for r in records] == [
        ([0], ["policy"], None),
        ([4], ["policy"], None),
    ]


def test_resume_appends_after_the_checkpoint_and_drops_the_steps_past_it(tmp_path):
    lengths = [64, 256, 64, 64, 64]

    def callback():
        return AutoOffloadCallback(seq_high=200, seq_low=100, min_steps=4, probe=None, policy="hysteresis")

    args = training_args(tmp_path, 5, save_strategy="steps", save_steps=3)
    InOrderTrainer(model=model(), args=args, train_dataset=dataset(lengths), callbacks=[callback()]).train()
    path = tmp_path / "autooffload" / "history.jsonl"
    first = path.read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in first] == [1, 2, 3, 4, 5]
    path.write_text("".join(first) + '{"step": 6, "seq_l')  # and a line cut short by a crash

    args = training_args(tmp_path, 5, save_strategy="no")
    trainer = InOrderTrainer(model=model(), args=args, train_dataset=dataset(lengths), callbacks=[callback()])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    again = path.read_text().splitlines(keepends=True)
    assert again[:3] == first[:3]  # appended, not overwritten
    records = [json.loads(line) for line in again]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    # The resumed controller is still inside the 4-step dwell of the switch at step 2.
    assert [(r["offloaded"], r["reasons"]) for r in records[3:]] == [([4], ["dwell"]), ([4], ["dwell"])]


def test_a_custom_loop_writes_its_history_and_unwritten_records_are_bounded(tmp_path):
    net = model()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    controller = OffloadController(Settings(mode="on"), probe=None)
    assert controller.attach(net)
    path = tmp_path / "h.jsonl"
    for written, seq in enumerate([32, 48], start=1):
        ids = dataset([seq])[0]["input_ids"][None]
        net(input_ids=ids, labels=ids).loss.backward()
        controller.end_step()
        assert len(controller.history) == 1
        assert controller.write_history(path) == 1 and controller.history == []
        assert len(path.read_text().splitlines()) == written
    assert [(r["step"], r["reasons"], r["bytes_moved"]) for r in read_history(path)] == [
        (1, ["mode_on"], LAYERS * 32 * HIDDEN * 4),
        (2, ["mode_on"], LAYERS * 48 * HIDDEN * 4),
    ]
    controller.record.history.limit = 2
    with pytest.warns(AutoOffloadWarning, match="oldest are dropped"):
        for _ in range(3):
            controller.end_step()
    assert [r.step for r in controller.history] == [4, 5]


def test_one_file_per_rank_when_there_are_many():
    assert history_path("out").as_posix() == "out/autooffload/history.jsonl"
    assert history_path("out", 0, 2).as_posix() == "out/autooffload/history-rank0.jsonl"
    assert history_path("out", 3, 4).as_posix() == "out/autooffload/history-rank3.jsonl"


def test_plot_writes_a_png_of_a_real_history(hysteresis_run, tmp_path, capsys):
    _, _, out = hysteresis_run
    assert cli(["plot", str(out), "--out", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "5 step(s)" in capsys.readouterr().out
    assert cli(["plot", str(out / "autooffload" / "history.jsonl")]) == 0  # default: next to the file
    assert (out / "autooffload" / "history.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no history file at"),
        ("", "holds no records"),
        ('{"step": 1, "seq_lens": [64]\n', "line 1: not JSON"),
        ('{"loss": 2.5}\n', "line 1: not a step record"),
    ],
    ids=["missing", "empty", "garbled", "not-a-record"],
)
def test_plot_of_a_bad_file_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "history.jsonl"
    if content is not None:
        path.write_text(content)
    assert cli(["plot", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "history.png").exists()


def test_plot_without_matplotlib_names_the_extra(hysteresis_run, tmp_path, capsys, monkeypatch):
    _, _, out = hysteresis_run
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli(["plot", str(out), "--out", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert err == "autooffload plot: error: matplotlib is needed to plot: pip install autooffload[plot]\n"
    assert not (tmp_path / "t.png").exists()


def test_the_switch_line_numbers_steps_as_the_history_does(tmp_path, caplog):
    callback = AutoOffloadCallback(seq_high=200, seq_low=100, min_steps=1, probe=None, policy="hysteresis")
    with caplog.at_level(logging.INFO, logger="transformers.autooffload"):
        train(tmp_path, [64, 256, 64], callbacks=[callback])
    records = read_history(history_path(tmp_path))
    assert [r["step"] for r in records if r["switches"]] == [2, 3]
    assert [r.getMessage() for r in caplog.records if " -> " in r.getMessage()] == [
        "autooffload: step 2, seq 256: offload 0 -> 4 of 4 layer(s): sequence length >= seq_high (seq_high)",
        "autooffload: step 3, seq 64: offload 4 -> 0 of 4 layer(s): both signals below their low thresholds and the "
        "dwell passed: off (below_low)",
    ]
