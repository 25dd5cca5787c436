"""Which cells run (per topology and configuration, per entry point, place and window) and how each is judged against
its fault-free reference and plain checkpointing."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autooffload.fallback import AT_END

from .config import (
    ACCUMULATION,
    ENGINES,
    HOST_FAULTS,
    POLICIES,
    PROBE_FAULTS,
    RECOMPUTES,
    SAVE_EVERY,
    STEPS,
    Config,
    Fault,
)
from .inject import entry_points, places
from .launch import Job, run_alone, run_ranked, run_single
from .report import CHECKS


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a configuration's cells are. ``windows``: every entry point and place fails once in each window of the
    run the fault-free run called it in (:class:`Moment`: the run's first micro-batch, a non-last and the last of an
    accumulation, each's forward and backward, an evaluation, outside a micro-batch), else once, at its middle call;
    an entry point fails before its body and, with ``after``, after it too (after the pre-forward hook's body: after
    the agreement), on the last rank; ``subsets``: the ranks an entry point's cells fail on before its body (a
    place's: the last rank); ``places``: the places inside
    a step too; ``others``: the probe and host faults; ``kill``: SIGKILL between two steps, then a resume; ``only``:
    these entry points, places and faults by name."""

    windows: bool | tuple[str, ...] = False  # a tuple: these windows only
    after: bool | tuple[str, ...] = False  # a tuple: these entry points only
    subsets: tuple[str, ...] = ("last",)
    places: bool = True
    others: bool = False
    kill: bool = False
    only: tuple[str, ...] | None = None  # these entry points, places and faults only


PRIMARY = dict(engine="sync", policy="predictive", recompute="auto")  # reaches every entry point: a kept layer's report
RUNS = ("fresh", "resumed", "rescued")


def plans(topology: str, quick: bool) -> list[tuple[Config, Plan]]:
    """The configurations of ``topology`` and their cells. Every window, on every subset of ranks, for a Qwen3 in
    the configuration that reaches every entry point; every window on the last rank for a T5 and a model entered
    through ``model.model`` (their two-rank cells hold the two repros of issue 37: a T5 failing in an encoder layer's
    report, a Qwen3 in its pre-forward hook after the agreement); once per entry point and place for the other
    engines, policies and recompute settings (all of them on one process, one on two ranks)."""
    if quick:  # recompute="auto": the one configuration that reaches every entry point (a kept layer's report)
        return [(Config(topology, recompute="auto"), Plan(after=True, others=True, kill=True))]
    hook = ("the pre-forward hook",)  # after its body: after the agreement (the Qwen3 repro of issue 37)
    every = {"one": ("last",), "ddp": ("last", "first", "all"), "zero3": ("last", "all")}[topology]
    after = True if topology == "one" else hook
    primary = Plan(True, after, every, others=topology != "zero3", kill=True)
    chosen = [(Config(topology, **PRIMARY), primary)]
    if topology == "zero3":
        return chosen
    chosen += [(Config(topology, model=model, **PRIMARY), Plan(True, after)) for model in ("t5", "inner")]
    if topology == "one":
        others = [Config(topology, e, p, r) for e in ENGINES for p in POLICIES for r in RECOMPUTES]
        return chosen + [(c, Plan(others=True, kill=True)) for c in others if c != Config(topology, **PRIMARY)]
    return [*chosen, (Config(topology, "stream", "hysteresis", "always"), Plan())]


def references(topology: str, config: Config, out: Path) -> list[Job]:
    """The fault-free runs a configuration's cells are compared with: plain checkpointing, autooffload fresh,
    autooffload resumed from the fresh run's checkpoint and (one process) with an out-of-memory step rescued."""
    base = out / "runs" / config.name.replace("/", "-")
    jobs = [
        Job(config, Fault(), "plain", str(base / "plain")),
        Job(config, Fault(), "reference", str(base / "reference")),
        Job(config, Fault(run="resumed"), "reference", str(base / "reference-resumed"),
            resume=str(base / "reference" / f"checkpoint-{SAVE_EVERY}")),
    ]  # fmt: skip
    if topology == "one":
        jobs.append(Job(config, Fault(run="rescued"), "reference", str(base / "reference-rescued")))
    return jobs


