"""benchmarks/mixed.py's judgement and its torchtune loader, with plain numbers and a stand-in package (the whole
benchmark runs in its quick form in tests/test_gpu_check.py). A mode is faster than another only where it is in
every timed pass: the tolerance is the spread the run measured, never a fixed figure."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("mixed_bench", ROOT / "benchmarks" / "mixed.py")
mixed = sys.modules.get("mixed_bench") or importlib.util.module_from_spec(spec)
if "mixed_bench" not in sys.modules:
    sys.modules["mixed_bench"] = mixed
    spec.loader.exec_module(mixed)


def result(passes: dict[str, list[float]], over: dict[str, int] | None = None, long_s: dict | None = None) -> dict:
    modes = {}
    for name, totals in passes.items():
        modes[name] = dict(
            pass_s=totals,
            long_median_s=(long_s or {}).get(name, 1.0),
            steps_over_budget=(over or {}).get(name, 0),
            warmup_steps_over_budget=0,
        )
    return {"modes": modes}


def test_faster_means_below_in_every_pass_whatever_the_medians_say():
    # auto's median is 3% below offload=True's, but one pass of three is slower: within the spread, not faster.
    room = result({"auto": [0.97, 0.95, 1.02], "offload=True": [1.00, 1.00, 1.00]})
    assert mixed.faster(room, "auto", "offload=True") is False
    room = result({"auto": [0.99, 0.995, 0.999], "offload=True": [1.00, 1.00, 1.00]})
    assert mixed.faster(room, "auto", "offload=True") is True  # by 0.1-1%, but in every pass: beyond the spread
    assert mixed.faster(room, "auto", "torchtune") is None  # a mode that did not run decides nothing


def test_the_verdicts_read_the_rule():
    room = result(
        {
            "plain": [1.0, 1.1, 1.0],
            "offload=True": [1.05, 1.15, 1.04],
            "on/stream": [1.02, 1.12, 1.01],
            "auto": [1.01, 1.12, 1.0],
            "auto/stream": [1.0, 1.1, 1.0],
            "auto/stream/keep": [0.80, 0.90, 0.84],
        },
        long_s={"plain": 1.0, "on/stream": 1.009},
    )
    budget = result(
        {"offload=True": [2, 2], "auto": [1.9, 1.95], "auto/stream": [1.8, 1.9], "auto/stream/keep": [1.7, 2.1]}
    )
    verdicts = mixed.verdicts({"room": room, "budget": budget})
    assert verdicts["auto_faster_than_offload_true"] and verdicts["auto_stream_keep_faster_than_offload_true"]
    assert verdicts["on_stream_long_within_1pct_of_plain"] and verdicts["auto_stream_not_slower_than_auto"]
    assert verdicts["keep_at_most_085_of_plain"]  # 0.80, 0.82, 0.84 of plain: median 0.82, below 1 in every pass
    assert verdicts["on_stream_not_slower_than_torchtune"] is None  # torchtune did not run
    assert verdicts["budget_auto_faster_than_offload_true"]
    assert verdicts["budget_keep_not_slower_than_auto_stream"]  # faster in one pass, slower in the other


def test_keep_at_most_085_of_plain_needs_the_median_and_every_pass():
    def verdict(keep: list[float]) -> bool:
        room = result({"plain": [1.0, 1.0, 1.0], "auto/stream/keep": keep})
        return mixed.verdicts({"room": room})["keep_at_most_085_of_plain"]

    assert verdict([0.80, 0.84, 0.86]) is True
    assert verdict([0.80, 0.84, 1.01]) is False  # median 0.84, but one pass slower than plain
    assert verdict([0.84, 0.86, 0.87]) is False  # faster in every pass, median 0.86


STAND_IN = """
import torchao
from torchao.dtypes.nf4tensor import NF4Tensor
from torchtune.modules import TiedLinear
from torchtune.utils import get_logger

log = get_logger("DEBUG")


class OffloadActivations:
    nf4 = NF4Tensor


class NoOpManager:
    tied = TiedLinear
"""


def test_torchtune_that_does_not_import_is_loaded_from_its_module_file_alone(tmp_path, monkeypatch):
    package = tmp_path / "torchtune"
    (package / "training").mkdir(parents=True)
    (package / "__init__.py").write_text('raise ImportError("torchao not installed")\n')
    (package / "training" / "__init__.py").write_text("")
    (package / "training" / "_activation_offloading.py").write_text(textwrap.dedent(STAND_IN))
    monkeypatch.syspath_prepend(str(tmp_path))
    before = {name for name in sys.modules if name.startswith(("torchao", "torchtune"))}
    found, source = mixed.torchtune_offloading()
    assert found is not None and [cls.__name__ for cls in found] == ["OffloadActivations", "NoOpManager"]
    assert "loaded alone" in source and "torchao not installed" in source
    assert {name for name in sys.modules if name.startswith(("torchao", "torchtune"))} == before  # stand-ins gone


def test_without_torchtune_the_mode_says_why():
    found, source = mixed.torchtune_offloading()
    assert found is None and source.startswith("torchtune is not installed")
