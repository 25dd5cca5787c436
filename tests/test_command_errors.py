"""The commands never show a traceback: each bad input is one line naming the bad thing, and exit code 2; a
history whose last line a crash cut short is read with a warning (issue 31)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autooffload.__main__ import main
from autooffload.estimate import machine
from autooffload.history import HistoryRecorder
from autooffload.settings import Settings

HUGE = "9" * 400
LONG = "x" * 100_000


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch):
    monkeypatch.setattr(machine, "nvml_total_bytes", lambda: None)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(argv: list[str], capsys, *named: str) -> str:
    code, out, err = run(argv, capsys)
    lines = err.strip().splitlines()
    assert (code, out, len(lines)) == (2, "", 1), err[-2000:]
    assert "Traceback" not in err and len(lines[0]) < 400, lines[0][:400]
    for name in named:
        assert name in lines[0], lines[0]
    return lines[0]


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(text)
    return str(path)


MODEL = ["--layers", "2", "--hidden", "8"]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        ([*MODEL, "--seq", HUGE], ("--seq", "out of range")),
        ([*MODEL, "--seq", "8", "--device-memory", "1e308"], ("--device-memory", "out of range")),
        ([*MODEL, "--seq", "8", "--device-memory", "nan"], ("--device-memory", "'nan' is not a number")),
        ([*MODEL, "--seq", "8", "--other-memory", "1e300"], ("--other-memory",)),
        ([*MODEL, "--seq", "8", "--batch", "9" * 100_000], ("--batch", "100,000 characters")),
        ([*MODEL, "--seq", "8", "--ranks-per-node", HUGE], ("--ranks-per-node",)),
        ([*MODEL, "--seq", "8", "--dtype", LONG], ("unknown dtype", "100,000 characters")),
    ],
)
def test_estimate_arguments(capsys, argv, named):
    one_line_error(["estimate", *argv], capsys, *named)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('{"num_hidden_layers": ' + "9" * 4301 + ', "hidden_size": 8}', ("a number too long",)),
        ('{"num_hidden_layers": ' + "9" * 4000 + ', "hidden_size": 8}', ("num_hidden_layers=", "out of range")),
        ('{"num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": ' + HUGE + "}", ("intermediate_size=",)),
        ('{"num_hidden_layers": 2, "hidden_size": 8, "hc_mult": ' + HUGE + "}", ("hc_mult=",)),
        ('{"num_hidden_layers": 2, "hidden_size": 8, "attention_dropout": Infinity}', ("attention_dropout=",)),
        ("[" * 100_000 + "]" * 100_000, ("nested too deeply",)),
        (
            '{"is_encoder_decoder": true, "encoder_layers": 2, "decoder_layers": ' + HUGE + ', "d_model": 8}',
            ("decoder_layers=",),
        ),
    ],
)
def test_estimate_configs(tmp_path, capsys, text, named):
    argv = ["estimate", config(tmp_path, text), "--seq", "8", "--target-seq", "8"]
    if "is_encoder_decoder" not in text:
        argv = argv[:-2]
    one_line_error(argv, capsys, *named)


def test_estimate_at_the_largest_values_it_takes_answers(capsys):
    big = str(2**40)
    argv = ["estimate", "--layers", big, "--hidden", big, "--seq", big, "--batch", big, "--device-memory", big]
    code, out, err = run([*argv, "--other-memory", big, "--ranks-per-node", big, "--host-bandwidth", "1e-300"], capsys)
    assert (code, err) == (0, "") and "recommendation" in out


def write_history(path: Path, steps: int = 4, changes: dict[int, tuple[str, object]] | None = None) -> list[str]:
    recorder = HistoryRecorder()
    settings = Settings()
    for step in range(1, steps + 1):
        recorder.micro_batch(64 * step, 64 * step, 1, "seq_high", 0, step == 2, 1000.0 * step)
        recorder.end_step(step, (100 * step, 0), False, (0.5, 50, 100), 4, settings)
    lines = [record.to_json() for record in recorder.pending]
    for number, (key, value) in (changes or {}).items():
        record = json.loads(lines[number])
        record[key] = value
        lines[number] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    return lines


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({2: ("seq_high", 10**400)}, ("line 3", "seq_high=", "out of range")),
        ({1: ("seq_lens", [64, 2**70])}, ("line 2", "seq_lens=")),
        ({0: ("memory_fraction", float("inf"))}, ("line 1", "memory_fraction=")),
    ],
)
def test_plot_a_number_out_of_range(tmp_path, capsys, changes, named):
    path = tmp_path / "history.jsonl"
    write_history(path, changes=changes)
    one_line_error(["plot", str(path), "--out", str(tmp_path / "h.png")], capsys, *named)
    assert not (tmp_path / "h.png").exists()


def test_plot_a_path_too_long_and_an_image_it_cannot_write(tmp_path, capsys):
    path = tmp_path / "history.jsonl"
    write_history(path)
    one_line_error(["plot", "a" * 100_000], capsys, "cannot read", "100,000 characters")
    (tmp_path / "file").write_text("")
    one_line_error(["plot", str(path), "--out", str(tmp_path / "file" / "h.png")], capsys, "cannot write")


def test_plot_skips_a_last_line_cut_by_a_crash_with_one_warning(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "history.jsonl"
    lines = write_history(path)
    path.write_text("\n".join(lines) + "\n" + lines[0][:40])  # the fifth step's line, cut mid-write
    code, out, err = run(["plot", str(path)], capsys)
    assert code == 0 and "4 step(s)" in out
    assert err == f"autooffload plot: warning: {path}, line 5: cut short (a crash while writing?); skipped\n"
    # A line cut short that is not the last is not a crash's: the file is refused.
    path.write_text(lines[0][:40] + "\n" + "\n".join(lines) + "\n")
    one_line_error(["plot", str(path)], capsys, "line 1: not JSON")


@pytest.mark.parametrize(
    ("name", "written"), [("timeline", "timeline.png"), ("run.v1", "run.v1.png"), ("a.svg", "a.svg")]
)
def test_plot_reports_the_file_it_wrote(tmp_path, capsys, name, written):
    pytest.importorskip("matplotlib")
    path = tmp_path / "history.jsonl"
    write_history(path)
    code, out, _ = run(["plot", str(path), "--out", str(tmp_path / name)], capsys)
    assert code == 0 and out.strip().endswith(f"-> {tmp_path / written}")
    assert (tmp_path / written).stat().st_size > 1000


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--device-bytes", "0"], ("--device-bytes", "positive")),
        (["--device-bytes", "-5"], ("--device-bytes",)),
        (["--device-bytes", HUGE], ("--device-bytes", "400 characters")),
        (["--device-bytes", "4.5MB"], ("--device-bytes",)),
        (["--output-dir", "{file}/below"], ("--output-dir", "cannot make")),
        (["--output-dir", "{long}"], ("--output-dir",)),
    ],
)
def test_demo_arguments(tmp_path, capsys, argv, named):
    (tmp_path / "file").write_text("")
    argv = [a.format(file=tmp_path / "file", long=tmp_path / ("d" * 5000)) for a in argv]
    one_line_error(["demo", *argv], capsys, *named)


def test_estimate_names_a_value_of_the_wrong_type_not_a_missing_key(tmp_path, capsys):
    """Issue 54: ``"hidden_size": "big"`` said the config "has no hidden size"."""
    path = config(tmp_path, '{"num_hidden_layers": 2, "hidden_size": "big"}')
    line = one_line_error(["estimate", path, "--seq", "8"], capsys, "hidden_size='big'", "not a whole number")
    assert "no hidden size" not in line


def test_nan_is_not_called_out_of_range(capsys):
    line = one_line_error(["estimate", *MODEL, "--seq", "8", "--device-memory", "nan"], capsys, "not a number")
    assert "2**40" not in line


@pytest.mark.parametrize("argv", [["bogus"], ["--bogus"], ["estimat", "--seq", "8"]])
def test_an_unknown_command_is_named(capsys, argv):
    """Issue 54: ``autooffload bogus`` printed the usage without saying what was wrong."""
    one_line_error(argv, capsys, f"unknown command {argv[0]!r}", "demo, estimate, plot")


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["plot", "--help"], ["estimate", "--help"]])
def test_help_is_plain_text(capsys, argv):
    """Issue 54: ``--help`` showed the docstrings' reST markup (double backquotes, :class: roles)."""
    code, out, err = run(argv, capsys)
    assert (code, err) == (0, "") and "usage: autooffload" in out
    assert "``" not in out and ":class:" not in out and ":mod:" not in out, out


def test_plot_names_the_file_in_the_way_of_the_image_not_file_exists(tmp_path, capsys):
    """Issue 54: ``--out /dev/null/x.png`` said "File exists" (mkdir of /dev/null)."""
    path = tmp_path / "history.jsonl"
    write_history(path)
    (tmp_path / "file").write_text("")
    for out, blocker in (
        ("/dev/null/x.png", "/dev/null"),
        (str(tmp_path / "file" / "a" / "h.png"), str(tmp_path / "file")),
    ):
        line = one_line_error(["plot", str(path), "--out", out], capsys, "cannot write", f"{blocker} is not a folder")
        assert "File exists" not in line


def test_demo_refuses_a_device_too_small_for_the_model(tmp_path, capsys):
    """Issue 54: ``demo --device-bytes 100`` trained 16 steps at 3,282,532% of the device, without a word."""
    out = tmp_path / "demo"
    one_line_error(["demo", "--device-bytes", "100", "--output-dir", str(out)], capsys, "--device-bytes 100", "model")
    assert not (out / "autooffload").exists()
