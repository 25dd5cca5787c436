"""The one-call GPU check runs on the CPU in its quick form, so that a change that would break it on the GPU
breaks here first: every part, the files it leaves, the summary, and a part killed for overrunning."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
from gpu_parts.speed import SEED_MODES  # noqa: E402


def run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


@pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="the GPU machine runs transformers 5.x; one environment is enough for this minute-long check",
)
def test_quick_cpu_run_exercises_every_part(tmp_path):
    result = run("--out", str(tmp_path), "--device", "cpu", "--quick")
    report = tmp_path / "gpu_check.json"
    assert result.returncode == 0, (
        result.stdout[-3000:] + result.stderr[-3000:] + (report.read_text() if report.exists() else "")
    )
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]  # a device call brings back 8 at most
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert (
        list(parts)
        == list(gpu_check.DEFAULT_PARTS)
        == ["mixed", "seed", "engines", "pinning", "ladder", "memory_model"]
    )
    for name, part in parts.items():
        assert "error" not in part and "skipped" not in part, (name, part)
    # The mixed trace: both variants, every mode but torchtune's (CUDA only), the controllers kept across passes.
    mixed = parts["mixed"]["mixed"]
    assert set(mixed["results"]) == {"room", "budget"}
    for result in mixed["results"].values():
        assert set(result["modes"]) == {"plain", "offload=True", "on/sync", "on/stream", "auto", "auto/stream",
                                        "auto/stream/keep"}  # fmt: skip
        assert result["timed_passes"] == 2 and "torchtune" in result["skipped"]
        assert all(len(m["pass_s"]) == 2 and m["spread"] is not None for m in result["modes"].values())
    room = mixed["results"]["room"]["modes"]
    assert room["auto"]["long_offloaded"] == [0, 0]  # a reading and the arithmetic: room, nothing to offload
    assert room["on/sync"]["long_offloaded"] == [2, 2] and room["auto/stream/keep"]["kept"][-1] == 2
    assert set(mixed["verdicts"]) >= {"auto_faster_than_offload_true", "auto_stream_keep_never_over_budget"}
    assert set(parts["seed"]["modes"]) == set(SEED_MODES)
    assert set(parts["pinning"]["runs"]) == {"omp1", "threads"}
    for pinned in parts["pinning"]["runs"].values():
        ways = [row["way"] for row in pinned["step"]]
        assert ways[:2] == ["compute alone", "in step"] and "ahead, 2 threads" in ways
    assert parts["engines"]["verdicts"] == {"gradients_match_plain": True}
    assert parts["ladder"]["verdicts"] == {f"scenario_{s}_safe": True for s in "abc"}
    assert {r["engine"] for r in parts["ladder"]["ladder"]["results"]} == {"stream"}
    compared = [row for row in parts["memory_model"]["rows"] if "real_over_predicted" in row]
    assert compared, "the memory model part compared no prediction with a reading"
    summary = (tmp_path / "gpu_check.md").read_text()
    assert "| mixed | done |" in summary and "## Verdicts" in summary and "| smoke | not run |" in summary


def test_a_part_that_overruns_is_killed_and_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "START_UP_S", 0.2)  # far too short for a process that imports torch
    options = argparse.Namespace(out=tmp_path, device="cpu", quick=True)
    result = gpu_check.run_part("probe", options, 0.0, tmp_path / "gpu_check.log")
    assert result["error"].startswith("killed after")
    assert json.loads((tmp_path / "probe.json").read_text())["error"].startswith("killed after")  # no --scratch
    assert "| probe | killed after" in gpu_check.summary({"probe": result}, {"device": "cpu"})


def test_cuda_without_a_gpu_is_one_line_and_exit_2(tmp_path):
    result = run("--out", str(tmp_path), "--device", "cuda", timeout=120)
    assert result.returncode == 2
    assert result.stdout.strip().splitlines()[-1] == "gpu_check: no CUDA device; use --device cpu --quick for a dry run"
