"""History: one record per optimizer step of what the controller saw, what it decided, why, and what moved.

The logs (``log_history``, TensorBoard) hold the last value at each logging step; a user tuning thresholds
wants every step, every micro-batch, and the reason for each decision. The controller hands its state to a
:class:`HistoryRecorder` at two points (after each micro-batch's decision, at the end of each step); the
recorder keeps the records not yet written (at most :data:`PENDING_LIMIT`) and appends them to a JSON Lines
file when asked (the Trainer callback asks at every logging step, checkpoint save and at the end).

A record (one JSON object per line, keys in this order):

- ``step``: the optimizer step, counted as Trainer counts ``global_step`` (1 is the first step).
- ``seq_lens``, ``tokens``, ``offloaded``, ``reasons``: one entry per micro-batch of the step: its sequence
  length, its tokens (batch x sequence), the checkpointed layers that offloaded, and why (:data:`REASONS`).
  With several planned stacks: the longest stack's length, and the input tokens (an encoder-decoder's source
  and target tokens together; stacks that read one input, such as HRM's, count it once).
  A rescued step lists the rerun's micro-batches only.
- ``kept``: with ``AUTOOFFLOAD_RECOMPUTE=auto``, one entry per micro-batch: the checkpointed layers that ran
  without checkpointing (kept, not recomputed); ``null`` with ``always``.
- ``bytes_moved``: bytes the offload hooks moved to host memory in the step (a rescued step: both attempts).
- ``short_bytes``: bytes the step's offloaded layers were to move but kept on the device, for want of host
  memory (the budget full, the host short, an allocation failed); 0 when everything planned moved. A
  micro-batch that fell short counts in ``offloaded`` only the layers that moved everything, with the reason
  ``host_short``.
- ``switches``: changes of level in the step; ``rescued``: the step ran out of memory and was rerun.
- ``memory_fraction``, ``memory_bytes``, ``total_bytes``: the reading at the end of the step (``null``
  without one).
- ``predicted_peak_bytes``: the highest peak the policy predicted for the step's micro-batches with nothing
  offloaded (policies with a ``predict(tokens, bytes_per_layer)`` method; ``null`` otherwise).
- ``layers``, ``mode``, ``seq_high``, ``seq_low``, ``memory_high``, ``memory_low``, ``keep_margin``: what the
  decisions were made against (``keep_margin``: with ``AUTOOFFLOAD_RECOMPUTE=auto``, the setting, not the margin
  widened by misses; ``null`` with ``always``).
- What the step cost beside its compute (:mod:`autooffload.observe.costs`; 0 where nothing happened):
  ``gc_collections``, ``gc_seconds``, ``gc_collected`` (Python's garbage collections in the step, their time and
  the objects they freed), ``host_takes``, ``host_allocations``, ``host_registrations``, ``host_releases``
  (host buffers asked for, newly mapped, pinned, given back), ``pin_seconds`` (the time pinning took),
  ``probe_seconds`` (reading the memory probe) and ``syncs`` (host waits for the device that autooffload caused).

No torch and no controller import: the recorder is handed plain values.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .observe.costs import FIELDS as COST_FIELDS
from .settings import shown

HISTORY_DIR = "autooffload"
PENDING_LIMIT = 10_000

# Why a micro-batch got its level. The controller's own paths first, then the built-in policies'.
REASONS = {
    "mode_on": "AUTOOFFLOAD_MODE=on: every layer",
    "mode_off": "AUTOOFFLOAD_MODE=off: none",
    "compile_latch": "the torch.compile switch budget is spent: every layer for the rest of the run",
    "rescue": "the rerun of a step that ran out of memory: every layer",
    "policy_failed": "the policy raised: plain checkpointing",
    "rank_agreement": "another rank asked for more: the ranks run their maximum",
    "host_cap": "capped at what the host memory budget (AUTOOFFLOAD_HOST_MEMORY) holds",
    "host_short": "fewer layers moved than planned: host memory (the budget, the host, an allocation) took no more",
    "seq_high": "sequence length >= seq_high",
    "memory_high": "last reading >= memory_high",
    "above_low": "on, and a signal is still at or above its low threshold (hysteresis holds)",
    "dwell": "on, both signals calm, but min_steps have not passed since the switch",
    "below_low": "both signals below their low thresholds and the dwell passed: off",
    "below_high": "off, and no signal reached its high threshold",
    "predicted_fits": "the predicted peak is under memory_high: none",
    "predicted_excess": "the predicted peak exceeds memory_high: the fewest layers that bring it under",
    "forwards_alive": "forwards before this one in the same backward hold memory too: the fewest layers that bring "
    "the step under memory_high",
    "policy": "a policy that gives no reason",
}


class HistoryError(ValueError):
    """A history file that cannot be read: missing, empty, or not JSON Lines of step records."""


@dataclasses.dataclass
class StepRecord:
    """One optimizer step (the fields are described in the module docstring)."""

    step: int
    seq_lens: list[int]
    tokens: list[int]
    offloaded: list[int]
    reasons: list[str]
    kept: list[int] | None
    bytes_moved: int
    short_bytes: int
    switches: int
    rescued: bool
    memory_fraction: float | None
    memory_bytes: int | None
    total_bytes: int | None
    predicted_peak_bytes: float | None
    layers: int
    mode: str
    seq_high: int
    seq_low: int
    memory_high: float
    memory_low: float
    keep_margin: float | None = None
    gc_collections: int = 0
    gc_seconds: float = 0.0
    gc_collected: int = 0
    host_takes: int = 0
    host_allocations: int = 0
    host_registrations: int = 0
    host_releases: int = 0
    pin_seconds: float = 0.0
    probe_seconds: float = 0.0
    syncs: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))


class HistoryRecorder:
    """Collects a step's micro-batches, closes them into a :class:`StepRecord`, and appends records to a file."""

    def __init__(self, limit: int = PENDING_LIMIT) -> None:
        self.limit = limit
        self.pending: list[StepRecord] = []
        self.dropped = 0
        self._micro_batches: list[tuple[int, int, int, str | None]] = []
        self._kept: list[int] = []
        self._predicted: float | None = None
        self._switches = 0

    def micro_batch(
        self,
        seq_len: int,
        tokens: int,
        level: int,
        reason: str | None,
        kept: int,
        switched: bool,
        predicted: float | None,
    ) -> None:
        """After a micro-batch's plan is installed: its shape, level, reason and kept layers, and the policy's
        predicted peak."""
        self._micro_batches.append((seq_len, tokens, level, reason))
        self._kept.append(kept)
        self._switches += int(switched)
        if predicted is not None:
            self._predicted = max(self._predicted or 0.0, predicted)

    def fell_short(self, offloaded: int) -> None:
        """The last micro-batch ran: only ``offloaded`` of its layers moved their inputs (host memory was short)."""
        if self._micro_batches:
            seq, tokens, _, _ = self._micro_batches[-1]
            self._micro_batches[-1] = (seq, tokens, offloaded, "host_short")

    def rescue(self) -> None:
        """The step is rerun from its first micro-batch: forget the failed attempt's micro-batches."""
        self._micro_batches.clear()
        self._kept.clear()

    def end_step(
        self,
        step: int,
        moved: tuple[int, int],
        rescued: bool,
        memory: tuple[float | None, int | None, int | None],
        layers: int,
        settings: Any,
        costs: dict[str, float] | None = None,
    ) -> StepRecord:
        """Close step ``step`` (counted as Trainer counts ``global_step``): ``moved``, the bytes moved and kept
        short; ``memory``, the reading (fraction, bytes, device bytes); ``settings``, what the decisions were
        made against; ``costs``, what the step cost beside its compute (the record's fields of that name)."""
        shapes = self._micro_batches
        fraction, used, total = memory
        record = StepRecord(
            step=step,
            seq_lens=[seq for seq, *_ in shapes],
            tokens=[tokens for _, tokens, *_ in shapes],
            offloaded=[level for *_, level, _ in shapes],
            reasons=[reason for *_, reason in shapes],  # type: ignore[misc]
            kept=list(self._kept) if settings.recompute == "auto" else None,
            bytes_moved=int(moved[0]),
            short_bytes=int(moved[1]),
            switches=self._switches,
            rescued=bool(rescued),
            memory_fraction=fraction,
            memory_bytes=used,
            total_bytes=total if used is not None else None,
            predicted_peak_bytes=self._predicted,
            layers=layers,
            mode=settings.mode,
            seq_high=settings.seq_high,
            seq_low=settings.seq_low,
            memory_high=settings.memory_high,
            memory_low=settings.memory_low,
            keep_margin=settings.keep_margin if settings.recompute == "auto" else None,
            **{name: value for name, value in (costs or {}).items() if name in COST_FIELDS},  # type: ignore[arg-type]
        )
        self._micro_batches, self._kept, self._predicted, self._switches = [], [], None, 0
        self.pending.append(record)
        if len(self.pending) > self.limit:
            del self.pending[0]
            self.dropped += 1
        return record

    def write(self, path: str | os.PathLike) -> int:
        """Append the pending records to ``path`` (JSON Lines, parent folders made) and forget them.
        Returns how many were written. Raises ``OSError`` and keeps the records if the file cannot be written."""
        if not self.pending:
            return 0
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as file:
            file.write("".join(record.to_json() + "\n" for record in self.pending))
        written = len(self.pending)
        self.pending.clear()
        return written


