"""Line-level fault injection: an exception at every line of ``autooffload/`` that a short training run executes.

    python -m benchmarks.line_faults --out DIR                     # every line, settings one, rank1, both
    python -m benchmarks.line_faults --out DIR --settings one --sample 50
    python -m benchmarks.line_faults --out DIR --quick             # 20 lines on one process (tests/test_line_faults)

The fault matrix (``benchmarks/faults.py``) fails the places autooffload registered; this fails every line it runs,
listed or not. A fault-free run traces (``sys.settrace``, ``threading.settrace``) every distinct (file, line) of
``autooffload/`` it executes from ``attach`` to the end of ``train()``; then each line gets one run in which the
trace function raises :class:`InjectedLineFault` the first time that line is reached (a trace function's exception
is raised in the traced frame at that line, and tracing stops). Settings: ``one`` (one process under Trainer),
``rank1`` (two DDP ranks over gloo, the fault on rank 1) and ``both`` (the fault on both ranks).

The run: a tiny random Qwen3 (4 layers, hidden 64) through the real Trainer, gradient accumulation 2, 3 optimizer
steps of mixed lengths, an evaluation and a save at step 2, ``attach(trainer)`` in mode ``auto`` on a
:class:`~autooffload.SimulatedDevice` small enough that long micro-batches offload and short ones keep
(``recompute="auto"``). A run survives when every rank finished every step with losses and parameters bit-identical
to plain checkpointing without autooffload (a fault degrades to plain checkpointing; the fault-free run with
autooffload is checked against it too), at most one new AutoOffloadWarning, no host bytes held or lent after
``detach()``, no hook of autooffload's left on the model, the same Python-level collectives on both ranks, and no
hang (a run past ``--timeout`` fails). Runs are forked from a warm parent (imports done, one training run behind
it), both ranks of a two-rank run from the same parent with a fresh gloo group each. ``results.json`` under
``--out`` is written after every run, and a run already in it is skipped (resumable).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .forking import forked, spawner, warm
from .report import write_report
from .tracing import ROOT, absolute
from .training import STEPS

SETTINGS = {"one": (1, (0,)), "rank1": (2, (1,)), "both": (2, (0, 1))}  # world size, the ranks the fault strikes
TIMEOUT_S = 120.0


# ---- the checks ---------------------------------------------------------------------------------------------------


def verdict(runs: list[dict], reference: list[dict], warned: list[int]) -> list[str]:
    """What broke the promise in one run (empty: it survived)."""
    broken = []
    for run, ref, before in zip(runs, reference, warned, strict=True):
        rank = f"rank {run['rank']}: "
        if run.get("error"):
            broken.append(rank + "raised: " + run["error"].strip().splitlines()[-1][:300])
            continue
        if run["steps"] != STEPS:
            broken.append(rank + f"{run['steps']} of {STEPS} steps")
        if run["losses"] != ref["losses"]:
            broken.append(rank + "losses differ from plain checkpointing")
        if run["parameters"] != ref["parameters"]:
            broken.append(rank + "parameters differ from plain checkpointing")
        if len(run["warnings"]) > before + 1:
            broken.append(rank + f"{len(run['warnings']) - before} new warnings: {run['warnings'][before:]}")
        if run.get("lent_bytes") or run.get("held_bytes"):
            broken.append(rank + f"{run['lent_bytes']} bytes lent, {run['held_bytes']} held after detach()")
        if run.get("left_on_model"):
            broken.append(rank + f"{run['left_on_model']} hooks or functions of autooffload's left on the model")
    if len(runs) == 2 and all(not r.get("error") for r in runs) and runs[0]["collectives"] != runs[1]["collectives"]:
        broken.append("the ranks made different collectives")
    return broken


def save(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def baseline(setting: str, data: dict, timeout: float, quick: bool = False) -> dict:
    """The setting's references (plain checkpointing; no checkpointing; autooffload fault-free, untraced and
    traced; ``quick``: the first and the last only)."""
    world, _ = SETTINGS[setting]
    base = data.setdefault("baselines", {}).setdefault(setting, {})
    modes = ("plain", "trace") if quick else ("plain", "none", "ours", "trace")
    for mode in modes:
        if mode not in base:
            started = time.monotonic()
            base[mode] = forked(mode, world, (), None, timeout * 3)
            base[mode + "_seconds"] = round(time.monotonic() - started, 2)
    plain = base["plain"]
    for mode in modes[1:]:
        base[f"{mode}_identical_to_plain"] = [
            r["losses"] == p["losses"] and r["parameters"] == p["parameters"]
            for r, p in zip(base[mode], plain, strict=True)
        ]
    if not all(base["trace_identical_to_plain"]) or any(r.get("error") for r in base["trace"] + plain):
        raise SystemExit(f"{setting}: the fault-free run is not plain checkpointing's: {base}")
    return base


class Noter:
    """Files one run's results under its line, with the verdict, and saves."""

    def __init__(self, runs: dict, base: dict, ranks: tuple[int, ...], commit: str, saving: Any) -> None:
        self.runs, self.base, self.ranks, self.commit, self.saving = runs, base, ranks, commit, saving
        self.warned = [len(r["warnings"]) for r in base.get("ours", base["trace"])]
        self.done: set[str] = set()

    def __call__(self, line: str, results: list[dict], seconds: float, how: str) -> None:
        ranks, earlier = self.ranks, self.runs.get(line)
        broken = verdict(results, self.base["plain"], self.warned)
        self.runs[line] = {
            "survived": not broken, "broken": broken, "seconds": seconds, "how": how, "commit": self.commit,
            "fired": [r.get("fired") for r in results if r["rank"] in ranks],
            "where": [r.get("where") for r in results if r["rank"] in ranks],
            "warnings": [r["warnings"][w:] for r, w in zip(results, self.warned, strict=True)],
            "errors": [r["error"] for r in results if r.get("error")],
            "unraisable": [u for r in results for u in r.get("unraisable", [])],
        }  # fmt: skip
        if earlier is not None:
            self.runs[line]["earlier"] = {k: v for k, v in earlier.items() if k != "earlier"}
        self.done.add(line)
        self.saving()
        state = "survived" if not broken else "FAILED " + "; ".join(broken)
        print(f"[{len(self.done)}] {line}: {state}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--settings", default="one,rank1,both")
    parser.add_argument("--sample", type=int, default=0, help="this many lines, evenly spread (0: every line)")
    parser.add_argument("--lines", default="", help="a slice of the sorted lines, START:STOP")
    parser.add_argument("--only", default="", help="comma-separated lines (autooffload/x.py:12) to run again")
    parser.add_argument("--quick", action="store_true", help="20 lines on one process")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="per run, seconds")
    parser.add_argument("--files", default="", help="only lines of these files (autooffload/distributed.py,...)")
    parser.add_argument("--shard", default="", help="I/N: every N-th line from the I-th (run N at once, then --merge)")
    parser.add_argument("--merge", nargs="*", default=[], help="fold these --out directories' runs into --out's")
    parser.add_argument("--report", action="store_true", help="only write results.md from results.json")
    parser.add_argument("--fresh", action="store_true", help="one process too: each line in a run of its own")
    parser.add_argument("--redo", action="store_true", help="run again lines already in results.json")
    options = parser.parse_args(argv)
    if options.quick:
        options.settings, options.sample = "one", options.sample or 20
    options.out.mkdir(parents=True, exist_ok=True)
    path = options.out / "results.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data["releases"] = {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                        "python": sys.version.split()[0]}  # fmt: skip
    for other in options.merge:
        theirs = json.loads((Path(other) / "results.json").read_text())
        for setting, runs in theirs.get("runs", {}).items():
            data.setdefault("runs", {}).setdefault(setting, {}).update(runs)
        for setting, base in theirs.get("baselines", {}).items():
            data.setdefault("baselines", {}).setdefault(setting, base)
    if options.merge or options.report:
        save(path, data)
        write_report(data, options.out)
        return 0
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    data["commits"] = sorted(set(data.get("commits", [])) | {commit.stdout.strip()})
    warm()
    for setting in options.settings.split(","):
        world, ranks = SETTINGS[setting]
        base = baseline(setting, data, options.timeout, options.quick)
        lines = sorted(set().union(*(r["lines"] for i, r in enumerate(base["trace"]) if i in ranks)))
        base["lines_executed"] = len(set().union(*(r["lines"] for r in base["trace"])))
        if options.only:  # of the lines the fault-free run executed; "@FILE": the list in FILE
            only = Path(options.only[1:]).read_text() if options.only.startswith("@") else options.only
            lines = [line for line in only.strip().split(",") if line in lines]
        elif options.lines:
            start, stop = (int(x) if x else None for x in options.lines.split(":"))
            lines = lines[start:stop]
        if options.files:
            lines = [line for line in lines if line.split(":")[0] in options.files.split(",")]
        if options.shard:
            index, count = (int(x) for x in options.shard.split("/"))
            lines = lines[index::count]
        if options.sample and len(lines) > options.sample:
            lines = [lines[i * len(lines) // options.sample] for i in range(options.sample)]
        save(path, data)
        runs = data.setdefault("runs", {}).setdefault(setting, {})
        todo = [line for line in lines if line not in runs or options.redo]
        note = Noter(runs, base, ranks, commit.stdout.strip(), lambda: save(path, data))
        if world == 1 and not options.fresh:  # forked at each line's first arrival, in one traced run
            journal = options.out / f"journal-{setting}.jsonl"
            journal.unlink(missing_ok=True)
            spawn = spawner(journal, options.timeout)
            fork_at = {absolute(line) for line in todo}
            forked("trace", 1, (), None, options.timeout * (len(todo) + 5), fork_at=fork_at, spawn=spawn)
            for entry in map(json.loads, journal.read_text().splitlines() if journal.exists() else []):
                note(entry["line"], [entry["result"]], entry["seconds"], "forked at the line")
            journal.unlink(missing_ok=True)
            todo = [line for line in todo if line not in note.done]
        for line in todo:  # each in a run of its own
            started = time.monotonic()
            results = forked("inject", world, ranks, absolute(line), options.timeout)
            note(line, results, round(time.monotonic() - started, 2), "a run of its own")
    save(path, data)
    write_report(data, options.out)
    failed = sum(not r["survived"] for s in options.settings.split(",") for r in data["runs"].get(s, {}).values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
