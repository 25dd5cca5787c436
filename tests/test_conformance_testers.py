"""The conformance sweep's ``testers`` column (``benchmarks/conformance/testers.py``) on a handful of model types:
each model class of the type's own test, built from its ``ModelTester``'s config and trained on its inputs, with and
without a counting wrapper on the first layer's function, ``use_reentrant`` True and False, plain against autooffload
``on``. Each type must be ``correct``: loss and gradients bit-identical, the wrapper's forwards the same, the bytes
moved equal to the layer inputs the checkpoints hold (less the wrapped layer's, which autooffload leaves with one
warning), no other warning. The types are those issue 50's four defects showed on (LUKE's views of one storage,
Swin's stages around checkpointed blocks, ViT's pixel inputs, T5's wrapped first block) and a causal LM (Qwen3).

transformers' test tree is not in its wheel nor, from 5.25, in its sdist: the test skips where none is found
(``$TRANSFORMERS_TESTS`` or ``~/.cache/autooffload/transformers-tests``; how one is laid out: the module's docstring).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.conformance import testers

TYPES = ["luke", "swin", "t5", "vit", "qwen3"]


@pytest.fixture(scope="module")
def tree():
    try:
        return testers.tree_path()
    except testers.TreeUnavailable as error:
        pytest.skip(str(error))


@pytest.mark.parametrize("model_type", TYPES)
def test_each_model_class_trains_with_its_testers_inputs_as_plain_checkpointing_and_moves_what_is_held(
    tree, model_type
):
    if model_type not in testers.tester_types(tree):
        pytest.skip(f"{tree} has no test of {model_type}")
    row = testers.check_tester(model_type, tree, upstream_check=False)
    if row["verdict"] == "skipped":
        pytest.skip(row["reason"])
    assert row["verdict"] == "correct", row["reason"]
    scenarios = [s for s in row["classes"].values() if isinstance(s, dict)]
    assert scenarios and all(len(s) == len(testers.SCENARIOS) for s in scenarios)
    moved = [v for s in scenarios for v in s.values() if v["outcome"] == "correct"]
    assert moved and all(v["moved"] > 0 for v in moved)