def history_path(output_dir: str | os.PathLike, rank: int = 0, world_size: int = 1) -> Path:
    """``<output_dir>/autooffload/history.jsonl`` for one process; ``history-rank{N}.jsonl`` for every rank
    (0 included) when there is more than one, since each rank decides for its own micro-batches."""
    name = "history.jsonl" if world_size <= 1 else f"history-rank{rank}.jsonl"
    return Path(output_dir) / HISTORY_DIR / name


def truncate_history(path: str | os.PathLike, last_step: int) -> int:
    """Keep the records of steps up to ``last_step`` and drop the rest; returns how many were dropped.

    A run resumed from a checkpoint at step N appends from step N + 1, so records past N (written by the run
    that went on after the checkpoint was saved) and a line cut short by a crash would be duplicates or
    garbage. A fresh run (``last_step`` 0) empties the file of an earlier run in the same folder.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    kept = [line for line in lines if (step := _step_of(line)) is not None and step <= last_step]
    if len(kept) == len(lines):
        return 0
    partial = path.with_name(path.name + ".tmp")
    partial.write_text("".join(kept), encoding="utf-8")
    os.replace(partial, path)
    return len(lines) - len(kept)


def _step_of(line: str) -> int | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


REQUIRED = {"step": int, "seq_lens": list, "tokens": list, "offloaded": list, "bytes_moved": int}
LARGEST = 2**63  # no count or size in a history is larger; one that is cannot be drawn (floats overflow)


def read_history(path: str | os.PathLike, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The records of a history file, in order. :class:`HistoryError` (one line) when the file is missing,
    empty, or a line is not a step record, or holds a number out of range.

    A last line cut short (no newline at its end, not JSON: a crash while the file was being appended to) is
    skipped, and ``warn`` (default: :func:`warnings.warn`) hears one line about it: the steps before it are whole.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HistoryError(f"no history file at {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise HistoryError(f"cannot read {path}: {error}") from None
    records = []
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            if number == len(lines) and not text.endswith("\n"):
                (warn or warnings.warn)(f"{path}, line {number}: cut short (a crash while writing?); skipped")
                continue
            raise HistoryError(f"{path}, line {number}: not JSON") from None
        missing = [key for key, kind in REQUIRED.items() if not isinstance(record, dict) or not _is(record, key, kind)]
        if missing:
            raise HistoryError(f"{path}, line {number}: not a step record (missing or bad {', '.join(missing)})")
        bad = _out_of_range(record)
        if bad is not None:
            raise HistoryError(f"{path}, line {number}: {bad[0]}={shown(bad[1])} is out of range")
        records.append(record)
    if not records:
        raise HistoryError(f"{path} holds no records")
    return records


def _is(record: dict[str, Any], key: str, kind: type) -> bool:
    value = record.get(key)
    return isinstance(value, kind) and not isinstance(value, bool)


def _out_of_range(record: dict[str, Any]) -> tuple[str, Any] | None:
    """The first key holding a number no history holds (an integer beyond 2**63, an infinite float), and it."""
    for key, value in record.items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, bool):
                continue
            if (isinstance(item, int) and abs(item) > LARGEST) or (isinstance(item, float) and math.isinf(item)):
                return key, item
    return None
