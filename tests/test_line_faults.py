"""A sample of the line-level fault injection (``benchmarks/line_faults.py``; the whole of it, every line of
``autooffload/`` a training run executes, runs there with its results in ``benchmarks/results/``): 20 lines spread
over the package, each failing once in its own Trainer run on one process. Every run must finish every step with
plain checkpointing's losses and parameters bit for bit, warn at most once and leave no host bytes lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_fault_at_any_line_leaves_the_run_plain_checkpointings(tmp_path: Path):
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "benchmarks.line_faults", "--out", str(tmp_path), "--quick"]
    done = subprocess.run(command, env=environment, cwd=ROOT, capture_output=True, text=True, timeout=600)
    data = json.loads((tmp_path / "results.json").read_text())
    base, runs = data["baselines"]["one"], data["runs"]["one"]
    assert base["trace_identical_to_plain"] == [True] and base["trace"][0]["bytes_moved"] > 0  # it offloaded
    assert len(runs) == 20, done.stdout[-2000:] + done.stderr[-2000:]
    from benchmarks.line_faults.report import kind

    broken = {line: run["broken"] for line, run in runs.items() if not run["survived"] and not kind(line, run)}
    assert not broken, broken
    assert all(run["fired"] == [True] for run in runs.values()), {k: r["fired"] for k, r in runs.items()}


class DictBackedProbe:
    """A user's probe whose ``__getattr__`` reads a dict: an attribute it lacks raises KeyError, not
    AttributeError, so ``getattr(probe, name, default)`` raises (the pattern of issue 49's second defect)."""

    def __init__(self) -> None:
        self.fields = {"total": 80 * 2**30}

    def __getattr__(self, name: str):
        return self.__dict__["fields"][name]

    def read(self):
        return None


def test_a_failure_while_attach_builds_the_controller_trains_on_with_plain_checkpointing(tmp_path):
    """Found by the line-level run: every line of the controller's construction (``attach(trainer)`` ->
    ``AutoOffloadCallback.__init__`` -> ``OffloadController.__init__``) raised out of ``attach`` before training
    started (benchmarks/results/2026-12-07-line-faults-cpu). A real trigger: a probe whose ``__getattr__`` raises
    KeyError. The run must train with one warning and plain checkpointing's losses; a setting the caller got wrong
    still raises."""
    import pytest
    import torch
    from conftest import InOrderTrainer, dataset, model, training_args

    from autooffload import AutoOffloadWarning
    from autooffload.callback import attach
    from autooffload.settings import SettingsError

    def run(**kwargs):
        net = model()
        trainer = InOrderTrainer(
            model=net, args=training_args(tmp_path, 2, offload=None), train_dataset=dataset([64, 128])
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", AutoOffloadWarning)
            if kwargs:
                attach(trainer, **kwargs)
            trainer.train()
        ours = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
        return (
            [h["loss"] for h in trainer.state.log_history if "loss" in h],
            [p.detach().clone() for p in net.parameters()],
            ours,
        )

    plain_losses, plain_parameters, _ = run()
    losses, parameters, ours = run(mode="on", probe=DictBackedProbe())
    assert len(ours) == 1 and "construction" in ours[0] and "KeyError" in ours[0], ours
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(parameters, plain_parameters, strict=True))
    with pytest.raises(SettingsError):
        attach(
            InOrderTrainer(model=model(), args=training_args(tmp_path, 1, offload=None), train_dataset=dataset([64])),
            seq_high=-1,
        )


class DictBackedStep:
    """A user's ``training_step`` replacement: a callable whose ``__getattr__`` reads a dict (KeyError, not
    AttributeError, for an attribute it lacks, such as ``__wrapped__``)."""

    def __init__(self, step) -> None:
        self.fields = {"step": step}

    def __getattr__(self, name: str):
        return self.__dict__["fields"][name]

    def __call__(self, *args, **kwargs):
        return self.fields["step"](*args, **kwargs)


def test_a_failure_while_attach_wraps_the_trainer_trains_on_with_plain_checkpointing(tmp_path):
    """Found by the line-level run: a failure in ``attach(trainer)`` after the callback was added (the rescue's
    checks and wrapper, the clean-up wrapper of ``train``) raised out of ``attach``. A real trigger: a
    ``training_step`` the user replaced with a callable whose ``__getattr__`` raises KeyError (the rescue looks for
    its ``__wrapped__``). The run must train with one warning and plain checkpointing's losses."""
    import torch
    from conftest import InOrderTrainer, dataset, model, training_args

    from autooffload import AutoOffloadWarning
    from autooffload.callback import attach

    def run(ours: bool):
        net = model()
        trainer = InOrderTrainer(
            model=net, args=training_args(tmp_path, 2, offload=None), train_dataset=dataset([64, 128])
        )
        trainer.training_step = DictBackedStep(trainer.training_step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", AutoOffloadWarning)
            if ours:
                attach(trainer, mode="on", probe=None)
            trainer.train()
        warned = [str(w.message) for w in caught if issubclass(w.category, AutoOffloadWarning)]
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, [p.detach().clone() for p in net.parameters()], warned

    plain_losses, plain_parameters, _ = run(ours=False)
    losses, parameters, warned = run(ours=True)
    assert len(warned) == 1 and "attach(trainer)" in warned[0] and "KeyError" in warned[0], warned
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(parameters, plain_parameters, strict=True))
