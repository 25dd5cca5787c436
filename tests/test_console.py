"""What a default run tells the console (autooffload/console.py): the start line, every switch with its reason, and
the summary, on the logger ``transformers.autooffload``, through the handler transformers installs, without the
user raising any verbosity; and nothing of it where the user quieted transformers or this logger."""

from __future__ import annotations

import logging

import pytest
from conftest import train
from transformers.utils import logging as hf_logging

from autooffload import AutoOffloadCallback
from autooffload.console import LOGGER


class Lines(logging.Handler):
    """A handler as transformers' own: no level of its own, on the ``transformers`` logger."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def console():
    """The lines that reach transformers' handlers; transformers' verbosity and our logger's level as a user who
    set neither has them, restored afterwards."""
    handler, verbosity, ours = Lines(), hf_logging.get_verbosity(), logging.getLogger(LOGGER).level
    hf_logging.set_verbosity_warning()
    logging.getLogger(LOGGER).setLevel(logging.NOTSET)
    logging.getLogger("transformers").addHandler(handler)
    yield handler.lines
    logging.getLogger("transformers").removeHandler(handler)
    hf_logging.set_verbosity(verbosity)
    logging.getLogger(LOGGER).setLevel(ours)


def run(tmp_path) -> None:
    callback = AutoOffloadCallback(seq_high=200, seq_low=100, min_steps=1, probe=None, policy="hysteresis")
    train(tmp_path, [64, 256, 64], callbacks=[callback])


def test_a_default_run_says_when_it_starts_why_it_switches_and_what_it_did(tmp_path, console):
    run(tmp_path)
    ours = [line for line in console if line.startswith("autooffload: ")]
    assert ours[0].startswith("autooffload: controlling 4 checkpointed layer(s), mode=auto, memory signal=none")
    assert ours[1:3] == [
        "autooffload: step 2, seq 256: offload 0 -> 4 of 4 layer(s): sequence length >= seq_high (seq_high)",
        "autooffload: step 3, seq 64: offload 4 -> 0 of 4 layer(s): both signals below their low thresholds and the "
        "dwell passed: off (below_low)",
    ]
    assert ours[3].startswith("autooffload: mode=auto, 3 step(s), offload in 1 (33%), 2 switch(es)")
    assert len(ours) == 4


@pytest.mark.parametrize("quiet", ["transformers_error", "our_logger_warning"])
def test_a_user_who_quieted_transformers_or_this_logger_sees_none_of_it(tmp_path, console, quiet):
    if quiet == "transformers_error":
        hf_logging.set_verbosity_error()
    else:
        logging.getLogger(LOGGER).setLevel(logging.WARNING)
    run(tmp_path)
    assert not [line for line in console if line.startswith("autooffload: ")]


def test_info_on_this_logger_shows_every_line_of_it(tmp_path, console):
    logging.getLogger(LOGGER).setLevel(logging.INFO)
    run(tmp_path)
    assert sum(line.startswith("autooffload: ") for line in console) == 4
