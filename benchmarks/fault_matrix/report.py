"""The matrix's tables and files: per fault, per window and per model, the cells where every check held."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from .config import TOPOLOGIES
from .inject import entry_points, places

CHECKS = ("survived", "identical", "warned", "detached", "same_collectives", "raised", "plain_identical")


def table(verdicts: list[dict]) -> str:
    """One row per fault and topology: cells injected, and how many passed each check."""
    rows: dict[tuple[str, str], dict[str, int]] = {}
    for v in verdicts:
        if v.get("unreached"):
            continue
        fault = v["fault"]
        row = rows.setdefault((fault, v.get("topology", "?")), dict.fromkeys(("cells", *CHECKS, "resumed"), 0))
        row["cells"] += 1
        for check in CHECKS:
            row[check] += int(bool(v.get(check, check in ("raised", "plain_identical") or v.get("survived"))))
        row["resumed"] += int(bool(v.get("resumed_exactly")))
    columns = ("fault", "topology", "injected", "survived", "identical", "warned", "detached", "same collectives")
    lines = ["| " + " | ".join((*columns, "resumed exactly")) + " |", "|---" * (len(columns) + 1) + "|"]
    totals = dict.fromkeys(("cells", "survived", "identical", "warned", "detached", "same_collectives", "resumed"), 0)
    for (fault, topology), row in sorted(rows.items(), key=lambda item: (item[0][0].split(":")[0], item[0])):
        resumed = str(row["resumed"]) if fault == "kill" else "-"
        lines.append(
            f"| {fault} | {topology} | {row['cells']} | {row['survived']} | {row['identical']} | {row['warned']} | "
            f"{row['detached']} | {row['same_collectives']} | {resumed} |"
        )
        for key in totals:
            totals[key] += row[key]
    lines.append(
        f"| **all** | | {totals['cells']} | {totals['survived']} | {totals['identical']} | {totals['warned']} | "
        f"{totals['detached']} | {totals['same_collectives']} | {totals['resumed']} |"
    )
    return "\n".join(lines)


def summary(verdicts: list[dict]) -> str:
    """Per kind of fault and topology: cells injected / survived with identical results and every check held."""
    kinds = {"entry": "an exception at an entry point", "step": "an exception inside a step (a place)",
             "probe": "the memory probe", "host": "host memory", "kill": "SIGKILL between steps, resumed"}  # fmt: skip
    return held_table(verdicts, "fault", kinds, lambda v: v.get("fault", "").split(":")[0])


def windows_table(verdicts: list[dict]) -> str:
    """Per window of the run (entry points and places) and topology: cells injected / every check held."""
    names = dict.fromkeys(sorted({v["window"] for v in verdicts if v.get("window")}, key=_window_order))
    return held_table(verdicts, "window", {name: name for name in names}, lambda v: v.get("window", ""))


def models_table(verdicts: list[dict]) -> str:
    """Per model and topology: cells injected / every check held."""
    models = {"qwen3": "Qwen3", "t5": "T5 (encoder-decoder)", "inner": "Qwen3 entered through model.model (TRL)"}
    return held_table(verdicts, "model", models, lambda v: v.get("model", ""))


def held_table(verdicts: list[dict], title: str, rows: dict[str, str], key: Callable[[dict], str]) -> str:
    topologies = [t for t in TOPOLOGIES if any(v.get("topology") == t for v in verdicts)]
    lines = [f"| {title} | " + " | ".join(topologies) + " |", "|---" * (len(topologies) + 1) + "|"]
    for row, name in rows.items():
        cells = []
        for topology in topologies:
            mine = [v for v in verdicts if v.get("topology") == topology and key(v) == row and not v.get("unreached")]
            held = sum(all(v.get(k, True) for k in CHECKS) for v in mine)
            cells.append(f"{held} of {len(mine)}" if mine else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _window_order(window: str) -> tuple[int, str]:
    order = ("the run's first", "a non-last", "the last", "evaluation", "outside")
    return next((i for i, start in enumerate(order) if window.startswith(start)), len(order)), window


def write(out: Path, verdicts: list[dict], options: argparse.Namespace, seconds: float) -> None:
    import transformers

    meta = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/faults.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s), no GPU"
        if not torch.cuda.is_available()
        else "cuda",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "seconds": round(seconds),
        "entry_points": sorted(entry_points()),
        "places": sorted(places()),
    }
    (out / "faults.json").write_text(json.dumps({**meta, "cells": verdicts}, indent=1))
    (out / "faults.md").write_text(
        f"# Fault matrix, {meta['date']}\n\n`{meta['command']}` ({meta['machine']}; torch {meta['torch']}, "
        f"transformers {meta['transformers']}; {meta['seconds']} s)\n\nCells where every check held:\n\n"
        f"{summary(verdicts)}\n\nBy the window of the run the fault struck in:\n\n{windows_table(verdicts)}\n\n"
        f"By model:\n\n{models_table(verdicts)}\n\nEvery fault:\n\n{table(verdicts)}\n"
    )
