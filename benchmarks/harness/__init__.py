"""The pieces every question script in benchmarks/ shares, so that each script says only what it asks.

From the bottom up (a module imports only modules listed before it, and nothing of benchmarks/ outside ``harness/``;
``tests/test_benchmarks_imports.py``):

- ``environment``: the run's environment line (date, device, releases, the command, the commit), the CPU's model and
  its load, the ``AUTOOFFLOAD_*`` variables a benchmark ignores;
- ``verdicts``: medians and spreads, per-round ratios, "faster in every round", PASS / FAIL, a per-call cost's
  median, mean, 90th percentile and maximum;
- ``results``: writing a run's JSON and Markdown (and matplotlib for a figure);
- ``rounds``: the timing loop: modes interleaved step by step in a rotating order, a step's clock (CUDA events, or
  the process's CPU time), Python's full collections kept out of timed steps, a run's time budget;
- ``compiled``: what dynamo did when many compiled modes share one process;
- ``models``: the tiny random models and their shapes (and a Qwen3 of any proportions), token ids, checkpointing on
  and off under every release's name for it, the probe whose reading is the step's measured peak;
- ``forms``: the other ways to hold checkpointed inputs (torch's ``save_on_cpu`` wrap, transformers' ``offload=True``,
  torchtitan's selective policy, torchtune's ``OffloadActivations``);
- ``trace_modes``: the modes of a mixed-length trace (``mixed.py``, the GPU check's seed part) on one shared model,
  and one measured step (time, peak, plan, Python's collections, autooffload's own costs);
- ``scenarios``: the ladder's scenarios (a shared model, traces of lengths, budgets from calibration readings) and
  the mode a peer builds on; ``ladder.py``, ``peers.py`` and ``compile_forms.py`` ask their questions of them.
- ``peer_modes``: PyTorch's own ways (``offload=True``, selective checkpointing, compiled budgets, layers compiled in
  place) as modes on the scenarios' shared model, and compiled ``auto``'s losses and gradients against plain's.

Scripts put benchmarks/ on ``sys.path`` (as they always did) and import ``harness.<module>``.
"""