def cells(
    config: Config, calls: dict[str, list[dict[str, list[str]]]], out: Path, plan: Plan, only: tuple[str, ...] | None
) -> tuple[list[Job], list[str]]:
    """The cells of ``config`` by ``plan``, at the run kind that reaches each entry point or place on the failing
    ranks (``calls``: per run kind, each rank's windows of each call of each); and what no run kind reaches."""
    base = out / "runs" / config.name.replace("/", "-")
    checkpoint = str(base / "reference" / f"checkpoint-{SAVE_EVERY}")
    jobs, unreached = [], []
    size = len(next(iter(calls.values())))
    only = plan.only if plan.only is not None else only
    points = [("entry", w) for w in sorted(entry_points())] + [("step", w) for w in sorted(places()) if plan.places]
    for kind, where in points:
        if only is not None and where not in only:
            continue
        reached = False
        for subset in plan.subsets if kind == "entry" and size > 1 else ("last",):
            failing = [r for r in range(size) if Fault(ranks=subset).failing(r, size)]
            run = next((k for k in RUNS if k in calls and all(calls[k][r].get(where) for r in failing)), None)
            if run is None:
                continue
            reached = True
            # The ranks may call it differently often (rank 0 alone saves the callback's state): the calls of the
            # failing rank with the fewest choose, and a call in another window on another failing rank is left out.
            seen = [calls[run][r][where] for r in failing]
            for window, at in moments(min(seen, key=len), plan.windows):
                if any(w[at - 1] != window for w in seen):
                    continue
                for timing in ("before", "after") if kind == "entry" and subset == "last" else ("before",):
                    if timing == "after" and not (plan.after is True or (plan.after and where in plan.after)):
                        continue
                    fault = Fault(kind, where, timing, at, run, subset, window)
                    name = f"{kind}-{where}-{timing}-{subset}-{at}".replace(" ", "_").replace("'", "")
                    jobs.append(
                        Job(config, fault, "cell", str(base / name), resume=checkpoint if run == "resumed" else None)
                    )
        if not reached:
            unreached.append(f"{kind}: {where}")
    for kind, names in (("probe", PROBE_FAULTS), ("host", HOST_FAULTS)) if plan.others else ():
        for name in names:
            if only is None or name in only:
                jobs.append(Job(config, Fault(kind, name), "cell", str(base / f"{kind}-{name}")))
    return jobs, unreached


