"""What does autooffload's keep planner count in the peers benchmark's steps, and why? ``benchmarks/peers.py`` run as
it is, with each of ``KeepPlanner.count``'s decisions logged as shares of the budget (memory_high x device).

Produced benchmarks/results/2026-12-05-peers-cpu-rounds/compile-keep-counts.md:

    OMP_NUM_THREADS=1 python benchmarks/probes/keep_counts_in_peers.py \
        --out DIR --scenario e d --rounds 2 --skip-side-effects --modes plain compile-1.0 compile-auto

Takes peers.py's arguments; prints a ``COUNT`` line per decision: the all-recompute prediction, the footprints it
does not cover (``beyond``), the margin, the misses, each layer's cost, the earlier forwards of the group and the
count. A probe run once to answer one question, not a benchmark the suite runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import peers  # noqa: E402

from autooffload.decide import keep_plan  # noqa: E402

planned = keep_plan.KeepPlanner.count


def count(self, predicted, tokens, seq, limit, margin, levels=None, *rest, **named):
    out = planned(self, predicted, tokens, seq, limit, margin, levels, *rest, **named)  # widen_by, from a8ab01e on
    costs = [round((c or 0) / limit, 3) for c in self.layer_costs(tokens, seq)]
    print(
        f"COUNT tok={tokens} pred/limit={predicted / limit:.3f} beyond/limit={self.beyond() / limit:.3f} "
        f"margin/limit={margin / limit:.3f} misses={self.misses} costs/limit={costs} "
        f"extra/limit={self.extra(tokens) / limit:.3f} group={[(f.keep, f.tokens) for f in self._group]} "
        f"levels={levels} -> {out}",
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    keep_plan.KeepPlanner.count = count
    return peers.main(argv)


if __name__ == "__main__":
    sys.exit(main())
