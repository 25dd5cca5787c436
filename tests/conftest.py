"""Shared pieces: a tiny random Qwen3, datasets of given lengths, and Trainer set-up for any transformers release."""

from __future__ import annotations

import os

import pytest
import torch
from releases import releases
from torch.utils.data import SequentialSampler
from transformers import Trainer, TrainingArguments

from autooffload.demo import MixedLengths, checkpointing_arguments, tiny_qwen3

LAYERS, HIDDEN, VOCAB = 4, 64, 256


def pytest_report_header(config) -> str:
    return f"releases: {releases()}"


def pytest_terminal_summary(terminalreporter) -> None:
    # Also under -q (which drops the header): the releases a result was obtained with, next to the result.
    terminalreporter.write_line(f"releases: {releases()}")


NEW_NAMES = "activation_checkpointing" in TrainingArguments.__dataclass_fields__


@pytest.fixture(autouse=True)
def _clean_autooffload_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("AUTOOFFLOAD_"):
            monkeypatch.delenv(key)


def model(layers: int = LAYERS, hidden: int = HIDDEN, seed: int = 0) -> torch.nn.Module:
    return tiny_qwen3(layers, hidden, VOCAB, seed)


def dataset(lengths: list[int]) -> MixedLengths:
    return MixedLengths(lengths, VOCAB)


class InOrderTrainer(Trainer):
    """A Trainer that feeds the dataset in order, so a test knows which step sees which length."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def training_args(
    tmp_path,
    steps: int,
    offload: object = "auto",
    checkpointing: bool = True,
    arguments: type[TrainingArguments] = TrainingArguments,
    **extra,
) -> TrainingArguments:
    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=1,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    if checkpointing:
        kwargs.update(checkpointing_arguments(offload))
        if offload is None:
            kwargs = {k: ({} if k.endswith("_kwargs") else v) for k, v in kwargs.items()}
    kwargs.update(extra)
    return arguments(**kwargs)


def train(tmp_path, lengths, callbacks=(), offload: object = "auto", steps: int | None = None, seed: int = 0, **extra):
    """Train a fresh tiny model in order over ``lengths``; returns (trainer, model)."""
    net = model(seed=seed)
    args = training_args(tmp_path, steps or len(lengths), offload, **extra)
    trainer = InOrderTrainer(model=net, args=args, train_dataset=dataset(lengths), callbacks=list(callbacks))
    trainer.train()
    return trainer, net


def expected_bytes(seq: int, batch: int = 1, layers: int = LAYERS, hidden: int = HIDDEN, dtype_bytes: int = 4) -> int:
    return layers * batch * seq * hidden * dtype_bytes
