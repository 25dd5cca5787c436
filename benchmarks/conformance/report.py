"""The sweep's files: ``conformance.json`` and the table ``conformance.md`` (:func:`write_tables`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VERDICTS = ("correct", "plain-with-warning", "wrong", "crash", "skipped")
UPSTREAM_VERDICTS = ("pass", "fail", "fails-plain", "skipped", "unavailable")


def write_tables(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
    upstream = {v: sum(r.get("upstream", {}).get("verdict") == v for r in rows) for v in UPSTREAM_VERDICTS}
    upstream["not run"] = sum("upstream" not in r for r in rows)
    summary = {"meta": meta, "counts": counts, "upstream_counts": upstream, "rows": rows}
    (out / "conformance.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [
        f"# Conformance sweep, transformers {meta['transformers']}, torch {meta['torch']}",
        "",
        f"Command: `{meta['command']}`; wall time {meta['wall_seconds']:.0f} s on {meta['machine']}.",
        "",
        "Counts: " + ", ".join(f"{v} {n}" for v, n in counts.items()),
        "",
        "transformers' own test (`check_training_gradient_checkpointing`, autooffload on): "
        + ", ".join(f"{v} {n}" for v, n in upstream.items()),
        "",
        "| type | mapping | verdict | L | calls | measured | moved | arithmetic | first guess | predicted "
        "| partial moved | transformers' test | s | reason |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        arithmetic, check = r.get("arithmetic"), r.get("upstream", {})
        reasons = [str(r.get("reason", "")), f"transformers' test: {check['reason']}" if check.get("reason") else ""]
        reason = "; ".join(part for part in reasons if part).replace("|", "/").replace("\n", " ")[:400]
        cells = [r["type"], r["mapping"], r["verdict"], r.get("layers", ""), r.get("calls", ""), r.get("measured", "")]
        cells += [r.get("moved", ""), "" if arithmetic is None else round(arithmetic), r.get("first_guess") or ""]
        cells += [r.get("predicted") or "", r.get("partial_moved", ""), check.get("verdict", "")]
        cells += [r.get("seconds", r.get("wall_seconds", ""))]
        lines.append("| " + " | ".join(str(c) for c in [*cells, reason]) + " |")
    (out / "conformance.md").write_text("\n".join(lines) + "\n")
