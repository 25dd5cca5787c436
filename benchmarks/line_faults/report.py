"""results.md from results.json: per setting the counts (lines a training run executes, lines injected, survived),
every failure with where it struck and what broke, the lines a run did not reach, and the lines that failed at an
earlier commit (``earlier``: a run redone after a fix)."""

from __future__ import annotations

import linecache
from pathlib import Path
from typing import Any

from .tracing import ROOT, absolute


def source(line: str) -> str:
    path, number = absolute(line)
    return linecache.getline(path, number).strip().replace("|", "\\|")[:90]


def a_try(line: str) -> bool:
    """A ``try:`` line: it runs nothing that can fail (a no-op in the bytecode), but a trace function's exception
    there is raised before the handler it opens; the one line of each guard that no code of its own can cover."""
    return source(line).split("#")[0].strip() == "try:"


def moment(where: dict[str, Any] | None) -> str:
    if not where:
        return "-"
    phase = "evaluation" if where.get("evaluating") else "backward" if where.get("backward") else "forward/outside"
    return f"`{where.get('function')}`, step {where.get('step')} micro-batch {where.get('micro')}, {phase}"


def counts(runs: dict[str, dict]) -> dict[str, int]:
    fired = [r for r in runs.values() if any(r["fired"])]
    return {
        "injected": len(runs),
        "fired": len(fired),
        "survived": sum(r["survived"] for r in runs.values()),
        "failed": sum(not r["survived"] and not a_try(k) for k, r in runs.items()),
        "failed at a `try:` line (runs nothing; listed below)": sum(
            not r["survived"] and a_try(k) for k, r in runs.items()
        ),
        "survived, warned once": sum(r["survived"] and any(r["warnings"]) for r in fired),
        "survived, no warning (an inner handler)": sum(r["survived"] and not any(r["warnings"]) for r in fired),
        "raised in a finalizer (ignored by Python)": sum(bool(r.get("unraisable")) for r in runs.values()),
        "fixed since an earlier run": sum(
            r["survived"] and not r.get("earlier", {}).get("survived", True) for r in runs.values()
        ),
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
        out += [f"## Setting `{setting}`", ""]
        out.append(f"- lines of autooffload/ a fault-free run executes (every rank): **{base['lines_executed']}**")
        out += [f"- {name}: **{n}**" for name, n in counts(runs).items()]
        out.append(f"- bit-identical to plain checkpointing (per rank): no checkpointing {identical['none']}, "
                   f"autooffload fault-free {identical['ours']}, autooffload traced {identical['trace']}")  # fmt: skip
        out.append("")
        failed = {k: r for k, r in sorted(runs.items()) if not r["survived"]}
        if failed:
            out += ["| line | code | struck in | what broke |", "|---|---|---|---|"]
            out += [f"| `{k}` | `{source(k)}` | {moment((r['where'] or [None])[0])} | {'; '.join(r['broken'])[:300]} |"
                    for k, r in failed.items()]  # fmt: skip
            out.append("")
        unreached = {k: r for k, r in sorted(runs.items()) if not any(r["fired"])}
        if unreached:
            out += ["Not reached in the injected run (the fault-free run reached them; the run took another path):", ""]
            out += [f"- `{k}` `{source(k)}`" for k in unreached]
            out.append("")
        fixed = {k: r for k, r in sorted(runs.items()) if r["survived"] and not r.get("earlier", {}).get("survived", 1)}
        if fixed:
            out += ["Failed at an earlier commit, survived now:", ""]
            out += ["| line | code | what broke then |", "|---|---|---|"]
            out += [f"| `{k}` | `{source(k)}` | {'; '.join(r['earlier']['broken'])[:300]} |" for k, r in fixed.items()]
            out.append("")
        finalizers = {k: r for k, r in sorted(runs.items()) if r.get("unraisable")}
        if finalizers:
            out += ["Raised where Python ignores an exception (a finalizer, `__del__`):", ""]
            out += [f"- `{k}` `{source(k)}`: {r['unraisable'][0][:200]}" for k, r in finalizers.items()]
            out.append("")
    return "\n".join(out)


def write_report(data: dict[str, Any], out: Path) -> None:
    (out / "results.md").write_text(render(data))


__all__ = ["ROOT", "render", "write_report"]
