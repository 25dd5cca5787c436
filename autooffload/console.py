"""The lines autooffload tells a person without being asked: the start of a run, each switch with its reason, and
the summary at the end.

They are INFO records of the logger ``transformers.autooffload``, so that the handlers transformers installs
print them and a user's logging configuration can route or silence them. transformers' own verbosity (WARNING
unless set) would hide INFO; these few lines are how a default run says what autooffload decided and why, so they
are shown anyway: on the main process only (the ranks agree, and one copy is enough), and not where a user quieted
transformers below WARNING (``transformers.logging.set_verbosity_error()``) or set this logger's level themselves
(``logging.getLogger("transformers.autooffload").setLevel(logging.WARNING)`` hides them; ``INFO`` shows every rank's).
"""

from __future__ import annotations

import logging
import sys

LOGGER = "transformers.autooffload"
logger = logging.getLogger(LOGGER)


def main_process() -> bool:
    """Rank 0 under torch.distributed, or no torch.distributed at all (read without importing torch)."""
    torch = sys.modules.get("torch")
    distributed = getattr(torch, "distributed", None)
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return True
    return distributed.get_rank() == 0


def shown() -> bool:
    """Whether a line of :func:`say` reaches the console by default (the module docstring says when)."""
    if logger.level != logging.NOTSET:
        return logger.isEnabledFor(logging.INFO)
    return main_process() and logging.getLogger("transformers").getEffectiveLevel() <= logging.WARNING


def say(message: str, *args: object) -> None:
    """One INFO line of ``transformers.autooffload``, shown by default where :func:`shown` says so."""
    if logger.disabled or not shown():
        return
    if logger.isEnabledFor(logging.INFO):
        logger.info(message, *args, stacklevel=2)
    else:  # the level transformers set would drop it: hand the record to the handlers directly
        logger.handle(logger.makeRecord(logger.name, logging.INFO, "(autooffload)", 0, message, args, None))
