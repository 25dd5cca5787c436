"""results.md from results.json: per setting the counts (lines a training run executes, lines injected, survived),
every failure with its kind, where it struck and what broke, the lines a run did not reach, and the lines that failed
at an earlier commit (``earlier``: a run redone after a fix). The code of a line is read at the commit its run ran
at (``git show``), so that a report written later names the code that was run."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

from .tracing import ROOT

# Lines whose only work is to pass the call on to code that is not autooffload's (the user's layer, the trainer's
# train or training_step) or to a shielded place (autooffload.guard.passes_on): an exception there is the step's.
PASSING_ON = (
    "return train(*args, **kwargs)",
    "return checkpoint(function, *args, **kwargs, **call_kwargs)",
    "loss = inner(model, inputs, *args, **kwargs)",
    "count(args)",
    "with hooks(args):",
    "output = function(*inner_args, **inner_kwargs)",
    "return function(*inner_args, **inner_kwargs)",
)

# Lines of autooffload's own that this run found failing and that are not fixed yet (issue 49, open): a file's line by
# its text. The host memory manager's loan bookkeeping changes two counts or a count and a list in separate lines;
# keep's measuring checkpoint function, the saved-bytes counter and the rescue's wrapper run unshielded lines of ours
# inside the user's call. Listed, each run still reports them; tests/test_line_faults.py fails on any other.
OPEN = {
    "autooffload/apply/host_memory.py": (
        "if buffer is None and fits and fits[0] in free:",
        "return buffer",
        "buffer.last_step = self.step",
        "self._free[buffer.device].remove(buffer)",
        "self.lent_bytes += buffer.nbytes",
        "self.allocations += 1",
        "self.held_bytes += size",
        "self.lent_bytes += size if lent else 0",
        "self.pinned_bytes += size if buffer.pinned else 0",
        "self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)",
        "self._count_new(buffer, size, lent=True)",
        'self.syncs += 2 if not pinned and device.type == "cuda" else 0',
    ),
    "autooffload/apply/keep.py": (
        "if done or not torch.is_grad_enabled():",
        "end_marks(mark, output)",
        "end(measure, counter)",
    ),
    "autooffload/observe/saved.py": ("return self",),
    "autooffload/rescue.py": (
        "owner = controller() if callable(controller) else controller",
        "owner.faults.shield(STEP_START, remember, forget)()",
    ),
}


@functools.cache
def _text(commit: str | None, path: str) -> tuple[str, ...]:
    if commit is None:
        return tuple((ROOT / path).read_text().splitlines())
    shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return tuple(shown.stdout.splitlines())


def source(line: str, commit: str | None = None) -> str:
    """The code at ``line`` (``path:number``) at ``commit`` (None: as checked out)."""
    path, number = line.rsplit(":", 1)
    text = _text(commit.removesuffix("-dirty") if commit else None, path)
    return text[int(number) - 1].strip() if int(number) <= len(text) else ""


def kind(line: str, run: dict[str, Any]) -> str:
    """A failure's kind: "try" (a ``try:`` line: a no-op, whose injected exception is raised before the handler it
    opens, the one line of each guard no code of its own can cover), "passes on" (:data:`PASSING_ON`), "open" (a
    known failure not fixed yet: :data:`OPEN`) or ""."""
    code = source(line, run.get("commit")).split("#")[0].strip()
    if code in OPEN.get(line.split(":")[0], ()):
        return "open"
    return "try" if code == "try:" else "passes on" if code in PASSING_ON else ""


def cell(line: str, run: dict[str, Any]) -> str:
    return source(line, run.get("commit")).replace("|", "\\|")[:90]


def moment(where: dict[str, Any] | None) -> str:
    if not where:
        return "-"
    phase = "evaluation" if where.get("evaluating") else "backward" if where.get("backward") else "forward/outside"
    return f"`{where.get('function')}`, step {where.get('step')} micro-batch {where.get('micro')}, {phase}"


def counts(runs: dict[str, dict]) -> dict[str, int]:
    failed = {k: kind(k, r) for k, r in runs.items() if not r["survived"]}
    fired = [r for r in runs.values() if any(r["fired"])]
    return {
        "injected": len(runs),
        "reached (the fault fired)": len(fired),
        "survived": sum(r["survived"] for r in runs.values()),
        "survived, warned once": sum(r["survived"] and any(r["warnings"]) for r in fired),
        "survived, no warning (an inner handler took it)": sum(r["survived"] and not any(r["warnings"]) for r in fired),
        "failed, autooffload's own work": sum(k in ("", "open") for k in failed.values()),
        "of which known and open (report.OPEN)": sum(k == "open" for k in failed.values()),
        "failed at a `try:` line (runs nothing)": sum(k == "try" for k in failed.values()),
        "failed at a line that passes the call on": sum(k == "passes on" for k in failed.values()),
        "raised in a finalizer (Python ignores it)": sum(bool(r.get("unraisable")) for r in runs.values()),
    }


def render(data: dict[str, Any]) -> str:
    out = ["# Line-level fault injection", ""]
    releases = data.get("releases", {})
    out.append("Releases: " + ", ".join(f"{k} {v}" for k, v in releases.items()) + ".")
    out.append(f"Commits the runs ran at: {', '.join(sorted(data.get('commits', [])))}.")
    out.append("")
    for setting, runs in data.get("runs", {}).items():
        base = data["baselines"][setting]
        identical = {m: base.get(f"{m}_identical_to_plain") for m in ("none", "ours", "trace")}
        commits = sorted({r.get("commit") or "?" for r in runs.values()})
        out += [f"## Setting `{setting}` (at {', '.join(commits)})", ""]
        out.append(f"- lines of autooffload/ a fault-free run executes (every rank): **{base['lines_executed']}**")
        out += [f"- {name}: **{n}**" for name, n in counts(runs).items()]
        out.append(
            f"- bit-identical to plain checkpointing (per rank): no checkpointing {identical['none']}, "
            f"autooffload fault-free {identical['ours']}, autooffload traced {identical['trace']}"
        )
        out.append("")
        failed = {k: r for k, r in sorted(runs.items()) if not r["survived"]}
        if failed:
            out += ["| line | code | kind | struck in | what broke |", "|---|---|---|---|---|"]
            out += [
                f"| `{k}` | `{cell(k, r)}` | {kind(k, r) or 'ours'} | {moment((r['where'] or [None])[0])} | "
                f"{'; '.join(r['broken'])[:300]} |"
                for k, r in failed.items()
            ]
            out.append("")
        unreached = {k: r for k, r in sorted(runs.items()) if not any(r["fired"])}
        if unreached:
            out += ["Not reached in the injected run (the fault-free run reached them; the run took another path):", ""]
            out += [f"- `{k}` `{cell(k, r)}`" for k, r in unreached.items()]
            out.append("")
        finalizers = {k: r for k, r in sorted(runs.items()) if r.get("unraisable")}
        if finalizers:
            out += ["Raised where Python ignores an exception (a finalizer, `__del__`):", ""]
            out += [f"- `{k}` `{cell(k, r)}`: {r['unraisable'][0][:200]}" for k, r in finalizers.items()]
            out.append("")
    return "\n".join(out)


def write_report(data: dict[str, Any], out: Path) -> None:
    (out / "results.md").write_text(render(data))
