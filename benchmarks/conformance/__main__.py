"""Conformance sweep: every model type of the installed transformers, one tiny training step each.

    python -m benchmarks.conformance --out benchmarks/results/$(date +%F)-conformance [--types a,b]
        [--mappings causal,image-text,seq2seq,speech] [--timeout 240] [--jobs 1]

For every model type in the causal-LM, image-text-to-text, seq2seq-LM and speech-seq2seq mappings, a tiny random
config trained one step three times from the same weights and batch (plain checkpointing, autooffload ``mode="on"``,
autooffload at a partial level), each type in its own subprocess with a timeout. What should move is measured with
the sweep's own hooks on torch's checkpoint entry points, not with autooffload's counters; transformers' own
``check_training_gradient_checkpointing`` judges every row a second time (``--no-upstream`` leaves it out,
``--transformers-sdist PATH`` names the sdist it is read from). What each row checks and each verdict means:
docs/conformance.md.

``--source testers`` runs the other source instead: every model type with a ``ModelTester`` in transformers' test
tree, trained with that tester's own config and inputs, each model class of its test, with and without a counting
wrapper on the first layer's function, ``use_reentrant`` True and False, plain against autooffload ``on``, and
transformers' own check class by class (:mod:`.testers`; ``--transformers-tests DIR`` names the tree).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from .report import VERDICTS, write_tables
from .rows import UPSTREAM, check_type
from .sweep import model_types, sweep
from .testers import TESTERS, check_tester, tester_types
from .tiny import MAPPINGS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's autooffload, not another one installed in the environment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.conformance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--types", help="comma-separated model types (default: every type of the mappings)")
    parser.add_argument("--mappings", default=",".join(MAPPINGS), help=f"comma-separated, of {', '.join(MAPPINGS)}")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per type")
    parser.add_argument("--jobs", type=int, default=1, help="types run at once")
    parser.add_argument("--no-upstream", action="store_true", help="do not run transformers' own checkpointing test")
    parser.add_argument("--transformers-sdist", help="the installed transformers' sdist (.tar.gz or unpacked)")
    parser.add_argument(
        "--source",
        choices=("tiny", "testers"),
        default="tiny",
        help="the sweep's own tiny models, or each model tester's config and inputs from transformers' test tree",
    )
    parser.add_argument("--transformers-tests", help="transformers' test tree for --source testers (DIR/tests/models)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--mapping", default="causal", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    UPSTREAM.update(run=not args.no_upstream and args.source == "tiny", sdist=args.transformers_sdist)
    TESTERS.update(tree=args.transformers_tests, upstream=not args.no_upstream)
    if args.one:
        one = check_tester(args.one) if args.source == "testers" else check_type(args.one, args.mapping)
        print(json.dumps(one, default=str))
        return 0
    mappings = args.mappings.split(",") if args.source == "tiny" else ["testers"]
    pairs = model_types(mappings) if args.source == "tiny" else [(t, "testers") for t in tester_types(TESTERS["tree"])]
    if args.types:
        wanted = [t.replace("-", "_") if args.source == "testers" else t for t in args.types.split(",")]
        pairs = sorted((p for p in pairs if p[0] in wanted), key=lambda p: wanted.index(p[0]))  # in the order given
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    scratch = Path(tempfile.mkdtemp(prefix="conformance-"))
    for row in sweep(pairs, args.timeout, max(1, args.jobs), scratch):
        rows.append(row)
        print(f"{row['type']:32s} {row['mapping']:10s} {row['verdict']:18s} {str(row.get('reason', ''))[:150]}")
        sys.stdout.flush()
        if args.out:  # as it goes: an interrupted sweep keeps its rows
            write_tables(rows, args.out, _meta(argv, mappings, args.timeout, start))
    meta = _meta(argv, mappings, args.timeout, start)
    if args.out:
        write_tables(rows, args.out, meta)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
    print(json.dumps(counts), f"{meta['wall_seconds']:.0f} s")
    return 0


def _meta(argv: list[str] | None, mappings: list[str], timeout: float, start: float) -> dict[str, Any]:
    import torch
    import transformers

    return {
        "date": datetime.date.today().isoformat(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} core(s), shared",
        "command": " ".join(["python -m benchmarks.conformance"] + (argv if argv is not None else sys.argv[1:])),
        "wall_seconds": time.perf_counter() - start,
        "mappings": mappings,
        "timeout_s": timeout,
        "autooffload": str(Path(__import__("autooffload").__file__).parent),
    }


if __name__ == "__main__":
    sys.exit(main())
