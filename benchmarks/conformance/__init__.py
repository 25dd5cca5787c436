"""The conformance sweep: every model type of the installed transformers, one tiny training step each, judged by
the sweep's own hooks on torch's checkpoint (``python -m benchmarks.conformance --help``; docs/conformance.md).

Its modules, in layers from the bottom up. A module imports modules of its own layer or of the layers below it,
never above (tests/test_benchmarks_imports.py holds it to that, and to no import circle in benchmarks/):

1. ``tiny`` (the tiny sizes, :func:`~.tiny.shrink`, special ids, random text ids), ``calls`` (the hooks that
   count checkpointed calls), ``media_batches`` (image and audio batches), ``upstream`` (transformers' own
   gradient-checkpointing test): nothing of the sweep's below them.
2. ``quirks`` (what one model type needs that the generic tiny config and batch cannot guess; ``registry`` and
   ``tokens`` under the modality modules ``text``, ``speech``, ``vision*``).
3. ``models`` (tiny config, model and text batch of one type), ``steps`` (one plain, on or partial training step).
4. ``rows`` (one type built, run and judged: :func:`~.rows.check_type`), ``testers`` (the other source: one type's
   own ``ModelTester`` configs and inputs from transformers' test tree, :func:`~.testers.check_tester`).
5. ``sweep`` (every type, each in a forked child), ``report`` (``conformance.json`` and ``conformance.md``).
6. ``__main__`` (the command line).

This file imports nothing, so that importing one module of the sweep imports only what that module needs.
"""