def moments(windows: list[str], every: bool | tuple[str, ...]) -> list[tuple[str, int]]:
    """Which calls fail, as (window, 1-based call): with ``every``, one in each window the calls fell in (in the order
    they first did; a tuple: in those windows only): a micro-batch's first (the earliest step, before anything
    after the failure could hide it) or, outside micro-batches, the middle one; else the middle call of all."""
    if every is False:
        middle = (len(windows) + 1) // 2
        return [(windows[middle - 1], middle)]
    chosen = []
    for window in dict.fromkeys(windows):
        if every is not True and window not in every:
            continue
        positions = [i + 1 for i, w in enumerate(windows) if w == window]
        chosen.append((window, positions[(len(positions) - 1) // 2 if window.startswith("outside") else 0]))
    return chosen


def judge(job: Job, ranks: list[dict | None], reference: list[dict | None], plain: list[dict | None]) -> dict:
    """A cell's verdict, from every rank's result and its configuration's fault-free ones."""
    fault = job.fault
    survived = all(r is not None and r["steps"] == STEPS for r in ranks)
    verdict: dict[str, Any] = {"key": job.key, "config": job.config.name, "fault": fault.label, "run": fault.run,
                               "at": fault.at, "window": fault.window, "survived": survived}  # fmt: skip
    if not survived:
        return verdict
    failing = [r for r in range(len(ranks)) if fault.failing(r, len(ranks))]
    verdict["identical"] = all(
        r["losses"] == ref["losses"] and r["parameters"] == ref["parameters"]
        for r, ref in zip(ranks, reference, strict=True)
    )
    verdict["plain_identical"] = fault.run != "fresh" or all(
        r["parameters"] == p["parameters"] for r, p in zip(ranks, plain, strict=True)
    )
    expected = {
        "entry": f"internal error in {fault.name} (InjectedFault: injected",
        "step": f"internal error in {fault.name} (InjectedFault: injected",
        "probe": "memory probe reset failed" if fault.name == "reset-raises" else "memory reading failed",
        "host": {"allocate-fails": "could not be allocated", "pin-fails": "pinning host memory failed",
                 "host-runs-out": "host memory is short"}.get(fault.name, "?"),
    }[fault.kind]  # fmt: skip

    # A fault may change which configuration warnings a run meets (keep-no-prediction after a missing reading):
    # what is judged is the failure's own warning, and the give-up's.
    def failure_warnings(r: dict) -> list[str]:
        return [w for w in r["warnings"] if "internal error in" in w or "gave up" in w or expected in w]

    others = [failure_warnings(ranks[i]) for i in range(len(ranks)) if i not in failing]
    warned = all(failure_warnings(ranks[i]) == [w for w in ranks[i]["warnings"] if expected in w] for i in failing)
    warned = warned and all(sum(expected in w for w in ranks[i]["warnings"]) == 1 for i in failing)
    quiet = fault.kind == "step" and places()[fault.name].quiet  # noted where no run gives up: nothing to say
    if (fault.kind == "probe" and fault.name == "none") or quiet:  # no reading for a step is no failure either
        warned = all(failure_warnings(r) == [] for r in ranks)
    elif fault.kind == "entry" and ((fault.name in AT_END and fault.timing == "after") or fault.ranks == "all"):
        warned = warned and all(o == [] for o in others)  # nothing left to tell, or nobody left to tell it to
    elif fault.kind in ("entry", "step"):
        told = f"rank {max(failing)} gave up"
        warned = warned and all(len(o) == 1 and told in o[0] for o in others)
    else:
        warned = warned and all(o == [] for o in others)
    if fault.kind in ("entry", "step"):  # raised once, in the window planned
        verdict["raised"] = all(ranks[i]["raised"] == 1 for i in failing)
        verdict["raised"] = verdict["raised"] and all(ranks[i]["raised_in"] == [fault.window] for i in failing)
    verdict["warned"] = warned
    verdict["detached"] = all(not r["leftovers"] for r in ranks)
    verdict["same_collectives"] = all(r["collectives"] == ranks[0]["collectives"] for r in ranks) and all(
        r["autooffload_collectives"] <= ref["autooffload_collectives"] for r, ref in zip(ranks, reference, strict=True)
    )
    verdict["leftovers"] = sorted({item for r in ranks for item in r["leftovers"]})
    return verdict


def kill_cells(topology: str, config: Config, out: Path, reference: list[dict | None], kill_at: int = 3) -> dict:
    """SIGKILL between steps ``kill_at`` and ``kill_at + 1`` (a checkpoint after every step), then a resume from
    the last checkpoint; the resumed run must end as the uninterrupted fault-free one did."""
    from transformers.trainer_utils import get_last_checkpoint

    base = out / "runs" / config.name.replace("/", "-") / "kill"
    killed = Job(config, Fault("kill"), "cell", str(base), kill_at=kill_at, save_every=1)
    scratch = out / "scratch"
    if topology == "one":
        code, _ = run_single(killed, scratch)
        died = code == -signal.SIGKILL
    else:
        died = any(r is None for r in run_ranked([killed], scratch, timeout_s=600).get(killed.key, [None]))
    checkpoint = get_last_checkpoint(str(base))
    verdict = {"key": killed.key, "config": config.name, "fault": "kill", "run": "resumed", "at": kill_at,
               "killed": died, "checkpoint": Path(checkpoint).name if checkpoint else None}  # fmt: skip
    if checkpoint is None:
        return {**verdict, "survived": False}
    resumed = Job(config, Fault("kill", run="resumed"), "cell", str(base) + "-resumed", resume=checkpoint)
    if topology == "one":
        _, result = run_single(resumed, scratch)
        ranks = [result]
    else:
        ranks = run_ranked([resumed], scratch, timeout_s=600).get(resumed.key, [None, None])
    survived = all(r is not None and r["steps"] == STEPS for r in ranks)
    verdict["survived"] = survived and died
    if survived:
        tail = kill_at * ACCUMULATION
        exact = all(
            r["losses"] == ref["losses"][tail:] and r["parameters"] == ref["parameters"]
            for r, ref in zip(ranks, reference, strict=True)
        )
        same = all(r["collectives"] == ranks[0]["collectives"] for r in ranks)
        detached = all(not r["leftovers"] for r in ranks)
        verdict.update(identical=exact, resumed_exactly=exact, detached=detached, warned=True, same_collectives=same)
    return verdict


def run_topology(
    topology: str,
    out: Path,
    quick: bool,
    only: tuple[str, ...] | None,
    log: Callable[[str], None],
    kill: bool = True,
    chosen: list[tuple[Config, Plan]] | None = None,
) -> list[dict]:
    """Every configuration of ``topology`` (``chosen``: these instead of :func:`plans`'): its fault-free runs, then
    its cells."""
    scratch = out / "scratch"
    runner = run_alone if topology == "one" else run_ranked
    verdicts: list[dict] = []
    fault_free: dict[Config, dict[str, list[dict | None]]] = {}  # a configuration planned twice runs them once
    for config, plan in chosen if chosen is not None else plans(topology, quick):
        if config not in fault_free:
            refs = references(topology, config, out)
            done = runner(refs, scratch)
            missing = [job.key for job in refs if any(r is None for r in done.get(job.key, [None]))]
            if missing:
                log(f"{config.name}: fault-free runs failed: {missing}")
                verdicts.append({"config": config.name, "fault": "fault-free runs", "survived": False})
                continue
            fault_free[config] = {job.fault.run if job.role == "reference" else "plain": done[job.key] for job in refs}
        results = fault_free[config]
        calls = {run: [r["calls"] for r in results[run]] for run in RUNS if run in results}
        moved = [r["bytes_moved"] for r in results["fresh"]]
        jobs, unreached = cells(config, calls, out, plan, only)
        log(f"{config.name}: fault-free moved {moved} bytes; {len(jobs)} cells; not reached: {unreached}")
        outcome = runner(jobs, scratch)
        for job in jobs:
            ranks = outcome.get(job.key, [None] * (1 if topology == "one" else 2))
            verdict = judge(job, ranks, results[job.fault.run], results["plain"])
            verdict["topology"], verdict["model"] = topology, config.model
            if not verdict["survived"]:
                verdict["output"] = outcome.get(job.key + " output")
            verdicts.append(verdict)
        for point in unreached:
            if point.startswith("entry: "):
                verdicts.append({"config": config.name, "topology": topology, "fault": point, "unreached": True})
        if kill and plan.kill:
            verdict = kill_cells(topology, config, out, results["fresh"])
            verdict["topology"], verdict["model"] = topology, config.model
            verdicts.append(verdict)
        bad = [v.get("key") for v in verdicts[-len(jobs) - 1 :] if not all(v.get(k, True) for k in CHECKS)]
        log(f"{config.name}: {len(jobs)} cells judged; not all checks held: {bad}")
    return verdicts
