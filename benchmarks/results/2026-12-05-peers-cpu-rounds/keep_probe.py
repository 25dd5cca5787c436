"""peers.py with each keep count of autooffload's keep planner logged, as shares of the budget.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/results/2026-12-05-peers-cpu-rounds/keep_probe.py \
        --out DIR --scenario e d --rounds 2 --skip-side-effects --modes plain compile-1.0 compile-auto
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

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


keep_plan.KeepPlanner.count = count
peers.main(sys.argv[1:])
