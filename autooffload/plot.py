"""``autooffload plot``: one timeline of a history file, to see what the controller decided and why.

Four panels over the optimizer steps: the micro-batches' sequence lengths against ``seq_high``/``seq_low``;
the memory reading against ``memory_high``/``memory_low``, with the predicted peak (nothing offloaded); the
layers offloaded per micro-batch (and kept, once recorded); the bytes moved to host memory. Switches are
marked on the levels panel, rescued steps on every panel. matplotlib is an optional extra
(``pip install autooffload[plot]``); the Agg backend draws without a display.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn

from .history import HISTORY_DIR, HistoryError, read_history
from .settings import shown

EXTRA_HINT = "matplotlib is needed to plot: pip install autooffload[plot]"


class _Parser(argparse.ArgumentParser):
    """argparse, but every error is one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        _print_error(message)
        raise SystemExit(2)


def _print_error(message: str) -> None:
    print(f"autooffload plot: error: {message}", file=sys.stderr)


def find_history(path: str | Path, rank: int | None = None) -> Path:
    """The history file ``path`` names: the file itself, or in an output_dir (or its ``autooffload/``
    folder) ``history.jsonl``, else ``history-rank{rank}.jsonl`` (rank 0 unless given)."""
    path = Path(path)
    if not path.is_dir():
        return path
    names = ["history.jsonl", "history-rank0.jsonl"] if rank is None else [f"history-rank{rank}.jsonl"]
    for folder in (path / HISTORY_DIR, path):
        for name in names:
            if (folder / name).is_file():
                return folder / name
    raise HistoryError(f"no {' or '.join(names)} in {path} or {path / HISTORY_DIR}")


