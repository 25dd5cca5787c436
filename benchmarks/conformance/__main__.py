"""Conformance sweep: every model type of the installed transformers, one tiny training step each.

    python -m benchmarks.conformance --out benchmarks/results/$(date +%F)-conformance [--types a,b]
        [--mappings causal,image-text,seq2seq,speech] [--timeout 240] [--jobs 1]

For every model type in the causal-LM, image-text-to-text (text-only batches), seq2seq-LM and speech-seq2seq
mappings: build a tiny random config (:func:`tiny_config`: every size key of the config and of its nested
sub-configs shrunk, lists per layer cut to the new depth), then train one step three times from the same
weights and batch: plain checkpointing, autooffload ``mode="on"``, and autooffload at a partial level (a
fixed policy, about half the layers). autooffload runs the sync engine with real copies into pageable host
buffers (a :class:`~autooffload.apply.host_memory.HostMemory` that "pins" with no-op calls, so the hooks copy
on a CPU as they would into pinned memory on a GPU).

What the sweep measures is its own: it wraps torch's checkpoint entry points
(``torch.utils.checkpoint``'s private functions behind ``checkpoint``, found for the installed torch by a
probe call: :func:`checkpoint_entry_points`; it stops with an error where it finds none), which every checkpointed
call of every stack goes through, and records each grad-enabled call's layer input (its first
positional tensor, once per tensor per forward). With text-only batches only the stacks that consume the
tokens run (a VLM's vision tower does not), so the calls seen are those of the token stacks (both stacks of an
encoder-decoder). Checked per type:

- no exception in any run;
- ``on``: bytes moved == the bytes of every recorded call's input == the arithmetic autooffload reports
  (``planned_bytes()``: each offloaded layer's calls x the bytes its first call reported);
- ``on``, the same batch once more: what the decision sizes all planned layers at *before* that forward (each
  stack's length read from the batch x the bytes per token its layers' calls showed) == the bytes it moves.
  The table also shows the first decision's figure (``first guess``: the config's widths, before any layer
  ran), which is informative only;
- partial: bytes moved == the arithmetic, and equal to the inputs of the very layers it offloaded (every call
  of each; the module's recorded inputs);
- loss and every gradient bit-identical to plain checkpointing, in both runs;
- warnings (``AutoOffloadWarning`` and the ``transformers.autooffload`` log at WARNING) are collected; a
  run that moves what it should must warn nothing, a run left on plain checkpointing must say so once.

Beside the verdict, a second source judges each row that ran: transformers' own test,
``check_training_gradient_checkpointing`` from the source distribution of the installed release, run on the row's
model class, tiny config and batch with autooffload attached in mode ``on`` (:mod:`.upstream`; column
``transformers' test``: ``pass``, ``fail`` where it passes without autooffload, ``fails-plain`` where it fails
without autooffload too, ``skipped``). ``--no-upstream`` leaves it out; ``--transformers-sdist PATH`` names the sdist
(else it is fetched once with pip into a cache).

``--source testers`` runs the other source instead: every model type with a ``ModelTester`` in transformers' test
tree, trained with that tester's own config and inputs, each model class of its test, with and without a counting
wrapper on the first layer's function, ``use_reentrant`` True and False, plain against autooffload ``on``, and
transformers' own check class by class (:mod:`.testers`; ``--transformers-tests DIR`` names the tree).

Verdicts: ``correct``; ``plain-with-warning`` (nothing moved, one warning, results identical: the warning's
text is in the table for a reader to judge); ``wrong`` (what differs); ``crash`` (autooffload raised, or the
child process died or timed out); ``skipped`` (no tiny config, no checkpointing support, or the plain
checkpointed step itself fails: why). Every type runs in its own subprocess with a timeout.
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
