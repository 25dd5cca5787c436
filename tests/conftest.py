"""Shared pieces: a tiny random Qwen3, datasets of given lengths, and Trainer set-up for any transformers release."""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch
from releases import releases
from torch.utils.data import SequentialSampler
from transformers import Trainer, TrainingArguments

from autooffload import OffloadController, Settings
from autooffload.apply.host_memory import HostMemory
from autooffload.demo import MixedLengths, checkpointing_arguments, tiny_qwen3

LAYERS, HIDDEN, VOCAB = 4, 64, 256


def pytest_report_header(config) -> str:
    return f"releases: {releases()}"


def pytest_terminal_summary(terminalreporter) -> None:
    # Also under -q (which drops the header): the releases a result was obtained with, next to the result.
    terminalreporter.write_line(f"releases: {releases()}")


SUITES = ("newest", "oldest")  # ./dev test's two suites (DEV_SUITE)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "one_suite(name): under ./dev test, runs in its newest or oldest suite only")
    if os.environ.get("DEV_SUITE", "") not in ("", *SUITES):
        raise pytest.UsageError(f"DEV_SUITE={os.environ['DEV_SUITE']!r} names neither of ./dev test's suites {SUITES}")


def pytest_collection_modifyitems(config, items) -> None:
    """``./dev test`` runs the suite on two environments at once, one per core, and waits for the slower: a
    benchmark's quick run (minutes, its claims checked on one release) is marked ``one_suite`` with the suite it
    runs in, so the slower suite finishes sooner. ``DEV_SUITE`` names the suite; without it (any other run) every
    test runs. A mark that names neither suite is refused in every run: it would be skipped in both."""
    suite = os.environ.get("DEV_SUITE")
    for item in items:
        marker = item.get_closest_marker("one_suite")
        if marker is None:
            continue
        if marker.args not in [(name,) for name in SUITES] or marker.kwargs:
            shown = ", ".join([*map(repr, marker.args), *(f"{k}={v!r}" for k, v in marker.kwargs.items())])
            raise pytest.UsageError(f"{item.nodeid} is marked one_suite({shown}): name one of {SUITES}")
        if suite and marker.args[0] != suite:
            item.add_marker(pytest.mark.skip(reason=f"./dev test runs it in its {marker.args[0]} suite"))


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


def random_ids(seq: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seq))


def layer_frames(step) -> int:
    """How many times a decoder layer's Python frame ran in ``step()``: 0 when the model ran as one graph."""
    calls = []

    def profile(frame, event, arg):
        code = frame.f_code  # GradientCheckpointingLayer's wrapper: forward_with_checkpointing (5.x), __call__ (4.x)
        names = ("forward_with_checkpointing", "__call__")
        if event == "call" and code.co_filename.endswith("modeling_layers.py") and code.co_name in names:
            calls.append(1)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return len(calls)


@functools.cache
def compiles_whole() -> bool:
    """Does the tiny model, compiled with transformers' own checkpointing, run as one graph? transformers 5.25
    breaks the graph inside every checkpointed layer (``kernels``' ``use_kernelized_func`` sets a context variable in
    the attention's forward, a side effect dynamo refuses inside the checkpoint): its layers always run as frames of
    their own, so a switch compiles nothing and there is no whole graph to give back."""
    import torch._dynamo

    torch._dynamo.reset()
    net = model().train()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = torch.compile(net, backend="aot_eager")

    def step():
        compiled(input_ids=random_ids(80), labels=random_ids(80)).loss.backward()

    step()
    whole = layer_frames(step) == 0
    torch._dynamo.reset()
    return whole


def offloading(net: torch.nn.Module, engine: str = "sync") -> OffloadController:
    """An ``OffloadController`` in mode ``"on"`` (1 GiB of host memory, no probe, ``engine``), attached to ``net``:
    its host memory pins its buffers with no-op register, unregister and drain (no CUDA needed)."""
    host = HostMemory(pin=True, register=lambda t: None, unregister=lambda t: None, drain=lambda d: None)
    controller = OffloadController(Settings(mode="on", host_memory="1GiB", engine=engine), probe=None, host=host)
    controller.attach(net)
    return controller


def run_steps(net: torch.nn.Module, ids: torch.Tensor, controller=None, count: int = 2, skip_unused: bool = False):
    """``count`` training steps of ``net`` on ``ids`` (each: zero the gradients, forward to a loss, backward), the
    attached ``controller`` (None: no autooffload) ending each. Returns ``(moved, arithmetic, grads)``: the
    bytes the controller moved each step and its arithmetic's planned bytes before the step ended (both empty
    without a controller), and a copy of every parameter's gradient each step (an unused one, with no gradient,
    fails; ``skip_unused`` leaves it out)."""
    moved, arithmetic, grads = [], [], []
    for _ in range(count):
        net.zero_grad()
        net(ids).backward()
        grads.append([p.grad.clone() for p in net.parameters() if p.grad is not None or not skip_unused])
        if controller is not None:
            arithmetic.append(controller.planned_bytes())
            controller.end_step()
            moved.append(controller.last_step_bytes)
    return moved, arithmetic, grads


def same_grads(grads: list[list[torch.Tensor]], reference: list[list[torch.Tensor]]) -> bool:
    """Every step's gradients equal the reference run's, bit for bit (a step or a gradient more or fewer raises)."""
    return all(
        torch.equal(a, b)
        for step, plain in zip(grads, reference, strict=True)
        for a, b in zip(step, plain, strict=True)
    )