def draw(
    records: list[dict[str, Any]], out: str | Path, title: str = "", memory_label: str = "memory fraction"
) -> Path:
    """Draw the timeline of ``records`` into ``out`` (an image format matplotlib writes, by its suffix; otherwise
    ``.png`` is added) and return the file written. Raises ImportError without matplotlib.

    ``memory_label``: the memory panel's axis label (the demo's says its memory is simulated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    figure, (seq_ax, mem_ax, level_ax, bytes_ax) = plt.subplots(
        4, 1, figsize=(10, 9), sharex=True, gridspec_kw={"height_ratios": [3, 3, 2, 2]}
    )

    def micro(key: str) -> tuple[list[int], list[float]]:
        pairs = [(r["step"], value) for r in records for value in (r.get(key) or []) if value is not None]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def threshold(ax: Any, key: str, style: str, color: str) -> None:
        values = [r.get(key) for r in records]
        if any(v is not None for v in values):
            ax.step(steps, values, where="mid", linestyle=style, color=color, linewidth=1, label=key)

    xs, lengths = micro("seq_lens")
    seq_ax.scatter(xs, lengths, s=14, color="tab:blue", label="micro-batch", zorder=3)
    threshold(seq_ax, "seq_high", "--", "tab:red")
    threshold(seq_ax, "seq_low", ":", "tab:orange")
    seq_ax.set_ylabel("sequence length")

    memory = [r.get("memory_fraction") for r in records]
    if any(m is not None for m in memory):
        mem_ax.plot(steps, memory, marker="o", markersize=3, color="tab:blue", label="reading")
        predicted = [_fraction(r.get("predicted_peak_bytes"), r.get("total_bytes")) for r in records]
        if any(p is not None for p in predicted):
            label = "predicted peak,\nnone offloaded"
            mem_ax.plot(steps, predicted, marker="x", linestyle="--", color="tab:purple", label=label)
        threshold(mem_ax, "memory_high", "--", "tab:red")
        threshold(mem_ax, "memory_low", ":", "tab:orange")
    else:
        mem_ax.text(0.5, 0.5, "no memory reading (no GPU or no probe)", ha="center", va="center",
                    transform=mem_ax.transAxes, color="gray")  # fmt: skip
    mem_ax.set_ylabel(memory_label)

    kept_xs, kept = micro("kept")
    shift = 0.12 if kept else 0.0  # side by side where both are recorded
    xs, levels = micro("offloaded")
    level_ax.scatter([x - shift for x in xs], levels, s=14, color="tab:green", label="offloaded", zorder=3)
    if kept:
        level_ax.scatter([x + shift for x in kept_xs], kept, s=14, marker="s", color="tab:gray", label="kept")
    switched = [r for r in records if r.get("switches")]
    if switched:
        top = max(r.get("layers") or 0 for r in records) + 0.5
        level_ax.scatter([r["step"] for r in switched], [top] * len(switched), marker="v", color="black",
                         label="switch (why)")  # fmt: skip
        for r in switched:
            why = (r.get("reasons") or ["?"])[-1]
            level_ax.annotate(
                str(why), (r["step"], top), xytext=(2, 2), textcoords="offset points", fontsize=7, rotation=35
            )
        level_ax.set_ylim(-0.5, top + 2.5)
    level_ax.set_ylabel("layers")
    level_ax.yaxis.get_major_locator().set_params(integer=True)

    bytes_ax.bar(steps, [r["bytes_moved"] / 2**20 for r in records], color="tab:green", width=0.8)
    bytes_ax.set_ylabel("MiB to host")
    bytes_ax.set_xlabel("optimizer step")

    rescued = [r["step"] for r in records if r.get("rescued")]
    for ax in (seq_ax, mem_ax, level_ax, bytes_ax):
        for i, step in enumerate(rescued):
            first = i == 0 and ax is seq_ax
            ax.axvline(step, color="tab:red", alpha=0.3, linewidth=4, label="rescued step" if first else None)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
        ax.grid(alpha=0.3)
    seq_ax.set_title(title or "autooffload: what it decided, per optimizer step", fontsize=10)
    figure.tight_layout()
    out = Path(out)
    if out.suffix[1:].lower() not in figure.canvas.get_supported_filetypes():
        out = out.with_name(out.name + ".png")  # no suffix, or one that names no image format
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, dpi=80)
    finally:
        plt.close(figure)
    return out


def _fraction(value: float | None, total: int | None) -> float | None:
    return value / total if value is not None and total else None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="autooffload plot",
        description="One timeline of a history file, to see what the controller decided and why.",
    )
    parser.add_argument("path", help="a history file, or a training output_dir holding autooffload/history.jsonl")
    parser.add_argument(
        "--out", help="the image to write (default: next to the history file, .png; a name without a suffix gets .png)"
    )
    parser.add_argument("--rank", type=int, help="which rank's file to plot from an output_dir (default 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Write the PNG and print its path; 2 on a missing, empty or garbled file, or without matplotlib."""
    options = build_parser().parse_args(argv)
    try:
        path = find_history(options.path, options.rank)
        records = read_history(path, warn=_print_warning)
    except HistoryError as error:
        _print_error(str(error))
        return 2
    except OSError as error:  # a path too long to look at, a folder that cannot be listed
        _print_error(f"cannot read {shown(options.path)}: {error.strerror or error}")
        return 2
    out = Path(options.out) if options.out else path.with_suffix(".png")
    try:
        written = draw(records, out, title=f"autooffload: {path}")
    except ImportError:
        _print_error(EXTRA_HINT)
        return 2
    except OSError as error:
        blocker = _not_a_folder(out.parent)
        why = f"{blocker} is not a folder" if blocker else error.strerror or error
        _print_error(f"cannot write {shown(str(out))}: {why}")
        return 2
    except (TypeError, ValueError, KeyError, ArithmeticError) as error:
        _print_error(f"{path} holds records that cannot be drawn ({shown(str(error))})")
        return 2
    print(f"autooffload plot: {len(records)} step(s) from {path} -> {written}")
    return 0


def _not_a_folder(folder: Path) -> Path | None:
    """The nearest of ``folder`` and its parents that exists and is not a folder (``/dev/null`` of
    ``/dev/null/x.png``): mkdir reports it as "File exists", which names the wrong cause."""
    for path in (folder, *folder.parents):
        try:
            if path.exists():
                return None if path.is_dir() else path
        except OSError:
            return None
    return None


def _print_warning(message: str) -> None:
    print(f"autooffload plot: warning: {message}", file=sys.stderr)
